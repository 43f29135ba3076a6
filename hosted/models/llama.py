"""The Llama block family (Llama 2/3, Qwen2/2.5, Mistral) over token-flattened, paged batches.

One forward takes every new token of every scheduled sequence, packed as [T] with their positions;
there is no padding and no batch dimension. Every layer calls the kernels of the backend the model runner
chose (`kernels`, a kernels.ops.Kernels); K/V go to the paged cache through them.
"""
from __future__ import annotations

import torch
from torch import nn

from hosted.config import ModelConfig
from hosted.layers.attention import AttentionMetadata, PagedAttention
from hosted.layers.linear import Linear, TiedHead
from kernels.cpu_decode import DecoderLayerWeights, DecodeStep
from kernels.huge_pages import move_to_huge_pages
from kernels.ops import Kernels


class RMSNormWeight(nn.Module):
    """Holds an RMSNorm weight; the math is the backend's rms_norm (optionally fused with the residual add)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device, kernels: Kernels) -> None:
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.kernels.rms_norm(x, self.weight, self.eps, residual)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, kernels: Kernels) -> None:
        super().__init__()
        d = cfg.head_dim
        self.kernels = kernels
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = d
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        self.qkv_proj = Linear(cfg.hidden_size, [self.q_size, self.kv_size, self.kv_size], cfg.qkv_bias, dtype,
                               device, kernels)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, cfg.o_bias, dtype, device, kernels)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, d ** -0.5, kernels)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj.forward(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = self.kernels.apply_rotary(q, k, positions, cos_sin)
        out = self.attn.forward(q, k, v, meta)
        return self.o_proj.forward(out.view(t, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, kernels: Kernels) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.kernels = kernels
        self.gate_up_proj = Linear(cfg.hidden_size, [inter, inter], cfg.mlp_bias, dtype, device, kernels)
        self.down_proj = Linear(inter, cfg.hidden_size, cfg.mlp_bias, dtype, device, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self.kernels.silu_and_mul(self.gate_up_proj.forward(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, kernels: Kernels) -> None:
        super().__init__()
        self.input_layernorm = RMSNormWeight(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, kernels)
        self.self_attn = LlamaAttention(cfg, dtype, device, kernels)
        self.post_attention_layernorm = RMSNormWeight(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, kernels)
        self.mlp = LlamaMLP(cfg, dtype, device, kernels)

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
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, kernels: Kernels) -> None:
        super().__init__()
        self.config = cfg
        self.kernels = kernels
        self.decode_step: DecodeStep | None = None  # set by bind_decode_step
        # Feature capture for a feature-level (EAGLE) draft: after these layers (indices), every fed row's residual
        # stream is kept in `captured` ([T, len * hidden] fp32). None: off (one test per forward, nothing else).
        self.capture_layers: tuple[int, ...] | None = None
        self.captured: torch.Tensor | None = None
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, dtype, device, kernels)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNormWeight(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, kernels)
        # An untied lm_head is a Linear; a tied one projects onto the embedding table.
        head_rows = cfg.head_vocab_size or cfg.vocab_size
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, head_rows, False, dtype,
                                                                     device, kernels)
        self.tied_head = TiedHead(self.embed_tokens, kernels) if cfg.tie_word_embeddings else None
        # A draft's narrow head (ModelConfig.head_vocab_size): the token id of each lm_head row.
        self.head_vocab_ids = None
        if cfg.head_vocab_size is not None:
            self.head_vocab_ids = nn.Parameter(torch.empty(head_rows, dtype=torch.int64, device=device),
                                               requires_grad=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def prepack_weights(self, int8_head: bool = False) -> int:
        """Pack every projection (and the lm_head) for the backend's native GEMMs (Linear.prepack); with
        `int8_head` the lm_head is packed as an int8 quantization of itself. Returns the bytes the copies add.
        The weights must not be replaced afterwards."""
        added = sum(m.prepack(int8_copy=int8_head and m is self.lm_head) for m in self.modules()
                    if isinstance(m, Linear))
        added += self.tied_head.prepack(int8_copy=int8_head) if self.tied_head is not None else 0
        # One step then reads the packed copies as one stream, on 2 MiB pages (modules() is execution order).
        heads = [self.tied_head] if self.tied_head is not None else []
        move_to_huge_pages(m.packed for m in [*self.modules(), *heads]
                                  if isinstance(m, Linear | TiedHead) and m.packed is not None)
        return added

    def bind_decode_step(self, cos_sin: torch.Tensor) -> bool:
        """Run the layer loop of decode-only steps in one native call where the backend has one
        (Kernels.build_decode_step: the CPU's, over the packed projections). Call after prepack_weights and
        after the KV caches are bound; returns whether the native step is on."""
        cfg = self.config
        layers = [DecoderLayerWeights(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                                      layer.self_attn.qkv_proj.packed, layer.self_attn.o_proj.packed,
                                      layer.mlp.gate_up_proj.packed, layer.mlp.down_proj.packed,
                                      layer.self_attn.attn.k_cache, layer.self_attn.attn.v_cache)
                  for layer in self.layers]
        head = self.lm_head.packed if self.lm_head is not None else self.tied_head.packed
        self.decode_step = self.kernels.build_decode_step(
            layers, num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim, eps=cfg.rms_norm_eps, scale=self.layers[0].self_attn.attn.scale, cos_sin=cos_sin,
            final_norm=self.norm.weight, head=head)
        if self.decode_step is not None and self.head_vocab_ids is None:
            # Greedy bursts (DecodeStep.greedy) look the next token up themselves; a draft's narrow head numbers
            # its rows differently from the vocabulary, so it keeps the per-step path.
            self.decode_step.set_embedding(self.embed_tokens.weight)
        return self.decode_step is not None

    def is_quantized(self) -> bool:
        return any(m.quantization is not None for m in self.modules() if isinstance(m, Linear))

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """Run every new token through the model; return fp32 logits only for rows `logits_indices`."""
        hidden = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        step = self.decode_step
        if self.capture_layers is not None:
            hidden, residual = self._forward_capturing(hidden, positions, cos_sin, meta)
        elif step is not None and 0 < meta.num_decode_tokens == hidden.shape[0]:
            # Every row a decode: the whole layer loop in one native call (its activations are fp32), through the
            # head too when every row is sampled (a decode-only batch's logits_indices are then 0..B-1).
            args = (hidden, positions, meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens)
            if step.has_head and logits_indices.shape[0] == hidden.shape[0]:
                return self._vocab_logits(step.logits(*args))
            hidden, residual = step(*args)
        else:
            for layer in self.layers:
                hidden, residual = layer.forward(hidden, residual, positions, cos_sin, meta)
        # Only the rows we sample from need the final norm and the (large) vocabulary projection.
        if residual is None:
            residual = torch.zeros_like(hidden)
        hidden = hidden.index_select(0, logits_indices)
        residual = residual.index_select(0, logits_indices)
        hidden, _ = self.norm(hidden, residual)
        logits = self.lm_head.forward(hidden) if self.lm_head is not None else self.tied_head(hidden)
        return self._vocab_logits(logits)

    def _forward_capturing(self, hidden: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                           meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer loop, keeping the stream (hidden + residual) after each layer in capture_layers (the native
        decode step has no such exits: a capturing model always takes this loop)."""
        keep = self.capture_layers or ()
        residual: torch.Tensor | None = None
        feats: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            hidden, residual = layer.forward(hidden, residual, positions, cos_sin, meta)
            if i in keep:
                feats.append((hidden + residual).float())
        self.captured = torch.cat(feats, dim=-1)
        return hidden, residual

    def _vocab_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's output as fp32 logits over the whole vocabulary."""
        if self.head_vocab_ids is not None:
            # Scatter the narrow head's rows into the full vocabulary: the sampler and the rejection sampler
            # see a distribution over every token, zero outside the head's.
            full = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"), dtype=torch.float32)
            return full.index_copy_(1, self.head_vocab_ids, logits.float())
        return logits.float()
