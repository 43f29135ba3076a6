"""The Llama block family (Llama 2/3, Qwen2/2.5, Mistral) over token-flattened, paged batches.

One forward takes every new token of every scheduled sequence, packed as [T] with their positions;
there is no padding and no batch dimension. K/V go to the paged cache through kernels.ops.
"""
from __future__ import annotations

import torch
from torch import nn

from hosted.config import ModelConfig
from hosted.layers.attention import AttentionMetadata, PagedAttention
from hosted.layers.linear import Linear
from kernels import ops
from kernels.cpu_native import PackedLinear


class RMSNormWeight(nn.Module):
    """Holds an RMSNorm weight; the math is ops.rms_norm (optionally fused with the residual add)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return ops.rms_norm(x, self.weight, self.eps, residual)


def _project(layer: Linear, x: torch.Tensor, packed: PackedLinear | None) -> torch.Tensor:
    """A Linear's forward. Full-precision ones go through ops.linear, which on CPU takes the native GEMM over
    the weight's prepacked copy (`packed`, see LlamaForCausalLM.prepack_weights); quantized ones through
    their own kernels."""
    if layer.quantization is None:
        return ops.linear(x, layer.weight, layer.bias, packed)
    return layer(x)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        d = cfg.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = d
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        self.qkv_proj = Linear(cfg.hidden_size, [self.q_size, self.kv_size, self.kv_size], cfg.qkv_bias, dtype, device)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, cfg.o_bias, dtype, device)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, d ** -0.5)
        self.qkv_packed: PackedLinear | None = None  # set by LlamaForCausalLM.prepack_weights
        self.o_packed: PackedLinear | None = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = _project(self.qkv_proj, x, self.qkv_packed).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = ops.apply_rotary(q, k, positions, cos_sin)
        out = self.attn.forward(q, k, v, meta)
        return _project(self.o_proj, out.view(t, self.q_size), self.o_packed)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, [inter, inter], cfg.mlp_bias, dtype, device)
        self.down_proj = Linear(inter, cfg.hidden_size, cfg.mlp_bias, dtype, device)
        self.gate_up_packed: PackedLinear | None = None  # set by LlamaForCausalLM.prepack_weights
        self.down_packed: PackedLinear | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _project(self.down_proj, ops.silu_and_mul(_project(self.gate_up_proj, x, self.gate_up_packed)),
                        self.down_packed)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.input_layernorm = RMSNormWeight(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = LlamaAttention(cfg, dtype, device)
        self.post_attention_layernorm = RMSNormWeight(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = LlamaMLP(cfg, dtype, device)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                cos_sin: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # Submodules' forward is called directly: the engine registers no hooks, and nn.Module.__call__'s
        # hook handling costs a few us per call, which adds up at batch 1 (7 calls x every layer).
        if residual is None:
            residual = hidden
            x = self.input_layernorm.forward(hidden)
        else:
            x, residual = self.input_layernorm.forward(hidden, residual)
        hidden = self.self_attn.forward(x, positions, cos_sin, meta)
        x, residual = self.post_attention_layernorm.forward(hidden, residual)
        return self.mlp.forward(x), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, dtype, device) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNormWeight(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, dtype, device)
        self.lm_head_packed: PackedLinear | None = None  # set by prepack_weights

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def prepack_weights(self) -> int:
        """Prepare every full-precision projection (and the lm_head) for the CPU path (ops.prepack_linear: a
        copy of the weight in the native GEMM's panel layout); returns the bytes the copies add (0 where
        packing does not apply). The weights must not be replaced afterwards."""
        added = 0

        def pack(weight: torch.Tensor, bias: torch.Tensor | None) -> PackedLinear | None:
            nonlocal added
            packed = ops.prepack_linear(weight, bias)
            if packed is not None:
                added += packed.extra_bytes
            return packed

        def pack_linear(linear: Linear) -> PackedLinear | None:
            return pack(linear.weight, linear.bias) if linear.quantization is None else None

        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_packed, attn.o_packed = pack_linear(attn.qkv_proj), pack_linear(attn.o_proj)
            mlp.gate_up_packed, mlp.down_packed = pack_linear(mlp.gate_up_proj), pack_linear(mlp.down_proj)
        tied = self.lm_head is None
        self.lm_head_packed = pack(self.embed_tokens.weight, None) if tied else pack_linear(self.lm_head)
        return added

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """Run every new token through the model; return fp32 logits only for rows `logits_indices`."""
        hidden = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer.forward(hidden, residual, positions, cos_sin, meta)
        # Only the rows we sample from need the final norm and the (large) vocabulary projection.
        if residual is None:
            residual = torch.zeros_like(hidden)
        hidden = hidden.index_select(0, logits_indices)
        residual = residual.index_select(0, logits_indices)
        hidden, _ = self.norm(hidden, residual)
        return ops.linear(hidden, self.lm_head_weight, None, self.lm_head_packed).float()
