"""Load a Hugging Face checkpoint directory (config.json + safetensors, single or sharded) into our model.

Nothing is downloaded: every file must already be in the directory, and whatever is missing is named.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from hosted.config import ConfigError, ModelConfig
from hosted.layers.linear import check_model_quantizable, quantize_model
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
               kernels: ops.Kernels | None = None) -> LlamaForCausalLM:
    """Build the model on `device` and fill it from the checkpoint. With `quantization` ("int8" | "int4"),
    every decoder-layer linear is then quantized in place and its `dtype` weight freed (see
    hosted/layers/linear.py); the embedding and lm_head stay in `dtype`. The model's layers call `kernels`
    (default: the backend for `device`, chosen now)."""
    files = safetensors_files(model_dir)  # fail on missing files before allocating anything
    with torch.device(device):
        model = LlamaForCausalLM(cfg, dtype, device, kernels if kernels is not None else ops.select(device))  # torch.empty: pages are touched only when loaded
    model.eval()
    if quantization is not None:
        check_model_quantizable(model, quantization, quantization_group_size)  # before reading any weight
    load_weights(model, files)
    if quantization is not None:
        quantize_model(model, quantization, quantization_group_size)
        if device.type == "cuda":
            # Hand the freed full-precision weights back to the driver: the KV pool is sized from free memory.
            torch.cuda.empty_cache()
    return model


def load_weights(model: LlamaForCausalLM, files: list[Path]) -> None:
    """Copy every checkpoint tensor into its (possibly merged) parameter; error on gaps or strays."""
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
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for hf_name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                target = _map_name(hf_name, cfg)
                if target is None:
                    continue
                if target == ("", None):
                    unexpected.append(hf_name)
                    continue
                name, shard = target
                if name not in params:
                    unexpected.append(hf_name)
                    continue
                _copy_into(model, params[name], name, shard, f.get_tensor(hf_name), hf_name)
                loaded.add((name, shard))
    if unexpected:
        raise ConfigError(f"checkpoint holds tensors this {cfg.architecture} model does not use: "
                          f"{', '.join(unexpected[:10])}{' …' if len(unexpected) > 10 else ''}")
    missing = expected - loaded
    if missing:
        names = sorted(_hf_name(n, s) for n, s in missing)
        raise ConfigError(f"checkpoint lacks weights for: {', '.join(names[:10])}"
                          f"{' …' if len(names) > 10 else ''}")


def _map_name(hf_name: str, cfg: ModelConfig) -> tuple[str, int | None] | None:
    """Our (param name, shard) for an HF tensor name; None to skip it; ('', None) if unknown."""
    if hf_name.endswith(_IGNORED_SUFFIXES):
        return None
    if hf_name == "model.embed_tokens.weight":
        return "embed_tokens.weight", None
    if hf_name == "model.norm.weight":
        return "norm.weight", None
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


def _hf_name(name: str, shard: int | None) -> str:
    """The checkpoint tensor name that fills our (param, shard), for error messages."""
    if name in ("embed_tokens.weight", "norm.weight"):
        return f"model.{name}"
    if name == "lm_head.weight":
        return name
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
    dst.copy_(tensor)
