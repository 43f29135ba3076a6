"""GGUF checkpoints (llama.cpp's one-file format) -> our ModelConfig and Hugging Face-named weight tensors.

The file is read with the `gguf` package (`GGUFReader`, a memory map; `gguf.quants.dequantize`); the mapping
onto our model is here. Only `general.architecture == "llama"` files are accepted (Llama, Mistral and SmolLM
GGUFs all say "llama"). The tokenizer is built from the same file by hosted/gguf_tokenizer.py.

Dequantize, or map onto our formats? Every tensor is dequantized at load (exactly: the block formulas in fp32)
into the engine's --dtype, except one case that maps without loss:
  * Q8_0 is symmetric int8 with one fp16 scale per block of 32 weights along a row; our int8 has one fp32
    scale per output row. A Q8_0 row has up to in/32 different scales, so it cannot be held in our int8 form
    without re-rounding: it is dequantized (and with --quantization int8, quantized again per channel, as any
    full-precision checkpoint is).
  * Q4_0 (w = d * (q - 8)) and Q4_1 (w = d * q + m), 4-bit q in blocks of 32 along the row with an fp16 d
    (and m), are exactly our int4 (w = (nibble - zero) * scale, fp32 scale and zero per group of input
    features) with group size 32: scale = d, zero = 8 (Q4_0) or -m / d (Q4_1). So with `--quantization int4
    --quantization-group-size 32`, a linear whose every part is Q4_0/Q4_1 gets these blocks as its int4
    weights directly (`int4_blocks`): the weights llama.cpp computes with, not a second rounding of them.
    Anything else (another --quantization, another group size, other tensor types) is dequantized.
  * F32/F16/BF16 and Q5_0/Q5_1 are read as floats. K-quants are refused (naming the tensor) for now.

Layout: GGUF lists dims innermost first; the reader's arrays are row-major [out, in], HF's layout. llama.cpp's
convert_hf_to_gguf.py permutes the rows of attn_q / attn_k inside each head (interleaving the two rotary
halves for its rope kernel); we undo that (as transformers' GGUF loader does), because our rotary embedding
uses HF's rotate-half layout. A file without output.weight ties the lm_head to the embedding.
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from hosted.config import ConfigError, ModelConfig
from hosted.gguf_reader import SUPPORTED_ARCHITECTURE, field, model_config_fields, open_gguf

__all__ = ["SUPPORTED_ARCHITECTURE", "GGUFWeights", "decoder_linear_types", "dequantize", "field", "int4_blocks",
           "model_config", "open_gguf"]

FLOAT_TYPES = (QT.F32, QT.F16, QT.BF16)
INT4_TYPES = (QT.Q4_0, QT.Q4_1)  # map exactly onto our int4 with group size 32
INT4_GROUP_SIZE = 32
# Every type here is tested on files written by tests/hosted/test_gguf.py. The K-quants (Q4_K_M files etc.) are
# not accepted yet: gguf can dequantize them, but it cannot write them, so nothing here would test them.
SUPPORTED_TYPES = (*FLOAT_TYPES, QT.Q8_0, *INT4_TYPES, QT.Q5_0, QT.Q5_1)
QUANTIZED_TYPES = (QT.Q8_0, *INT4_TYPES, QT.Q5_0, QT.Q5_1)  # a "quantized file" to --quantization auto

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_BLOCK_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_LINEAR_KINDS = frozenset(k for k in _BLOCK_NAMES if not k.endswith("_norm"))  # what --quantization acts on


# ------------------------------------------------------------------------------------------------- config
def model_config(path: str | Path) -> ModelConfig:
    """The ModelConfig a llama-architecture GGUF file describes (hosted/gguf_reader.py reads the metadata)."""
    return ModelConfig(**model_config_fields(path))


def decoder_linear_types(path: str | Path) -> frozenset[QT]:
    """The tensor types of the decoder layers' linear weights (q/k/v/o, gate/up/down): the ones a weight-only
    quantization acts on, and so what `engine serve --quantization auto` decides from (hosted/precision.py)."""
    types = set()
    for t in open_gguf(path).tensors:
        m = _BLOCK_RE.match(t.name)
        if m is not None and m.group(2) in _LINEAR_KINDS and m.group(3) == "weight":
            types.add(t.tensor_type)
    return frozenset(types)


# ------------------------------------------------------------------------------------------------ tensors
def hf_name(gguf_name: str) -> str:
    """The Hugging Face tensor name of a GGUF tensor; an unknown name is returned unchanged (the loader then
    reports it as a tensor the model does not use)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        return gguf_name
    layer, kind, leaf = m.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[kind]}.{leaf}"


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a llama GGUF for `cfg` must hold, with its [out, in] shape."""
    h, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (cfg.vocab_size, h), "output_norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["output.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_hidden_layers):
        b = f"blk.{i}."
        shapes.update({b + "attn_norm.weight": (h,), b + "ffn_norm.weight": (h,),
                       b + "attn_q.weight": (cfg.num_attention_heads * d, h),
                       b + "attn_k.weight": (cfg.num_key_value_heads * d, h),
                       b + "attn_v.weight": (cfg.num_key_value_heads * d, h),
                       b + "attn_output.weight": (h, cfg.num_attention_heads * d),
                       b + "ffn_gate.weight": (inter, h), b + "ffn_up.weight": (inter, h),
                       b + "ffn_down.weight": (h, inter)})
    return shapes


class GGUFWeights:
    """The weight tensors of one GGUF file, checked against `cfg` up front (names, shapes, types), then read
    one at a time as HF-named tensors."""

    def __init__(self, path: str | Path, cfg: ModelConfig) -> None:
        self.path = str(path)
        self.cfg = cfg
        self.reader = open_gguf(path)
        self.tensors = {t.name: t for t in self.reader.tensors}
        self._check()

    def _check(self) -> None:
        want = expected_shapes(self.cfg)
        missing = [n for n in want if n not in self.tensors]
        if missing:
            raise ConfigError(f"{self.path}: GGUF file lacks tensor(s) {', '.join(missing[:10])}"
                              f"{' …' if len(missing) > 10 else ''}")
        for name, t in self.tensors.items():
            if t.tensor_type not in SUPPORTED_TYPES:
                raise ConfigError(f"{self.path}: tensor {name!r} has type {t.tensor_type.name}, which is not "
                                  f"supported (supported: {', '.join(q.name for q in SUPPORTED_TYPES)})")
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            if name in want and shape != want[name]:
                raise ConfigError(f"{self.path}: tensor {name!r} has shape {shape}, the metadata implies "
                                  f"{want[name]}")

    def types(self) -> dict[str, QT]:
        """HF name -> GGUF tensor type."""
        return {hf_name(n): t.tensor_type for n, t in self.tensors.items()}

    def named_tensors(self, int4_names: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) for every tensor: fp32, un-permuted. The weights whose HF name is in `int4_names`
        (Q4_0/Q4_1 only) come as their exact int4 parts instead: NAME.qweight, NAME.scales, NAME.zeros
        (NAME without the `.weight`), as hosted/layers/linear.py holds them."""
        for name, t in self.tensors.items():
            hf = hf_name(name)
            if hf in int4_names:
                parts = int4_blocks(t)
                base = hf.removesuffix(".weight")
                for leaf, tensor in zip(("qweight", "scales", "zeros"), parts):
                    yield f"{base}.{leaf}", self._unpermute(name, tensor)
            else:
                yield hf, self._unpermute(name, dequantize(t))

    def _unpermute(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith(".attn_q.weight"):
            return tensor[rope_unpermute_index(tensor.shape[0], self.cfg.num_attention_heads)]
        if name.endswith(".attn_k.weight"):
            return tensor[rope_unpermute_index(tensor.shape[0], self.cfg.num_key_value_heads)]
        return tensor


def rope_unpermute_index(rows: int, n_head: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation: HF row (head h, half j, i) is GGUF row (h, i, j).
    A permutation of whole rows, so it applies to dequantized weights and to per-row int4 parts alike."""
    half = rows // n_head // 2
    return torch.arange(rows).reshape(n_head, half, 2).transpose(1, 2).reshape(-1)


def dequantize(t: Any) -> torch.Tensor:
    """One GGUF tensor as fp32 [out, in] (or [n] for vectors), exactly as gguf's block formulas give it."""
    data = np.asarray(t.data)
    out = data.astype(np.float32) if t.tensor_type in (QT.F32, QT.F16) else gguf.quants.dequantize(data, t.tensor_type)
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32))


def int4_blocks(t: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0 / Q4_1 weight [out, in] as our int4 with group size 32: (qweight uint8 [out, in/2] with k = 2j in
    the low nibble of byte j, scales fp32 [out, in/32], zeros fp32 [out, in/32]); (nibble - zero) * scale is
    the GGUF value, up to fp32 rounding of -m/d."""
    if t.tensor_type not in INT4_TYPES:
        raise ConfigError(f"tensor {t.name!r} is {t.tensor_type.name}, not Q4_0/Q4_1")
    raw = np.asarray(t.data)
    rows = raw.shape[0]
    block_bytes = gguf.GGML_QUANT_SIZES[t.tensor_type][1]
    blocks = raw.reshape(rows, -1, block_bytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if t.tensor_type == QT.Q4_1:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[..., 4:]
        with np.errstate(divide="ignore", invalid="ignore"):
            zeros = np.where(d != 0, -m / d, -1.0).astype(np.float32)
        scales = np.where(d != 0, d, m)  # d == 0: every nibble is 0 and the weight is m = (0 - (-1)) * m
    else:
        qs = blocks[..., 2:]
        zeros = np.full_like(d, 8.0)
        scales = d
    # ggml packs weight j of a block in the low nibble of byte j and weight j + 16 in its high nibble.
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, -1)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
    return (torch.from_numpy(np.ascontiguousarray(packed)), torch.from_numpy(np.ascontiguousarray(scales)),
            torch.from_numpy(np.ascontiguousarray(zeros)))
