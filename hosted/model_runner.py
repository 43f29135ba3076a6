"""Owns the model and its KV pool on one device; turns a scheduled batch into one forward pass."""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from hosted import cpu_memory
from hosted.config import EngineConfig, ModelConfig
from hosted.layers.attention import AttentionMetadata
from hosted.loader import load_model, torch_dtype
from hosted.scheduler import ScheduledBatch
from hosted.sequence import Sequence
from kernels import ops, switches

log = logging.getLogger(__name__)

_CPU_DEFAULT_KV_BYTES = 1 << 30  # 1 GiB
_CUDA_KV_FRACTION = 0.85  # of the memory free after the weights are loaded


def resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {name!r}")
    return device


class ModelRunner:
    def __init__(self, model_config: ModelConfig, config: EngineConfig, max_model_len: int) -> None:
        self.model_config = model_config
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = torch_dtype(config.dtype)
        if self.device.type == "cpu" and self.dtype == torch.float16:
            raise ValueError("float16 is not supported on CPU; use float32 or bfloat16")
        self.kv_dtype = self.dtype if config.kv_cache_dtype == "auto" else torch_dtype(config.kv_cache_dtype)
        if self.kv_dtype != self.dtype and self.device.type != "cpu":
            raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype} beside {config.dtype} weights runs on CPU only "
                             "(the Triton attention kernels take a cache of the model's dtype); use auto")
        self.block_size = config.block_size
        self.captured_items: list[tuple[Sequence, int, int]] = []  # (seq, first position, rows) per captured item
        if config.cpu_native is not None:  # the native library is the process's: built once, as configured
            switches.configure(cpu_native=config.cpu_native)
        defaults = switches.current()
        self.kernels = ops.select(self.device, config.kernels)  # the kernel backend, decided once for this model
        self.model = load_model(config.model_dir, model_config, self.dtype, self.device,
                                config.quantization, config.quantization_group_size, self.kernels)
        if self.device.type == "cpu":
            cpu_memory.tune_process_for(self.model)  # before packing: packed linears keep data pointers
        packed = config.cpu_packed_weights if config.cpu_packed_weights is not None else defaults.cpu_packed_weights
        if self.device.type == "cpu" and packed:
            # CPU GEMMs with the weights packed once (more memory: a second copy of each weight). Beside
            # quantized decoder layers the lm_head (a fifth of SmolLM2's weights) is read as int8 too.
            int8_head = config.quantize_head if config.quantize_head is not None else self.model.is_quantized()
            added = self.model.prepack_weights(int8_head=int8_head)
            if added:
                log.info("prepacked CPU weights: +%.1f MiB", added / (1 << 20))
        self.cos_sin = ops.rotary_cos_sin(model_config.head_dim, max_model_len, model_config.rope_theta,
                                          model_config.rope_scaling, self.device)
        self.num_blocks = self._pool_blocks(max_model_len)
        self._allocate_kv_cache()
        # Decode-only steps through one native call for all layers (CPU, packed weights); off: the per-op loop.
        step = config.cpu_decode_step if config.cpu_decode_step is not None else defaults.cpu_decode_step
        if step and self.model.bind_decode_step(self.cos_sin):
            log.info("decode steps: native layer loop")

    # ---- KV pool ----------------------------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        c = self.model_config
        return 2 * c.num_hidden_layers * self.block_size * c.num_key_value_heads * c.head_dim * self.kv_dtype.itemsize

    def _pool_blocks(self, max_model_len: int) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        per_block = self.bytes_per_block
        if cfg.kv_cache_gb is not None:
            blocks = int(cfg.kv_cache_gb * (1 << 30)) // per_block
        else:
            # Enough for every sequence at full length, but no more than the device default.
            wanted = cfg.max_num_seqs * -(-max_model_len // self.block_size)
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                cap = int(free * _CUDA_KV_FRACTION) // per_block
            else:
                cap = _CPU_DEFAULT_KV_BYTES // per_block
            blocks = min(wanted, cap)
        if blocks < 1:
            raise ValueError(f"KV cache budget is smaller than one block ({per_block} bytes)")
        return blocks

    def _allocate_kv_cache(self) -> None:
        c = self.model_config
        shape = (c.num_hidden_layers, 2, self.num_blocks, self.block_size, c.num_key_value_heads, c.head_dim)
        if self.device.type == "cpu":
            self.kv_cache = cpu_memory.cpu_zeros_on_huge_pages(shape, self.kv_dtype)
        else:
            self.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache = self.kv_cache[i, 0]
            attn.v_cache = self.kv_cache[i, 1]
        log.info("KV pool: %d blocks x %d tokens (%.1f MiB)", self.num_blocks, self.block_size,
                 self.kv_cache.numel() * self.kv_cache.element_size() / (1 << 20))

    # ---- one step ---------------------------------------------------------------------------------
    def execute(self, batch: ScheduledBatch, before_forward: Callable[[], None] | None = None,
                ) -> tuple[torch.Tensor | None, list[Sequence]]:
        """Forward the batch. Returns fp32 logits [S, V] for the sequences that reach their end this step
        (and so sample a token), with those sequences in row order; (None, []) if none do. A sequence verifying
        draft tokens gets 1 + len(seq.spec_token_ids) consecutive rows. `before_forward` runs once the inputs
        are built, right before the model."""
        if getattr(self.model, "capture_layers", None) is not None:
            # Which sequence's positions the captured feature rows hold (an EAGLE draft reads them next step).
            self.captured_items = [(seq, seq.num_computed_tokens, n) for seq, n in batch.items]
        input_ids, positions, meta, logits_indices, sample_seqs = self.prepare(batch)
        if before_forward is not None:
            before_forward()
        if not sample_seqs:
            # Only partial prefill chunks: the forward still has to fill the KV cache.
            logits_indices = logits_indices[:0]
        with torch.inference_mode():
            logits = self.model(input_ids, positions, self.cos_sin, meta, logits_indices)  # no-op if nested
        return (logits if sample_seqs else None), sample_seqs

    @property
    def can_decode_greedy(self) -> bool:
        """Whether decode_greedy runs here (the CPU's native decode step, with its head and embedding)."""
        step = getattr(self.model, "decode_step", None)
        return step is not None and step.can_greedy

    def decode_greedy(self, seqs: list[Sequence], steps: int, stop_ids: list[list[int]], budgets: list[int],
                      interrupt: torch.Tensor | None = None) -> list[list[int]]:
        """Up to `steps` greedy decode steps of `seqs` in one native call (DecodeStep.greedy). Each sequence has
        one uncomputed token and blocks for `steps` more positions; stop_ids[i] and budgets[i] end the call after
        the step in which sequence i makes one of those tokens or its budgets[i]-th, and after any step once
        `interrupt` (int32 [1]) is nonzero. Returns each sequence's new tokens (as many for every sequence)."""
        width = max(1, max(len(ids) for ids in stop_ids))
        with torch.inference_mode():
            out = self.model.decode_step.greedy(
                torch.tensor([s.token_ids[-1] for s in seqs], dtype=torch.int64),
                torch.tensor([s.num_computed_tokens for s in seqs], dtype=torch.int64),
                _table_tensor([s.block_table for s in seqs], self.device),
                torch.tensor([ids + [-1] * (width - len(ids)) for ids in stop_ids], dtype=torch.int32),
                torch.tensor(budgets, dtype=torch.int32), steps, interrupt)
        return out.tolist()

    def prepare(self, batch: ScheduledBatch):
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        sample_seqs: list[Sequence] = []
        dec_tables: list[list[int]] = []
        dec_lens: list[int] = []
        pre_tables: list[list[int]] = []
        pre_cu: list[int] = [0]
        pre_lens: list[int] = []
        for i, (seq, n) in enumerate(batch.items):
            start = seq.num_computed_tokens
            end = start + n
            table = seq.block_table
            input_ids.extend(seq.token_ids[start:end])
            num_spec = end - seq.num_tokens  # > 0: a decode verifying draft tokens (hosted/spec/)
            if num_spec > 0:
                assert num_spec == len(seq.spec_token_ids), "scheduled tokens do not match the draft"
                input_ids.extend(seq.spec_token_ids)
            positions.extend(range(start, end))
            if n == 1:
                slots.append(table[start // bs] * bs + start % bs)
            else:
                slots.extend([table[p // bs] * bs + p % bs for p in range(start, end)])
            if end >= seq.num_tokens:
                # The last token's row, plus one row per draft token to verify.
                logits_indices.extend(range(len(input_ids) - 1 - max(num_spec, 0), len(input_ids)))
                sample_seqs.append(seq)
            if i < batch.num_decodes:
                dec_tables.append(table)
                dec_lens.append(end)
            else:
                pre_tables.append(table)
                pre_cu.append(pre_cu[-1] + n)
                pre_lens.append(end)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=_tensor(slots, torch.int64, dev),
            num_decode_tokens=batch.num_decodes,
            decode_block_tables=_table_tensor(dec_tables, dev) if dec_tables else None,
            decode_context_lens=_tensor(dec_lens, torch.int32, dev) if dec_tables else None,
            prefill_block_tables=_table_tensor(pre_tables, dev) if pre_tables else None,
            prefill_cu_seqlens_q=_tensor(pre_cu, torch.int32, dev) if pre_tables else None,
            prefill_context_lens=_tensor(pre_lens, torch.int32, dev) if pre_tables else None,
        )
        return (_tensor(input_ids, torch.int64, dev), _tensor(positions, torch.int64, dev), meta,
                _tensor(logits_indices, torch.int64, dev), sample_seqs)


def _tensor(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cpu":
        t = t.pin_memory().to(device, non_blocking=True)
    return t


def _table_tensor(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return _tensor([t + [0] * (width - len(t)) for t in tables], torch.int32, device)
