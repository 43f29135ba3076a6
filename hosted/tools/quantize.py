"""`switchyard engine quantize`: write a weight-only quantized checkpoint that `engine serve` loads as it is.

Input: a HF checkpoint directory or a GGUF file (or a `package:` reference to either). The model is loaded
and quantized exactly as `engine serve --quantization` does at load (hosted/loader.py, hosted/layers/linear.py;
GGUF Q4_0/Q4_1 blocks map straight onto int4 with group size 32), then saved in HF layout:
  model.safetensors   every decoder linear as NAME.qweight / NAME.scales (/ NAME.zeros for int4), the forms
                      Linear holds, under HF names (q_proj, k_proj, ... split back out of our merged layers);
                      embedding, norms and an untied lm_head in --dtype
  config.json         the model's config plus "quantization_config": {"quant_method": "switchyard", "bits",
                      "group_size", ...}, which hosted/config.py checks on load
  tokenizer.json, tokenizer_config.json (chat template), generation_config.json: copied from a directory,
                      or built from a GGUF file's metadata, so the output is self-contained.
Serving it with the --dtype it was written with gives exactly the logits of quantizing at load.
The output is written to OUT.partial and renamed when complete: an interrupted run leaves no half checkpoint.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from hosted.config import INT4_GROUP_SIZES, QUANT_METHOD, ConfigError, ModelConfig
from hosted.loader import hf_state_dict, load_model, torch_dtype
from hosted.models import is_gguf, resolve_model_path
from hosted.tokenizer import Tokenizer

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                    "chat_template.jinja")


def quantize_checkpoint(model: str | Path, bits: int, out: str | Path, group_size: int | None = None,
                        dtype: str = "float32", progress: bool = True) -> dict[str, Any]:
    """Quantize `model` to `bits` (8 | 4) and write the checkpoint to `out`; returns what was written."""
    source = resolve_model_path(model)
    out_dir = Path(out)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ConfigError(f"--out {str(out_dir)!r} already exists and is not an empty directory")
    cfg = ModelConfig.from_dir(source)
    if cfg.quantization is not None:
        raise ConfigError(f"{source}: the checkpoint is already quantized ({cfg.quantization}); quantize the "
                          f"full-precision checkpoint instead")
    if bits not in (8, 4):
        raise ConfigError(f"--bits must be 8 or 4, got {bits}")
    scheme = "int8" if bits == 8 else "int4"
    group = (group_size or default_group_size(cfg, source)) if bits == 4 else 0
    model_obj = load_model(source, cfg, torch_dtype(dtype), torch.device("cpu"), scheme, group or 128,
                           progress=progress)
    tensors = hf_state_dict(model_obj)
    del model_obj
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
        config = checkpoint_config(source, cfg, dtype)
        config["quantization_config"] = {"quant_method": QUANT_METHOD, "bits": bits,
                                         "group_size": group or None, "symmetric": bits == 8,
                                         "modules": "decoder linears (q, k, v, o, gate, up, down); embedding, "
                                                    "norms and lm_head in torch_dtype"}
        (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        write_tokenizer_files(source, cfg, partial)
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above)
        os.replace(partial, out_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    size = (out_dir / "model.safetensors").stat().st_size
    return {"out": str(out_dir), "scheme": scheme, "group_size": group or None, "safetensors_bytes": size}


def default_group_size(cfg: ModelConfig, source: Path) -> int:
    """int4 group size when none is given: 32 for a GGUF file (its Q4_0/Q4_1 blocks then map exactly), else
    the largest supported size that divides every quantized layer's input size."""
    if is_gguf(source):
        return 32
    ins = (cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.intermediate_size)
    for g in sorted(INT4_GROUP_SIZES, reverse=True):
        if all(n % g == 0 for n in ins):
            return g
    raise ConfigError(f"no int4 group size in {INT4_GROUP_SIZES} divides the layer sizes {ins}; use --bits 8")


def checkpoint_config(source: Path, cfg: ModelConfig, dtype: str) -> dict[str, Any]:
    """A directory's own config.json (every field it had), or one written from a GGUF file's ModelConfig."""
    if source.is_dir():
        raw = json.loads((source / "config.json").read_text())
        raw.pop("quantization_config", None)
    else:
        raw = {"architectures": [cfg.architecture], "model_type": cfg.model_type, "vocab_size": cfg.vocab_size,
               "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
               "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
               "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
               "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
               "max_position_embeddings": cfg.max_position_embeddings,
               "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": False, "mlp_bias": False,
               "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_ids,
               "source_gguf": source.name, "source_gguf_file_type": cfg.torch_dtype}
    raw["torch_dtype"] = dtype
    return raw


def write_tokenizer_files(source: Path, cfg: ModelConfig, out: Path) -> None:
    if source.is_dir():
        for name in _TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, out / name)
        return
    Tokenizer.from_gguf(source).save(out)
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_ids}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def cli_quantize(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.bits == 8 and args.group_size is not None:
        print("error: --group-size applies to --bits 4 only", file=sys.stderr)
        return 2
    try:
        result = quantize_checkpoint(args.model, args.bits, args.out, args.group_size, args.dtype)
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: nothing was written", file=sys.stderr)
        return 130
    group = f" group size {result['group_size']}" if result["group_size"] else ""
    print(f"wrote {result['out']}: {result['scheme']}{group}, model.safetensors "
          f"{result['safetensors_bytes'] / 1e6:.1f} MB")
    return 0
