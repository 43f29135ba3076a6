"""Triton implementations of every kernels.ops entry point (same names and signatures)."""

from kernels.reference import quantize_int4, quantize_int8, rotary_cos_sin
from kernels.triton_attention import paged_decode_attention, paged_prefill_attention
from kernels.triton_pointwise import apply_rotary, rms_norm, store_kv
from kernels.triton_quant import int4_linear, int8_linear

__all__ = [
    "apply_rotary",
    "int4_linear",
    "int8_linear",
    "paged_decode_attention",
    "paged_prefill_attention",
    "quantize_int4",
    "quantize_int8",
    "rms_norm",
    "rotary_cos_sin",
    "store_kv",
]
