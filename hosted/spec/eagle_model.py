"""The feature-level (EAGLE-style) draft: one decoder layer that reads the target's own hidden states.

At position p the draft gets g[p] -- the target's residual stream after a low, a middle and the last layer,
fused by a linear 3H -> H -- and the embedding of the next token x[p+1] (the target's table, frozen); a linear
2H -> H feeds that pair to one Llama decoder layer (causal over the sequence's earlier positions), whose output
stream h[p] imitates the target's last-layer stream at p + 1, so the target's own final norm and (narrow) head
read the next token off it. Drafting k tokens is autoregressive on the draft's own output: step j + 1 puts
h (its previous output) where a target feature would go, beside the embedding of the token step j proposed.

One module serves both uses: `forward` and `unroll` (k drafting steps at once, the training-time test) train
on padded [B, T] batches; `extend` serves one sequence over a
contiguous KV cache of its own (the first call of a step feeds every position whose target features arrived
since, the next k - 1 calls one draft position each). The embedding, final norm and head rows are the
target's, never stored with the draft.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(slots=True)
class EagleShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    feature_layers: list[int]  # the target layers (indices) whose output streams are fused, low to last
    head_vocab: int  # rows of the head: the target's most frequent output tokens (== vocab_size: the whole head)
    init_layer: int = -1  # the target layer the draft's layer started from (-1: none)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def feature_layers_for(num_layers: int) -> list[int]:
    """A low, a middle and the last layer (EAGLE-3 fuses low, middle and high features)."""
    picks = [min(2, num_layers - 1), num_layers // 2, num_layers - 1]
    return sorted(set(picks)) if len(set(picks)) == 3 else list(range(max(0, num_layers - 3), num_layers))


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@dataclass(slots=True)
class DraftCache:
    """One sequence's draft KV: positions [0, length) hold pairs fed with the target's features; a step's draft
    positions are written after them and forgotten by resetting `length`."""

    k: torch.Tensor  # [capacity, kv_heads, head_dim]
    v: torch.Tensor
    length: int = 0
    last: torch.Tensor | None = field(default=None)  # the output stream at position length - 1

    @classmethod
    def empty(cls, shape: EagleShape, capacity: int = 256) -> DraftCache:
        z = torch.zeros(capacity, shape.num_kv_heads, shape.head_dim)
        return cls(z, z.clone())

    def reserve(self, size: int) -> None:
        if size > self.k.shape[0]:
            cap = max(size, 2 * self.k.shape[0])
            for name in ("k", "v"):
                old = getattr(self, name)
                new = old.new_zeros(cap, *old.shape[1:])
                new[: old.shape[0]] = old
                setattr(self, name, new)


class EagleDraft(nn.Module):
    def __init__(self, shape: EagleShape) -> None:
        super().__init__()
        self.shape = s = shape
        h, d, nf = s.hidden_size, s.head_dim, len(s.feature_layers)
        self.fuse = nn.Linear(nf * h, h, bias=False)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.q_proj = nn.Linear(h, s.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, s.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, s.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(s.num_heads * d, h, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.gate_proj = nn.Linear(h, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, h, bias=False)
        # The target's, frozen (buffers: never trained, never exported).
        self.register_buffer("embed", torch.zeros(0, h), persistent=False)
        self.register_buffer("norm", torch.ones(h), persistent=False)
        self.register_buffer("head", torch.zeros(s.head_vocab, h), persistent=False)
        self.register_buffer("vocab_ids", torch.arange(s.head_vocab, dtype=torch.int64))
        self.register_buffer("cos_sin", torch.zeros(0, d), persistent=False)

    def trained_parameters(self) -> dict[str, torch.Tensor]:
        return {n: p for n, p in self.named_parameters()}

    def attach_target(self, embed: torch.Tensor, norm: torch.Tensor, head_weight: torch.Tensor,
                      cos_sin: torch.Tensor) -> None:
        """Borrow the target's embedding table, final norm and head rows (head_weight: [vocab, H] or already the
        head's rows [head_vocab, H]); cos_sin as kernels.reference.rotary_cos_sin makes it."""
        self.embed = embed
        self.norm = norm.detach().float()
        rows = head_weight if head_weight.shape[0] == self.shape.head_vocab else head_weight[self.vocab_ids]
        self.head = rows.detach().float().contiguous()
        self.cos_sin = cos_sin.float()

    # ---- the math shared by training and serving ---------------------------------------------------
    def _inputs(self, g: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        e = self.embed[next_tokens].to(g.dtype)
        return self.fc(torch.cat([g, e], dim=-1))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        y = rms(x, self.post_attention_layernorm, self.shape.rms_norm_eps)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Head-row logits [.., head_vocab] of output streams h (the target's final norm and head)."""
        return rms(h.float(), self.norm, self.shape.rms_norm_eps) @ self.head.T

    # ---- training ---------------------------------------------------------------------------------
    def forward(self, g: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """g [B, T, H] (fused target features, or the draft's own outputs), next_tokens [B, T] -> h [B, T, H]."""
        s = self.shape
        b, t, _ = g.shape
        half = s.head_dim // 2
        cos, sin = self.cos_sin[:t, :half], self.cos_sin[:t, half:]
        x = self._inputs(g, next_tokens)
        y = rms(x, self.input_layernorm, s.rms_norm_eps)
        q = self.q_proj(y).view(b, t, s.num_heads, s.head_dim).transpose(1, 2)
        k = self.k_proj(y).view(b, t, s.num_kv_heads, s.head_dim).transpose(1, 2)
        v = self.v_proj(y).view(b, t, s.num_kv_heads, s.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos.to(q.dtype), sin.to(q.dtype)), _rotate(k, cos.to(k.dtype), sin.to(k.dtype))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=s.num_heads != s.num_kv_heads)
        x = x + self.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
        return self._mlp(x)

    def unroll(self, g: torch.Tensor, next_tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test: the output streams [B, T, H] of drafting steps 1..steps at every row, each step
        seeing exactly what it sees when serving. Step 1 is `forward` (target features g). Step k >= 2 at row i
        (rotary position i) reads step k - 1's output at row i - 1 beside next_tokens[i] and attends to step 1's
        keys at rows <= i - k + 1 (the positions fed with target features) and to step j's key at row
        i - k + j for j = 2..k (the chain of drafts before it), as `extend` does over a sequence's cache.
        Rows i < k - 1 have no such chain (their outputs are meaningless; the loss masks them)."""
        s = self.shape
        b, t, _ = g.shape
        half = s.head_dim // 2
        cos, sin = self.cos_sin[:t, :half], self.cos_sin[:t, half:]
        rows = torch.arange(t, device=g.device)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outs: list[torch.Tensor] = []
        for step in range(1, steps + 1):
            inp = g if step == 1 else torch.cat([g[:, :1], outs[-1][:, :-1].to(g.dtype)], dim=1)
            x = self._inputs(inp, next_tokens)
            y = rms(x, self.input_layernorm, s.rms_norm_eps)
            q = self.q_proj(y).view(b, t, s.num_heads, s.head_dim).transpose(1, 2)
            k = self.k_proj(y).view(b, t, s.num_kv_heads, s.head_dim).transpose(1, 2)
            v = self.v_proj(y).view(b, t, s.num_kv_heads, s.head_dim).transpose(1, 2)
            q, k = _rotate(q, cos.to(q.dtype), sin.to(q.dtype)), _rotate(k, cos.to(k.dtype), sin.to(k.dtype))
            keys.append(k)
            values.append(v)
            gqa = s.num_heads != s.num_kv_heads
            if step == 1:
                attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            else:
                blocks = [rows[None, :] <= rows[:, None] - step + 1]
                blocks += [rows[None, :] == rows[:, None] - step + j for j in range(2, step + 1)]
                attn = F.scaled_dot_product_attention(q, torch.cat(keys, dim=2), torch.cat(values, dim=2),
                                                      attn_mask=torch.cat(blocks, dim=1), enable_gqa=gqa)
            x = x + self.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
            outs.append(self._mlp(x))
        return outs

    # ---- serving ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def extend(self, cache: DraftCache, g: torch.Tensor, next_tokens: torch.Tensor, start: int,
               offset: int = 0) -> torch.Tensor:
        """Feed n pairs at cache rows start.. (g [n, H], next_tokens [n]) over cache[:start]; their K/V go to
        cache[start:start + n] (cache.length is the caller's). Row r holds position offset + r (a cache may
        begin after position 0: a prompt prefix the target took from its prefix cache has no features).
        Returns the output streams [n, H]."""
        s = self.shape
        n = g.shape[0]
        end = start + n
        cache.reserve(end)
        pos = torch.arange(start, end)
        half = s.head_dim // 2
        cos, sin = self.cos_sin[pos + offset, :half][:, None], self.cos_sin[pos + offset, half:][:, None]
        x = self._inputs(g, next_tokens)
        y = rms(x, self.input_layernorm, s.rms_norm_eps)
        q = _rotate(self.q_proj(y).view(n, s.num_heads, s.head_dim), cos, sin)
        cache.k[start:end] = _rotate(self.k_proj(y).view(n, s.num_kv_heads, s.head_dim), cos, sin)
        cache.v[start:end] = self.v_proj(y).view(n, s.num_kv_heads, s.head_dim)
        k, v = cache.k[:end].transpose(0, 1), cache.v[:end].transpose(0, 1)  # [kvh, end, d]
        mask = None
        if n > 1:  # row i sees positions <= start + i
            mask = torch.arange(end)[None, :] <= pos[:, None]
        attn = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask,
                                              enable_gqa=s.num_heads != s.num_kv_heads)
        x = x + self.o_proj(attn.transpose(0, 1).reshape(n, -1))
        return self._mlp(x)


def init_from_target(draft: EagleDraft, layer_weights: dict[str, torch.Tensor]) -> None:
    """Start from a target layer (HF names without the `model.layers.N.` prefix) and from fusion maps that pass
    the last feature and the embedding through: the untrained draft is the target's layer applied to
    (last stream + next embedding)."""
    h = draft.shape.hidden_size
    nf = len(draft.shape.feature_layers)
    with torch.no_grad():
        draft.fuse.weight.zero_()
        draft.fuse.weight[:, (nf - 1) * h:] = torch.eye(h)
        draft.fc.weight.copy_(torch.cat([torch.eye(h), torch.eye(h)], dim=1))
        names = {"input_layernorm": "input_layernorm.weight",
                 "post_attention_layernorm": "post_attention_layernorm.weight"}
        for mine, theirs in names.items():
            getattr(draft, mine).copy_(layer_weights[theirs])
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(draft, proj).weight.copy_(layer_weights[f"self_attn.{proj}.weight"])
        for proj in ("gate_proj", "up_proj", "down_proj"):
            getattr(draft, proj).weight.copy_(layer_weights[f"mlp.{proj}.weight"])
