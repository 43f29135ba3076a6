"""Load a checkpoint into our model: a Hugging Face directory (config.json + safetensors, single or sharded,
full precision or saved quantized by `switchyard engine quantize`) or a GGUF file (hosted/gguf_loader.py).

Nothing is downloaded: every file must already be there, and whatever is missing is named.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from hosted import gguf_loader
from hosted.config import ConfigError, ModelConfig
from hosted.gguf_loader import INT4_GROUP_SIZE
from hosted.layers.linear import check_model_quantizable, quantizable_linears, quantize_model, scheme_key
from hosted.models import is_gguf, resolve_model_path
from hosted.models.llama import LlamaForCausalLM
from kernels import ops

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# HF tensor name -> (our parameter path, shard index within a merged Linear or None).
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MERGED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_PLAIN = ("self_attn.o_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {name!r}") from None


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's weight files, checking that every file an index names exists."""
    path = Path(model_dir)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ConfigError(f"{str(index)!r} is not a valid safetensors index (needs 'weight_map')") from exc
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise ConfigError(f"{str(path)!r}: shard file(s) named in model.safetensors.index.json are missing: "
                              f"{', '.join(missing)}")
        return [path / n for n in names]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if found:
        return found
    other = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
    hint = f" (found {', '.join(other)}: only safetensors weights are supported)" if other else ""
    raise ConfigError(f"{str(path)!r}: no model.safetensors, model.safetensors.index.json or *.safetensors{hint}")


def load_model(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
               quantization: str | None = None, quantization_group_size: int = 128,
               kernels: ops.Kernels | None = None, progress: bool = False) -> LlamaForCausalLM:
    """Build the model on `device` and fill it from the checkpoint: a HF directory, a GGUF file
    (hosted/gguf_loader.py) or a `package:` reference to either (hosted/models). With `quantization`
    ("int8" | "int4"), every decoder-layer linear is then quantized in place and its `dtype` weight freed (see
    hosted/layers/linear.py); the embedding and lm_head stay in `dtype`. Linears that arrive quantized (a
    checkpoint saved by `switchyard engine quantize`, GGUF Q4_0/Q4_1 blocks under int4 with group size 32)
    are loaded as they are. The model's layers call `kernels` (default: the backend for `device`, chosen
    now). `progress` shows a bar over the tensors read."""
    path = resolve_model_path(model_dir)
    # Fail on missing files, tensors or bad types before allocating anything.
    weights = gguf_loader.GGUFWeights(path, cfg) if is_gguf(path) else None
    files = safetensors_files(path) if weights is None else []
    scheme, group_size = _checkpoint_scheme(cfg, quantization, quantization_group_size)
    kernels = kernels if kernels is not None else ops.select(device)
    with torch.device(device):  # torch.empty: pages are touched only when loaded
        model = LlamaForCausalLM(cfg, dtype, device, kernels)
    model.eval()
    if scheme is not None:
        check_model_quantizable(model, scheme, group_size)  # before reading any weight
    if cfg.quantization is not None:  # saved quantized: every quantizable linear arrives as qweight/scales
        for _, layer in quantizable_linears(model):
            layer.init_quantized_(cfg.quantization, cfg.quantization_group_size)
    if weights is not None:
        int4_names = _map_gguf_int4(model, weights) if (scheme, group_size) == ("int4", INT4_GROUP_SIZE) else set()
        total = len(weights.tensors) + 2 * len(int4_names)  # an int4 part comes as qweight, scales, zeros
        load_tensors(model, _progress(weights.named_tensors(frozenset(int4_names)), progress, total), str(path))
    else:
        load_weights(model, files, progress, cfg.storage_int8_block_size)
    if scheme is not None:
        quantize_model(model, scheme, group_size, progress=progress)  # skips the linears loaded quantized
        if device.type == "cuda":
            # Hand the freed full-precision weights back to the driver: the KV pool is sized from free memory.
            torch.cuda.empty_cache()
    return model


def _checkpoint_scheme(cfg: ModelConfig, quantization: str | None, group_size: int) -> tuple[str | None, int]:
    """The quantization the loaded model ends up with: the one requested, or the one the checkpoint was saved
    with (a request for another one fails: re-quantizing quantized weights would round twice)."""
    if cfg.quantization is None:
        return quantization, group_size
    saved = scheme_key(cfg.quantization, cfg.quantization_group_size)
    if quantization is not None and scheme_key(quantization, group_size) != saved:
        what = f"{cfg.quantization}" + (f" with group size {saved[1]}" if saved[1] else "")
        raise ConfigError(f"the checkpoint is already quantized ({what}); drop --quantization (or ask for the "
                          f"same scheme), or quantize the unquantized checkpoint instead")
    return cfg.quantization, cfg.quantization_group_size


def _map_gguf_int4(model: LlamaForCausalLM, weights: gguf_loader.GGUFWeights) -> set[str]:
    """Turn every quantizable linear whose parts are all Q4_0/Q4_1 into empty int4 g32 parameters; return the
    HF names of those parts (to be read as int4 blocks rather than dequantized)."""
    types = weights.types()
    names: set[str] = set()
    for name, layer in quantizable_linears(model):
        parts = [_hf_name(f"{name}.weight", i if len(layer.shard_sizes) > 1 else None)
                 for i in range(len(layer.shard_sizes))]
        if all(types.get(p) in gguf_loader.INT4_TYPES for p in parts):
            layer.init_quantized_("int4", INT4_GROUP_SIZE)
            names.update(parts)
    return names


def _progress(items: Iterable[Any], enabled: bool, total: int | None = None) -> Iterable[Any]:
    return tqdm(items, total=total, desc="loading tensors", unit="tensor") if enabled else items


def load_weights(model: LlamaForCausalLM, files: list[Path], progress: bool = False,
                 int8_block_size: int = 0) -> None:
    """Copy every tensor of the safetensors `files` into its (possibly merged) parameter; with
    `int8_block_size`, tensors stored as int8 NAME + NAME_scale are dequantized first (int8_storage)."""
    named = _safetensors_tensors(files)
    if int8_block_size:
        named = dequantize_int8_storage(named, int8_block_size)
    load_tensors(model, _progress(named, progress), ", ".join(str(f) for f in files))


def int8_storage(tensor: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D float tensor as int8 values and fp16 scales, one scale per `block` consecutive values of a row (the
    layout of GGUF's Q8_0): storage for a small file, dequantized at load (not a quantized model)."""
    rows, cols = tensor.shape
    if cols % block:
        raise ValueError(f"int8 storage: {cols} columns are not a multiple of the block size {block}")
    blocks = tensor.detach().float().reshape(rows, cols // block, block)
    scale = (blocks.abs().amax(dim=-1) / 127.0).to(torch.float16)
    safe = scale.float().clamp(min=torch.finfo(torch.float16).tiny).unsqueeze(-1)
    q = torch.round(blocks / safe).clamp_(-127, 127).to(torch.int8)
    return q.reshape(rows, cols), scale


def dequantize_int8_storage(named: Iterable[tuple[str, torch.Tensor]],
                            block: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Pair every int8 NAME with its NAME_scale (either order) and yield NAME as fp32; pass the rest through."""
    pending: dict[str, torch.Tensor] = {}
    for name, tensor in named:
        base = name[: -len("_scale")] if name.endswith(".weight_scale") else name
        if base == name and not (tensor.dtype == torch.int8 and name.endswith(".weight")):
            yield name, tensor
            continue
        if base not in pending:
            pending[base] = tensor
            continue
        other = pending.pop(base)
        q, scale = (other, tensor) if base != name else (tensor, other)
        if q.dim() != 2 or scale.shape != (q.shape[0], q.shape[1] // block) or q.shape[1] % block:
            raise ConfigError(f"tensor {base!r}: int8 storage of shape {tuple(q.shape)} does not match its scales "
                              f"{tuple(scale.shape)} at block size {block}")
        values = q.float().reshape(q.shape[0], -1, block) * scale.float().unsqueeze(-1)
        yield base, values.reshape(q.shape)
    if pending:
        raise ConfigError(f"int8 storage: tensor(s) without their value/scale pair: {', '.join(sorted(pending))}")


def _safetensors_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        try:
            opened = safe_open(str(file), framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own SafetensorError (not an OSError) on a bad file
            raise ConfigError(f"{str(file)!r} is not a readable safetensors file: {exc}") from exc
        with opened as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                try:
                    tensor = f.get_tensor(name)
                except Exception as exc:
                    raise ConfigError(f"{str(file)!r}: tensor {name!r} cannot be read "
                                      f"(truncated or corrupt file): {exc}") from exc
                yield name, tensor


def load_tensors(model: LlamaForCausalLM, named: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
    """Copy every (HF name, tensor) into its (possibly merged) parameter; error on gaps or strays."""
    cfg = model.config
    params = dict(model.named_parameters())
    # Every (parameter, shard) that must be filled: merged Linears need each of their parts.
    expected: set[tuple[str, int | None]] = set()
    for name in params:
        module_path = name.rpartition(".")[0]
        module = model.get_submodule(module_path)
        shards = getattr(module, "shard_sizes", None)
        if shards is not None and len(shards) > 1:
            expected.update((name, i) for i in range(len(shards)))
        else:
            expected.add((name, None))
    loaded: set[tuple[str, int | None]] = set()
    unexpected: list[str] = []
    for hf_name, tensor in named:
        target = _map_name(hf_name, cfg)
        if target is None:
            continue
        name, shard = target
        if target == ("", None) or name not in params:
            unexpected.append(hf_name)
            continue
        _copy_into(model, params[name], name, shard, tensor, hf_name)
        loaded.add((name, shard))
    if unexpected:
        raise ConfigError(f"{source}: checkpoint holds tensors this {cfg.architecture} model does not use: "
                          f"{', '.join(unexpected[:10])}{' …' if len(unexpected) > 10 else ''}")
    missing = expected - loaded
    if missing:
        names = sorted(_hf_name(n, s) for n, s in missing)
        raise ConfigError(f"{source}: checkpoint lacks weights for: {', '.join(names[:10])}"
                          f"{' …' if len(names) > 10 else ''}")


def _map_name(hf_name: str, cfg: ModelConfig) -> tuple[str, int | None] | None:
    """Our (param name, shard) for an HF tensor name; None to skip it; ('', None) if unknown."""
    if hf_name.endswith(_IGNORED_SUFFIXES):
        return None
    if hf_name == "model.embed_tokens.weight":
        return "embed_tokens.weight", None
    if hf_name == "model.norm.weight":
        return "norm.weight", None
    if hf_name == "lm_head.vocab_ids":
        return ("head_vocab_ids", None) if cfg.head_vocab_size is not None else ("", None)
    if hf_name == "lm_head.weight":
        # Tied checkpoints sometimes carry a copy of the embedding; the embedding is the source of truth.
        return None if cfg.tie_word_embeddings else ("lm_head.weight", None)
    m = _LAYER_RE.match(hf_name)
    if m is None:
        return "", None
    layer, rest = m.groups()
    module, _, leaf = rest.rpartition(".")
    if module in _MERGED:
        ours, shard = _MERGED[module]
        return f"layers.{layer}.{ours}.{leaf}", shard
    if module in _PLAIN:
        return f"layers.{layer}.{module}.{leaf}", None
    return "", None


def hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The model's parameters under the checkpoint names `load_tensors` reads (merged qkv / gate_up split back
    into their HF parts; quantized linears as NAME.qweight / .scales / .zeros): the inverse of loading. The
    tensors are copies on the CPU, so the dict can be saved with safetensors."""
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        module = model.get_submodule(name.rpartition(".")[0])
        shards = getattr(module, "shard_sizes", None)
        if shards is not None and len(shards) > 1:
            for i in range(len(shards)):
                start, end = module.shard_offset(i)
                out[_hf_name(name, i)] = param.detach()[start:end].to("cpu", copy=True).contiguous()
        else:
            out[_hf_name(name, None)] = param.detach().to("cpu", copy=True).contiguous()
    return out


def _hf_name(name: str, shard: int | None) -> str:
    """The checkpoint tensor name that fills our (param, shard), for error messages."""
    if name in ("embed_tokens.weight", "norm.weight"):
        return f"model.{name}"
    if name == "lm_head.weight":
        return name
    if name == "head_vocab_ids":
        return "lm_head.vocab_ids"
    module, _, leaf = name.rpartition(".")
    for hf, (ours, idx) in _MERGED.items():
        if module.endswith(ours) and idx == shard:
            return f"model.{module[: -len(ours)]}{hf}.{leaf}"
    return f"model.{name}"


def _copy_into(model: LlamaForCausalLM, param: torch.nn.Parameter, name: str, shard: int | None,
               tensor: torch.Tensor, hf_name: str) -> None:
    dst = param.data
    if shard is not None:
        linear = model.get_submodule(name.rpartition(".")[0])
        start, end = linear.shard_offset(shard)
        dst = dst[start:end]
    if tuple(dst.shape) != tuple(tensor.shape):
        raise ConfigError(f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, the config implies {tuple(dst.shape)}")
    if not dst.dtype.is_floating_point and tensor.dtype != dst.dtype:  # quantized parts are never converted
        raise ConfigError(f"tensor {hf_name!r} has dtype {tensor.dtype}, the quantized layer holds {dst.dtype}")
    dst.copy_(tensor)
