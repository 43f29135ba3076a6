"""Shared helpers for the Triton kernels: interpreter detection, dot precision, launch sizing."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# Every kernel converts its loads to fp32 before doing math: the CPU interpreter (TRITON_INTERPRET=1)
# silently miscomputes bf16 arithmetic, and fp32 accumulation is what the references do anyway.
# Tests flip this to False to prove that a non-upcasting kernel fails their checks.
UPCAST = True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, triton.next_power_of_2(int(n)))


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """Operand type for tl.dot. Operands are values that were loaded in `dtype` (exact in it) or fp32
    softmax probabilities; accumulation is always fp32. On the interpreter everything stays fp32."""
    if not UPCAST:
        return _TL_DTYPES[dtype]
    if interpreting() or dtype == torch.float32:
        return tl.float32
    return _TL_DTYPES[dtype]


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors on a CUDA device; a small stand-in elsewhere (interpreter runs)."""
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4


@triton.jit
def mma(a, b, DOT_DTYPE: tl.constexpr):
    """a @ b with fp32 accumulation; fp32 operands use exact IEEE products (no TF32 rounding)."""
    if DOT_DTYPE == tl.float32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), out_dtype=tl.float32)
