"""Builders for paged-KV test cases plus naive dense formulations to check kernels against."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PagedKV:
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [B, max_blocks], padded with 0
    context_lens: torch.Tensor  # int32 [B]
    dense_k: list[torch.Tensor]  # per sequence [len, Hkv, D], gathered position by position
    dense_v: list[torch.Tensor]


def make_paged_kv(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    *,
    spare_blocks: int = 3,
    seed: int = 0,
    cache_factory=None,
) -> PagedKV:
    """Random caches with a shuffled (non-contiguous, out-of-order) block assignment per sequence.

    cache_factory(num_blocks, shape_tail, dtype) -> tensor lets a test supply an oversized/strided cache
    view; by default a plain contiguous tensor of random values.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape_tail = (block_size, num_kv_heads, head_dim)
    if cache_factory is None:
        k_cache = torch.randn((num_blocks, *shape_tail), generator=gen).to(dtype)
        v_cache = torch.randn((num_blocks, *shape_tail), generator=gen).to(dtype)
        order = torch.randperm(num_blocks, generator=gen).tolist()
    else:
        k_cache, v_cache, order = cache_factory(num_blocks, shape_tail, dtype, gen)
    max_blocks = max(blocks_per_seq) + 1  # one extra padding column
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    dense_k, dense_v = [], []
    cursor = 0
    for b, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        ids = order[cursor : cursor + nb]
        cursor += nb
        tables[b, :nb] = torch.tensor(ids, dtype=torch.int32)
        ks = [k_cache[ids[p // block_size], p % block_size] for p in range(n)]
        vs = [v_cache[ids[p // block_size], p % block_size] for p in range(n)]
        empty = torch.empty(0, num_kv_heads, head_dim, dtype=dtype)
        dense_k.append(torch.stack(ks).cpu() if ks else empty)
        dense_v.append(torch.stack(vs).cpu() if vs else empty)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return PagedKV(k_cache, v_cache, tables, lens, dense_k, dense_v)


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """float64 softmax attention: q [n, Hq, D] at q_positions over k/v [L, Hkv, D], causal by position."""
    group = q.shape[1] // k.shape[1]
    qd, kd, vd = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("ihd,jhd->hij", qd, kd) * scale
    allowed = torch.arange(k.shape[0])[None, :] <= q_positions[:, None]
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hij,jhd->ihd", torch.softmax(scores, -1), vd)


def dense_decode(q: torch.Tensor, kv: PagedKV, scale: float) -> torch.Tensor:
    outs = []
    for b in range(q.shape[0]):
        n = int(kv.context_lens[b])
        outs.append(dense_attention(q[b : b + 1], kv.dense_k[b], kv.dense_v[b], torch.tensor([n - 1]), scale))
    return torch.cat(outs)


def dense_prefill(q: torch.Tensor, q_lens: list[int], kv: PagedKV, scale: float) -> torch.Tensor:
    outs, start = [], 0
    for b, n_new in enumerate(q_lens):
        ctx = int(kv.context_lens[b])
        positions = torch.arange(ctx - n_new, ctx)
        outs.append(dense_attention(q[start : start + n_new], kv.dense_k[b], kv.dense_v[b], positions, scale))
        start += n_new
    return torch.cat(outs)


def cu_seqlens(q_lens: list[int]) -> torch.Tensor:
    out = [0]
    for n in q_lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)
