"""Triton attention over the paged KV cache.

Decode: split-KV (flash-decoding). Grid (batch, kv_head, split); each program handles the whole
query-head group of one KV head (GQA: K/V are read once per group), runs an online softmax over its
share of the sequence and writes a partial output + log-sum-exp; a second small kernel merges splits.

Prefill/extend: one kernel for plain prefill, chunked prefill and prefix-cache hits. Query tiles are
laid out per sequence without a host sync: tile t belongs to the last sequence b whose first tile
index cu_seqlens_q[b] // BLOCK_M + b is <= t (found by binary search in the kernel).

Tree verification (AttentionMetadata.tree_masks / tree_starts): a TREE constexpr adds each row's mask to the
positions it may see; without masks the kernels compile as before.

Address arithmetic: block ids are widened to int64 before multiplying by the block stride, so caches
with more than 2^31 elements are addressed correctly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import triton_common as tc
from kernels.triton_common import mma

LOG2E = 1.4426950408889634


@triton.jit
def _load_kv_tile(cache_ptr, bt_row_ptr, pos, valid, kv_head, d, d_mask,
                  stride_b, stride_s, stride_h, BLOCK_SIZE: tl.constexpr):
    """Gather cache rows for absolute positions pos [BLOCK_N] -> [BLOCK_N, D_PAD]."""
    block = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    row = block * stride_b + (pos % BLOCK_SIZE).to(tl.int64) * stride_s + kv_head * stride_h
    return tl.load(cache_ptr + row[:, None] + d[None, :], mask=valid[:, None] & d_mask[None, :], other=0.0)


@triton.jit
def _load_kv_tiles(k_ptr, v_ptr, bt_row_ptr, pos, valid, kv_head, d, d_mask,
                   stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                   BLOCK_SIZE: tl.constexpr, UPCAST: tl.constexpr):
    """The K and V tiles [BLOCK_N, D_PAD] for positions pos (fp32 with UPCAST)."""
    k = _load_kv_tile(k_ptr, bt_row_ptr, pos, valid, kv_head, d, d_mask, stride_kb, stride_ks, stride_kh,
                      BLOCK_SIZE)
    v = _load_kv_tile(v_ptr, bt_row_ptr, pos, valid, kv_head, d, d_mask, stride_vb, stride_vs, stride_vh,
                      BLOCK_SIZE)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _tree_seen(pos, tree_mask, tree_start):
    """Which positions (pos, broadcast against tree_mask / tree_start) a row's tree mask lets it see: all for -1,
    else those before its verify group's start and the group's rows whose bit is set (see AttentionMetadata)."""
    idx = pos - tree_start
    bit = (tree_mask >> tl.minimum(tl.maximum(idx, 0), 63).to(tl.int64)) & 1
    return (tree_mask == -1) | (idx < 0) | ((idx < 64) & (bit == 1))


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc, DOT_DTYPE: tl.constexpr, ROWS_MAY_BE_EMPTY: tl.constexpr):
    """Fold one tile of base-2 scores s [R, BLOCK_N] (masked to -inf) and its V tile into the running max
    m_i, sum l_i and output acc; returns the new (m_i, l_i, acc). With ROWS_MAY_BE_EMPTY a row that has
    seen no key yet (max -inf) stays empty instead of turning into NaN."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if ROWS_MAY_BE_EMPTY:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + mma(p, v, DOT_DTYPE)
    return m_new, l_i, acc


def _unit_stride_heads(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """q with a unit-stride head_dim axis (copied if need be); the caches must have one already."""
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged attention: the caches' head_dim axis must be contiguous")
    return q if q.stride(-1) == 1 else q.contiguous()


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 else t.to(torch.int32)


def _tree_args(tree_masks: torch.Tensor | None, tree_starts: torch.Tensor | None,
               stand_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' tree mask (int64) and start (int32) arguments; without masks any tensor stands in (TREE is
    False: the kernel never reads it)."""
    if tree_masks is None:
        return stand_in, stand_in
    if tree_starts is None:
        raise ValueError("attention: tree_masks without tree_starts")
    masks = tree_masks if tree_masks.dtype == torch.int64 else tree_masks.to(torch.int64)
    return masks.contiguous(), _int32(tree_starts).contiguous()


# --------------------------------------------------------------------------- decode


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, part_out_ptr, part_lse_ptr, tree_mask_ptr, tree_start_ptr,
    scale_log2,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_btb,
    stride_ob, stride_oh,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    split_tokens,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
    UPCAST: tl.constexpr, DOT_DTYPE: tl.constexpr, TREE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + b)
    start = split * split_tokens
    end = tl.minimum(start + split_tokens, ctx)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    bt_row = bt_ptr + b * stride_btb
    n_off = tl.arange(0, BLOCK_N)
    if TREE:
        tree_mask = tl.load(tree_mask_ptr + b)
        tree_start = tl.load(tree_start_ptr + b)
    for tile in range(start, end, BLOCK_N):
        pos = tile + n_off
        valid = pos < end
        k, v = _load_kv_tiles(k_ptr, v_ptr, bt_row, pos, valid, kv_head, d, d_mask,
                              stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_SIZE, UPCAST)
        s = mma(q, tl.trans(k), DOT_DTYPE) * scale_log2
        seen = valid
        if TREE:
            seen = seen & _tree_seen(pos, tree_mask, tree_start)
        s = tl.where(seen[None, :], s, float("-inf"))
        # a tree row's tile may hold masked positions only
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, DOT_DTYPE, TREE)

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    store_mask = g_mask[:, None] & d_mask[None, :]
    if SINGLE_SPLIT:
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_out_ptr + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps + d[None, :],
                 out, mask=store_mask)
        tl.store(part_lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=g_mask)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    s_mask = s < num_splits
    d_mask = d < HEAD_DIM
    lse = tl.load(part_lse_ptr + b * stride_lb + h * stride_lh + s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    denom = tl.sum(w, axis=0)
    part = tl.load(part_out_ptr + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :],
                   mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(w[:, None] * part, axis=0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def _decode_block_n(d_pad: int) -> int:
    if tc.interpreting():
        return 16  # small tiles so short test sequences still cross tiles and splits
    return 64 if d_pad <= 128 else 32


def decode_num_splits(batch: int, num_kv_heads: int, max_tokens: int, block_n: int,
                      device: torch.device) -> int:
    """Enough (batch, kv_head, split) programs to cover the GPU ~4x, each with >= 2 tiles of work."""
    programs = batch * num_kv_heads
    target = triton.cdiv(4 * tc.num_sms(device), max(programs, 1))
    max_useful = max(1, triton.cdiv(max_tokens, 2 * block_n))
    return max(1, min(target, max_useful, 256))


def _split_partials(out: torch.Tensor, num_splits: int):
    """Per-split partial outputs and log-sum-exps (fp32) and their strides. With one split the kernel writes
    `out` directly and never reads these arguments, so `out` itself and zero strides are passed for them."""
    if num_splits == 1:
        return out, out, (0, 0, 0), (0, 0)
    batch, num_q_heads, head_dim = out.shape
    part_out = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=out.device)
    part_lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=out.device)
    return part_out, part_lse, part_out.stride()[:3], part_lse.stride()[:2]


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    tree_masks: torch.Tensor | None = None,
    tree_starts: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """See kernels.ops.paged_decode_attention. num_splits overrides the per-shape choice (tests)."""
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous whatever q's strides
    if batch == 0:
        return out
    q = _unit_stride_heads(q, k_cache, v_cache)
    block_tables, context_lens = _int32(block_tables), _int32(context_lens)
    d_pad = tc.next_pow2(head_dim, 16)
    group_pad = tc.next_pow2(group, 16)
    block_n = _decode_block_n(d_pad)
    # Upper bound on any sequence's length, known without a device sync.
    max_tokens = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = decode_num_splits(batch, num_kv_heads, max_tokens, block_n, q.device)
    split_tokens = triton.cdiv(triton.cdiv(max_tokens, num_splits), block_n) * block_n
    num_splits = triton.cdiv(max_tokens, split_tokens)
    single = num_splits == 1
    part_out, part_lse, p_strides, l_strides = _split_partials(out, num_splits)
    tree = tree_masks is not None
    masks, starts = _tree_args(tree_masks, tree_starts, context_lens)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse, masks, starts,
        float(scale) * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        *p_strides, *l_strides,
        split_tokens,
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, D_PAD=d_pad,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, SINGLE_SPLIT=single,
        UPCAST=tc.UPCAST, DOT_DTYPE=tc.dot_dtype(q.dtype), TREE=tree,
        num_warps=4, num_stages=2,
    )
    if not single:
        _decode_merge_kernel[(batch, num_q_heads)](
            part_out, part_lse, out,
            *p_strides, *l_strides, out.stride(0), out.stride(1),
            num_splits,
            HEAD_DIM=head_dim, D_PAD=d_pad, SPLITS_PAD=tc.next_pow2(num_splits),
            num_warps=4 if d_pad * num_splits >= 2048 else 2,
        )
    return out


# --------------------------------------------------------------------------- prefill / extend


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, cu_ptr, lens_ptr, out_ptr, tree_mask_ptr, tree_start_ptr,
    scale_log2, num_seqs,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_btb,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_DTYPE: tl.constexpr, TREE: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    kv_head = head // GROUP
    # Binary search: the sequence whose tiles start at or before this tile.
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(cu_ptr + mid) // BLOCK_M + mid
        lo = tl.where(first <= tile, mid, lo)
        hi = tl.where(first <= tile, hi, mid - 1)
    b = lo
    q_start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_start
    m_start = (tile - (q_start // BLOCK_M + b)) * BLOCK_M
    active = m_start < q_len
    ctx = tl.load(lens_ptr + b)
    prefix = ctx - q_len

    m = m_start + tl.arange(0, BLOCK_M)
    m_mask = m < q_len  # also all-False for an inactive tile (m_start >= q_len)
    q_pos = prefix + m  # absolute position of each query row
    d = tl.arange(0, D_PAD)
    d_mask = d < HEAD_DIM
    rows = (q_start + m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    # Causal: this tile needs keys up to its last query's position (inclusive).
    kv_end = tl.where(active, tl.minimum(ctx, prefix + tl.minimum(m_start + BLOCK_M, q_len)), 0)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    n_off = tl.arange(0, BLOCK_N)
    if TREE:  # per query row, numbered as q's rows
        tree_mask = tl.load(tree_mask_ptr + rows, mask=m_mask, other=-1)
        tree_start = tl.load(tree_start_ptr + rows, mask=m_mask, other=0)
    for n_start in range(0, kv_end, BLOCK_N):
        pos = n_start + n_off
        valid = pos < kv_end
        k, v = _load_kv_tiles(k_ptr, v_ptr, bt_row, pos, valid, kv_head, d, d_mask,
                              stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_SIZE, UPCAST)
        s = mma(q, tl.trans(k), DOT_DTYPE) * scale_log2
        allowed = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if TREE:
            allowed = allowed & _tree_seen(pos[None, :], tree_mask[:, None], tree_start[:, None])
        s = tl.where(allowed, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, DOT_DTYPE, True)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def _prefill_blocks(d_pad: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for a head size."""
    if tc.interpreting():
        return 16, 16, 4
    if d_pad <= 64:
        return 64, 64, 4
    if d_pad <= 128:
        return 64, 64, 4
    return 64, 32, 8


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    tree_masks: torch.Tensor | None = None,
    tree_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    total_q, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = cu_seqlens_q.shape[0] - 1
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous whatever q's strides
    if total_q == 0 or num_seqs == 0:
        return out
    q = _unit_stride_heads(q, k_cache, v_cache)
    block_tables, cu, lens = _int32(block_tables), _int32(cu_seqlens_q), _int32(context_lens)
    d_pad = tc.next_pow2(head_dim, 16)
    block_m, block_n, warps = _prefill_blocks(d_pad)
    num_tiles = total_q // block_m + num_seqs  # upper bound on per-sequence tiles, no host sync
    masks, starts = _tree_args(tree_masks, tree_starts, lens)
    _prefill_kernel[(num_tiles, num_q_heads)](
        q, k_cache, v_cache, block_tables, cu, lens, out, masks, starts,
        float(scale) * LOG2E, num_seqs,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim, D_PAD=d_pad,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        UPCAST=tc.UPCAST, DOT_DTYPE=tc.dot_dtype(q.dtype), TREE=tree_masks is not None,
        num_warps=warps, num_stages=2,
    )
    return out

