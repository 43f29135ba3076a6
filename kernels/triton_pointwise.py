"""Triton kernels for the row-wise ops: KV-cache write, fused residual + RMSNorm, rotary embedding."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import triton_common as tc

# --------------------------------------------------------------------------- KV cache write


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    # Pure data movement (no arithmetic on values), so no upcast is needed; slot < 0 writes nothing.
    heads = tl.where(slot >= 0, NUM_HEADS, 0)  # (a scalar mask combined with & trips the interpreter)
    mask = (h[:, None] < heads) & (d[None, :] < HEAD_DIM)
    src_k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    src_v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    dst_k = k_cache_ptr + block * stride_kcb + offset * stride_kcs + h[:, None] * stride_kch + d[None, :]
    dst_v = v_cache_ptr + block * stride_vcb + offset * stride_vcs + h[:, None] * stride_vch + d[None, :]
    tl.store(dst_k, src_k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst_v, src_v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("store_kv: the caches' head_dim axis must be contiguous")
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.to(torch.int64)
    h_pad, d_pad = tc.next_pow2(num_heads), tc.next_pow2(head_dim)
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slots,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], H_PAD=h_pad, D_PAD=d_pad,
        num_warps=4 if h_pad * d_pad >= 1024 else 1,
    )


# --------------------------------------------------------------------------- RMSNorm (+ residual)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr,
    stride_x, stride_r, stride_o, stride_nr,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr, UPCAST: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        if UPCAST:
            r = r.to(tl.float32)
        # The sum is rounded to the activation dtype (as the reference's x + residual is) and the
        # rounded value is what gets normalised.
        summed = (x + r).to(new_res_ptr.dtype.element_ty)
        tl.store(new_res_ptr + row * stride_nr + cols, summed, mask=mask)
        x = summed
        if UPCAST:
            x = x.to(tl.float32)
    var = tl.sum(x * x, axis=0) / hidden
    rstd = 1.0 / tl.sqrt(var + eps)
    normed = (x * rstd).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    if UPCAST:
        normed = normed.to(tl.float32)
        w = w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    shape = x.shape
    x2 = _last_dim_contiguous(x.reshape(-1, shape[-1]))
    rows, hidden = x2.shape
    out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    if residual is not None:
        r2 = _last_dim_contiguous(residual.reshape(-1, hidden))
        new_res = torch.empty_like(out)
    else:
        r2 = new_res = x2  # not read when HAS_RESIDUAL is off; the kernel signature still takes tensors
    block_h = tc.next_pow2(hidden)
    if rows:
        _rms_norm_kernel[(rows,)](
            x2, r2, weight, out, new_res,
            x2.stride(0), r2.stride(0), out.stride(0), new_res.stride(0),
            hidden, float(eps),
            HAS_RESIDUAL=residual is not None, BLOCK_H=block_h, UPCAST=tc.UPCAST,
            num_warps=min(16, max(1, block_h // 256)),
        )
    if residual is not None:
        return out.view(shape), new_res.view(shape)
    return out.view(shape)


# --------------------------------------------------------------------------- rotary embedding


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, stride_st, stride_sh, stride_dt, stride_dh, t, cos, sin,
                  num_heads, HALF: tl.constexpr, H_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
                  UPCAST: tl.constexpr):
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, HALF_PAD)
    mask = (h[:, None] < num_heads) & (d[None, :] < HALF)
    src = src_ptr + t * stride_st + h[:, None] * stride_sh + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    if UPCAST:
        x1 = x1.to(tl.float32)
        x2 = x2.to(tl.float32)
    else:
        cos = cos.to(x1.dtype)
        sin = sin.to(x1.dtype)
    dst = dst_ptr + t * stride_dt + h[:, None] * stride_dh + d[None, :]
    tl.store(dst, (x1 * cos - x2 * sin).to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cos_sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
    num_q_heads, num_k_heads,
    HALF: tl.constexpr, HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
    UPCAST: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF_PAD)
    dmask = d < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + d, mask=dmask, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + d, mask=dmask, other=0.0)[None, :]
    _rotate_heads(q_ptr, q_out_ptr, stride_qt, stride_qh, stride_qot, stride_qoh, t, cos, sin,
                  num_q_heads, HALF, HQ_PAD, HALF_PAD, UPCAST)
    _rotate_heads(k_ptr, k_out_ptr, stride_kt, stride_kh, stride_kot, stride_koh, t, cos, sin,
                  num_k_heads, HALF, HK_PAD, HALF_PAD, UPCAST)


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    q, k = _last_dim_contiguous(q), _last_dim_contiguous(k)
    cos_sin = _last_dim_contiguous(cos_sin)
    if cos_sin.device != q.device or cos_sin.dtype != torch.float32:
        cos_sin = cos_sin.to(device=q.device, dtype=torch.float32)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        q, k, q_out, k_out, positions, cos_sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin.stride(0),
        num_q_heads, num_k_heads,
        HALF=half, HQ_PAD=tc.next_pow2(num_q_heads), HK_PAD=tc.next_pow2(num_k_heads),
        HALF_PAD=tc.next_pow2(half), UPCAST=tc.UPCAST,
        num_warps=4 if num_q_heads * head_dim >= 2048 else 2,
    )
    return q_out, k_out
