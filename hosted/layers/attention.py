"""Paged attention over a token-flattened batch: decodes first (one token each), then prefill chunks."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels import ops


@dataclass(slots=True)
class AttentionMetadata:
    """Built once per step by the model runner and shared by every layer.

    The first `num_decode_tokens` rows of the batch are decodes (one new token per sequence); the rest
    are prefill chunks packed back to back (plain prefill, chunked prefill and prefix-cache hits alike).
    """

    slot_mapping: torch.Tensor  # int64 [T]: cache slot each new token's K/V is written to
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # int32 [D, max_blocks]
    decode_context_lens: torch.Tensor | None  # int32 [D], including the new token
    prefill_block_tables: torch.Tensor | None  # int32 [P, max_blocks]
    prefill_cu_seqlens_q: torch.Tensor | None  # int32 [P + 1]
    prefill_context_lens: torch.Tensor | None  # int32 [P], cached prefix + new tokens
    # Tree verification (speculative decoding), one entry per row of the batch in batch order; None: every row
    # plain. A row with tree_masks[row] == -1 is plain (causal). Otherwise it sees table position p (within its
    # context length as before) iff p < tree_starts[row] or bit (p - tree_starts[row]) of tree_masks[row] is set:
    # tree_starts is the table position of its verify group's first row, bit j that group's j-th row (<= 64 rows).
    tree_masks: torch.Tensor | None = None  # int64 [T]
    tree_starts: torch.Tensor | None = None  # int32 [T]


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 kernels: ops.Kernels) -> None:
        super().__init__()
        self.kernels = kernels
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # Views into the runner's KV pool, bound after the pool is allocated.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
        kernels = self.kernels
        kernels.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        d = meta.num_decode_tokens
        # The tree arguments travel only when there are masks: the plain call stays as it always was.
        masks, starts = meta.tree_masks, meta.tree_starts
        tree_decode = () if masks is None else (masks[:d], starts[:d])
        tree_prefill = () if masks is None else (masks[d:], starts[d:])
        if d == q.shape[0]:
            return kernels.paged_decode_attention(q, self.k_cache, self.v_cache, meta.decode_block_tables,
                                                  meta.decode_context_lens, self.scale, *tree_decode)
        if d == 0:
            return kernels.paged_prefill_attention(q, self.k_cache, self.v_cache, meta.prefill_block_tables,
                                                   meta.prefill_cu_seqlens_q, meta.prefill_context_lens, self.scale,
                                                   *tree_prefill)
        out = torch.empty_like(q)
        out[:d] = kernels.paged_decode_attention(q[:d], self.k_cache, self.v_cache, meta.decode_block_tables,
                                                 meta.decode_context_lens, self.scale, *tree_decode)
        out[d:] = kernels.paged_prefill_attention(q[d:], self.k_cache, self.v_cache, meta.prefill_block_tables,
                                                  meta.prefill_cu_seqlens_q, meta.prefill_context_lens, self.scale,
                                                  *tree_prefill)
        return out
