"""A GGUF file's metadata: the parsed file (cached: config, tokenizer and weights read it once), its fields, and
the ModelConfig fields it describes.

No torch and no ModelConfig here: hosted/config.py reads a GGUF checkpoint's settings through this module, and
hosted/gguf_loader.py (the weights) and hosted/gguf_tokenizer.py build on it, so none of them imports another
back.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from hosted.checkpoint import ConfigError

__all__ = ["SUPPORTED_ARCHITECTURE", "field", "model_config_fields", "open_gguf"]

SUPPORTED_ARCHITECTURE = "llama"


# ------------------------------------------------------------------------------------------------ reading
class _Reader(gguf.GGUFReader):
    """GGUFReader that names the tensor when the file is too short for it or its type is unknown (the base
    class fails with a bare reshape error)."""

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        size = len(self.data)
        for field in fields:
            _, name_data, _, dims, raw_type, offset = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            try:
                qtype = QT(int(raw_type[0]))
            except ValueError:
                raise ConfigError(f"GGUF tensor {name!r} has unknown tensor type id {int(raw_type[0])}") from None
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            end = start_offs + int(offset[0]) + int(np.prod(dims)) * type_size // block
            if end > size:
                raise ConfigError(f"GGUF file is truncated: tensor {name!r} needs bytes up to {end}, "
                                  f"the file has {size}")
        super()._build_tensors(start_offs, fields)


@lru_cache(maxsize=1)
def _open_cached(path: str, size: int, mtime_ns: int) -> gguf.GGUFReader:
    try:
        return _Reader(path)
    except ConfigError as exc:
        raise ConfigError(f"{path!r}: {exc}") from None
    except (ValueError, IndexError, KeyError, OSError) as exc:
        raise ConfigError(f"{path!r} is not a readable GGUF file (truncated or corrupt metadata: "
                          f"{type(exc).__name__}: {exc})") from exc


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    """The parsed file (cached for the last path: config, tokenizer and weights read it once)."""
    p = Path(path).resolve()
    if not p.is_file():
        raise ConfigError(f"GGUF file {str(p)!r} does not exist")
    st = p.stat()
    return _open_cached(str(p), st.st_size, st.st_mtime_ns)


def field(reader: gguf.GGUFReader, key: str, default: Any = ..., source: str = "GGUF file") -> Any:
    """A metadata value; ConfigError naming the key when it is required (no default) and missing."""
    f = reader.fields.get(key)
    if f is None:
        if default is ...:
            raise ConfigError(f"{source}: required GGUF metadata field {key!r} is missing")
        return default
    return f.contents()


def model_config_fields(path: str | Path) -> dict[str, Any]:
    """The ModelConfig fields a llama-architecture GGUF file describes (metadata keys as llama.cpp writes them)."""
    reader = open_gguf(path)
    src = str(path)
    arch = field(reader, "general.architecture", source=src)
    if arch != SUPPORTED_ARCHITECTURE:
        raise ConfigError(f"{src}: general.architecture is {arch!r}; only {SUPPORTED_ARCHITECTURE!r} GGUF files "
                          f"are supported")

    def need_int(key: str, default: Any = ...) -> int:
        value = field(reader, f"{arch}.{key}", default, src)
        if isinstance(value, list):
            raise ConfigError(f"{src}: GGUF field {arch}.{key!s} varies per layer, which is not supported")
        return int(value)

    hidden = need_int("embedding_length")
    heads = need_int("attention.head_count")
    kv_heads = need_int("attention.head_count_kv", heads)
    head_dim = need_int("attention.key_length", hidden // heads)
    if need_int("attention.value_length", head_dim) != head_dim:
        raise ConfigError(f"{src}: GGUF field {arch}.attention.value_length differs from key_length")
    if need_int("rope.dimension_count", head_dim) != head_dim:
        raise ConfigError(f"{src}: GGUF field {arch}.rope.dimension_count != head dim {head_dim} "
                          f"(partial rotary is not supported)")
    if heads % kv_heads:
        raise ConfigError(f"{src}: {arch}.attention.head_count={heads} is not a multiple of "
                          f"{arch}.attention.head_count_kv={kv_heads}")
    tokens = field(reader, "tokenizer.ggml.tokens", source=src)
    vocab = len(tokens)
    declared = field(reader, f"{arch}.vocab_size", None)
    if declared is not None and int(declared) != vocab:
        raise ConfigError(f"{src}: {arch}.vocab_size={declared} but tokenizer.ggml.tokens lists {vocab} tokens")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ConfigError(f"{src}: tensor 'rope_freqs.weight' (Llama 3.1-style rope scaling) is not supported")
    eos: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        tid = field(reader, key, None)
        if tid is not None and int(tid) not in eos:
            eos.append(int(tid))
    bos = field(reader, "tokenizer.ggml.bos_token_id", None)
    return {
        "architecture": "LlamaForCausalLM", "model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": need_int("feed_forward_length"), "num_hidden_layers": need_int("block_count"),
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "rms_norm_eps": float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon", source=src)),
        "rope_theta": float(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(reader, arch, src),
        "max_position_embeddings": need_int("context_length"),
        "tie_word_embeddings": "output.weight" not in names,
        "qkv_bias": False, "o_bias": False, "mlp_bias": False, "sliding_window": None,
        "bos_token_id": int(bos) if bos is not None else None, "eos_token_ids": eos,
        "torch_dtype": f"gguf:{_file_type(reader)}"}


def _rope_scaling(reader: gguf.GGUFReader, arch: str, src: str) -> dict[str, Any] | None:
    kind = field(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        factor = float(field(reader, f"{arch}.rope.scaling.factor", source=src))
        return {"rope_type": "linear", "type": "linear", "factor": factor}
    raise ConfigError(f"{src}: GGUF field {arch}.rope.scaling.type={kind!r} is not supported (none, linear)")


def _file_type(reader: gguf.GGUFReader) -> str:
    ftype = field(reader, "general.file_type", None)
    try:
        return gguf.LlamaFileType(int(ftype)).name.removeprefix("MOSTLY_") if ftype is not None else "unknown"
    except ValueError:
        return str(ftype)
