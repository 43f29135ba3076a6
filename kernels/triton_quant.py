"""Triton weight-only quantized matmuls: int8 per-channel and int4 group-wise (two values per byte).

Weights stay quantized in memory and are dequantized in registers. Two kernels per format:
  * GEMV (M <= 4 rows, decode): CUDA-core multiply-accumulate over [BLOCK_N, BLOCK_K] weight tiles,
    reduced once at the end; int4 applies scale/zero once per group: s * (sum q*x - z * sum x).
    Tile shapes are autotuned per (N, K) on a GPU (a heuristic table under the interpreter).
  * tiled matmul (M > 4): tl.dot on the exact integer values (int8 and 0..15 are exact in fp16/bf16),
    scales applied to the fp32 accumulator, so no rounding of dequantized weights.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels import switches
from kernels import triton_common as tc
from kernels.reference import INT4_GROUP_SIZES
from kernels.triton_common import mma

GEMV_MAX_ROWS = 4


# --------------------------------------------------------------------------- tiled matmul prologue/epilogue


@triton.jit
def _mm_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's output rows m [BLOCK_M] and columns n [BLOCK_N], with their in-bounds masks."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return m, n, m < M, n < N


@triton.jit
def _store_mm_tile(out, bias_ptr, out_ptr, m, n, m_mask, n_mask, stride_om, HAS_BIAS: tl.constexpr):
    """out [BLOCK_M, BLOCK_N] fp32 (+ bias) -> the output tile, in the output's dtype."""
    if HAS_BIAS:
        out += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m.to(tl.int64)[:, None] * stride_om + n[None, :], out.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


# --------------------------------------------------------------------------- int8


@triton.jit
def _int8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr,
    N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        x = tl.load(x_ptr + m * stride_xm + k, mask=k_mask, other=0.0)
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0)
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        else:
            w = w.to(x.dtype)
        acc += w * x[None, :]
    out = tl.sum(acc, axis=1) * tl.load(s_ptr + n, mask=n_mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        out += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + n, out.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _int8_mm_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr,
    M, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    m, n, m_mask, n_mask = _mm_tile(M, N, BLOCK_M, BLOCK_N)
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + n.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_cols + k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0)  # [BK, BN]
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc += mma(x, w, DOT_DTYPE)
    out = acc * tl.load(s_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    _store_mm_tile(out, bias_ptr, out_ptr, m, n, m_mask, n_mask, stride_om, HAS_BIAS)


# --------------------------------------------------------------------------- int4


@triton.jit
def _int4_operands(packed, x_even, x_odd, UPCAST: tl.constexpr):
    """(x_even, x_odd, low nibbles, high nibbles) of packed bytes and the activations they multiply, all
    fp32 with UPCAST (else as loaded)."""
    lo = packed & 0xF
    hi = packed >> 4
    if UPCAST:
        x_even = x_even.to(tl.float32)
        x_odd = x_odd.to(tl.float32)
        lo = lo.to(tl.float32)
        hi = hi.to(tl.float32)
    return x_even, x_odd, lo, hi


@triton.jit
def _int4_gemv_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr,
    N, K, stride_xm, stride_wn, stride_sn, stride_zn, stride_om,
    GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):
    HALF_G: tl.constexpr = GROUP // 2
    GROUPS_PER_TILE: tl.constexpr = BLOCK_K // GROUP
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    n64 = n.to(tl.int64)
    gi = tl.arange(0, GROUPS_PER_TILE)
    j = tl.arange(0, HALF_G)
    num_groups = K // GROUP
    acc = tl.zeros([BLOCK_N, GROUPS_PER_TILE], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        grp = k0 // GROUP + gi  # [GT]
        g_mask = grp < num_groups
        byte = k0 // 2 + gi[:, None] * HALF_G + j[None, :]  # [GT, HG]
        w_mask = n_mask[:, None, None] & g_mask[None, :, None]
        packed = tl.load(w_ptr + n64[:, None, None] * stride_wn + byte[None, :, :], mask=w_mask, other=0)
        k_even = 2 * byte
        x_even = tl.load(x_ptr + m * stride_xm + k_even, mask=g_mask[:, None], other=0.0)  # [GT, HG]
        x_odd = tl.load(x_ptr + m * stride_xm + k_even + 1, mask=g_mask[:, None], other=0.0)
        x_even, x_odd, lo, hi = _int4_operands(packed, x_even, x_odd, UPCAST)
        if not UPCAST:
            lo = lo.to(x_even.dtype)
            hi = hi.to(x_even.dtype)
        qx = tl.sum(lo * x_even[None, :, :] + hi * x_odd[None, :, :], axis=2)  # [BN, GT]
        x_sum = tl.sum(x_even + x_odd, axis=1)  # [GT]
        sg_mask = n_mask[:, None] & g_mask[None, :]
        scale = tl.load(s_ptr + n64[:, None] * stride_sn + grp[None, :], mask=sg_mask, other=0.0)
        if HAS_ZEROS:
            zero = tl.load(z_ptr + n64[:, None] * stride_zn + grp[None, :], mask=sg_mask, other=0.0)
        else:
            zero = 8.0
        acc += scale * (qx - zero * x_sum[None, :])
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        out += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + n, out.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _int4_mm_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr,
    M, N, K, stride_xm, stride_wn, stride_sn, stride_zn, stride_om,
    GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    # One K tile per quantization group: the dot runs on the raw nibbles (exact in fp16/bf16) and
    # scale/zero are applied in fp32: s * (x_e @ lo + x_o @ hi) - s * z * sum(x over the group).
    HALF_G: tl.constexpr = GROUP // 2
    m, n, m_mask, n_mask = _mm_tile(M, N, BLOCK_M, BLOCK_N)
    n64 = n.to(tl.int64)
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
    j = tl.arange(0, HALF_G)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for grp in range(K // GROUP):
        byte = grp * HALF_G + j  # [HG]
        x_even = tl.load(x_rows + 2 * byte[None, :], mask=m_mask[:, None], other=0.0)  # [BM, HG]
        x_odd = tl.load(x_rows + 2 * byte[None, :] + 1, mask=m_mask[:, None], other=0.0)
        packed = tl.load(w_ptr + n64[None, :] * stride_wn + byte[:, None], mask=n_mask[None, :], other=0)
        x_even, x_odd, lo, hi = _int4_operands(packed, x_even, x_odd, UPCAST)  # lo, hi [HG, BN]
        qx = mma(x_even, lo, DOT_DTYPE) + mma(x_odd, hi, DOT_DTYPE)  # [BM, BN]
        x_sum = tl.sum(x_even + x_odd, axis=1)  # [BM]
        scale = tl.load(s_ptr + n64 * stride_sn + grp, mask=n_mask, other=0.0)  # [BN]
        if HAS_ZEROS:
            zero = tl.load(z_ptr + n64 * stride_zn + grp, mask=n_mask, other=0.0)
        else:
            zero = tl.full([BLOCK_N], 8.0, tl.float32)
        acc += scale[None, :] * qx - (scale * zero)[None, :] * x_sum[:, None]
    out = acc
    _store_mm_tile(out, bias_ptr, out_ptr, m, n, m_mask, n_mask, stride_om, HAS_BIAS)


# --------------------------------------------------------------------------- launch


def autotune_enabled() -> bool:
    """GEMV tile shapes are autotuned per (N, K) on a real GPU (first call per shape benchmarks the
    candidates); the kernel_autotune switch off (kernels/switches.py, SWITCHYARD_KERNEL_AUTOTUNE=0) or the
    interpreter use the heuristic table instead."""
    return not tc.interpreting() and switches.current().kernel_autotune


def gemv_configs() -> list[triton.Config]:
    # 11 candidates: rows per program x K tile, capped at 8K weight elements per tile (register budget).
    return [
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=4)
        for bn in (2, 4, 8, 16)
        for bk in (256, 512, 1024)
        if bn * bk <= 8192
    ]


@functools.cache
def _tuned(kernel: triton.JITFunction):
    return triton.autotune(configs=gemv_configs(), key=["N", "K"])(kernel)


def _gemv_block_n(n: int, device: torch.device, lo: int, hi: int) -> int:
    """Rows per program: as many as keep >= ~4 programs per SM, within [lo, hi]."""
    per_program = max(1, n // (4 * tc.num_sms(device)))
    return max(lo, min(hi, 1 << (per_program.bit_length() - 1)))


def _gemv_launch(kernel: triton.JITFunction, rows: int, n: int, k: int, device: torch.device, args: tuple,
                 block_k: int, **constexprs) -> None:
    if autotune_enabled():
        _tuned(kernel)[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), rows)](*args, **constexprs)
        return
    block_n = _gemv_block_n(n, device, 2, 16)
    kernel[(triton.cdiv(n, block_n), rows)](*args, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, **constexprs)


def _mm_blocks(m: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) by row count; fp32 operand tiles are twice as large."""
    if dtype == torch.float32:
        return (16 if m <= 16 else 32 if m <= 32 else 64), 64, 4, 2
    if m <= 16:
        return 16, 64, 4, 3
    if m <= 32:
        return 32, 64, 4, 3
    if m <= 64:
        return 64, 64, 4, 3
    return 128, 128, 8, 3


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def int8_linear(
    x: torch.Tensor,
    w_q: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    x2 = _as_2d(x)
    rows, k = x2.shape
    n = w_q.shape[0]
    if w_q.shape[1] != k:
        raise ValueError(f"int8_linear: x has K={k} but the weight is {tuple(w_q.shape)}")
    w_q = w_q if w_q.stride(-1) == 1 else w_q.contiguous()
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out.view(*x.shape[:-1], n)
    bias_arg = bias if bias is not None else scales
    if rows <= GEMV_MAX_ROWS:
        args = (x2, w_q, scales, bias_arg, out, n, k, x2.stride(0), w_q.stride(0), out.stride(0))
        _gemv_launch(_int8_gemv_kernel, rows, n, k, x.device, args, min(512, tc.next_pow2(k, 16)),
                     HAS_BIAS=bias is not None, UPCAST=tc.UPCAST)
    else:
        bm, bn, warps, stages = _mm_blocks(rows, x.dtype)
        _int8_mm_kernel[(triton.cdiv(rows, bm), triton.cdiv(n, bn))](
            x2, w_q, scales, bias_arg, out, rows, n, k, x2.stride(0), w_q.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=64,
            UPCAST=tc.UPCAST, DOT_DTYPE=tc.dot_dtype(x.dtype), num_warps=warps, num_stages=stages,
        )
    return out.view(*x.shape[:-1], n)


def int4_linear(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    x2 = _as_2d(x)
    rows, k = x2.shape
    n = w_packed.shape[0]
    if w_packed.shape[1] * 2 != k or k % group_size:
        raise ValueError(f"int4_linear: x has K={k}, packed weight {tuple(w_packed.shape)}, group {group_size}")
    w_packed = w_packed if w_packed.stride(-1) == 1 else w_packed.contiguous()
    scales = scales if scales.stride(-1) == 1 else scales.contiguous()
    if zeros is not None and zeros.stride(-1) != 1:
        zeros = zeros.contiguous()
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out.view(*x.shape[:-1], n)
    zeros_arg = zeros if zeros is not None else scales
    bias_arg = bias if bias is not None else scales
    common = (n, k, x2.stride(0), w_packed.stride(0), scales.stride(0), zeros_arg.stride(0), out.stride(0))
    if rows <= GEMV_MAX_ROWS:
        args = (x2, w_packed, scales, zeros_arg, bias_arg, out, *common)
        _gemv_launch(_int4_gemv_kernel, rows, n, k, x.device, args, max(group_size, min(1024, tc.next_pow2(k))),
                     GROUP=group_size, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None, UPCAST=tc.UPCAST)
    else:
        bm, bn, warps, stages = _mm_blocks(rows, x.dtype)
        _int4_mm_kernel[(triton.cdiv(rows, bm), triton.cdiv(n, bn))](
            x2, w_packed, scales, zeros_arg, bias_arg, out, rows, *common,
            GROUP=group_size, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None,
            BLOCK_M=bm, BLOCK_N=bn, UPCAST=tc.UPCAST, DOT_DTYPE=tc.dot_dtype(x.dtype),
            num_warps=warps, num_stages=stages,
        )
    return out.view(*x.shape[:-1], n)
