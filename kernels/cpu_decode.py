"""A decode step's decoder layers in one native call (cpu_decode.c): for batches where every sequence adds
one token, the layer loop runs in C over the same kernels the per-op path calls from Python one at a time.

`build_decode_step` takes the model's per-layer weights as the CPU kernels packed them (fp32 panels, int8 /
int4 / bf16 strips), the norms and each layer's KV cache, and returns a `DecodeStep`, or None where the native
step cannot take the model (no native library, a projection left unpacked, a shape the kernels do not
take): the caller then keeps its per-op loop. Given the final norm and the packed vocabulary head too, the
step can also end in logits (`DecodeStep.logits`), the head run in the same native region; a head the
kernels cannot take leaves `has_head` False and the caller projects as before. The step holds raw pointers
to those tensors and references to them (so they outlive it); they must not be replaced afterwards, as for
the packed layers themselves.
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels import cpu_native
from kernels.cpu_lowp import BF16Strips, Int4Strips, Int8Strips, ThreadScratch, data_ptr
from kernels.cpu_native import MAX_BLOCK_ROW, MAX_HEAD_DIM, MAX_Q_HEADS, PackedLinear

_F32, _BF16, _I32, _I64 = torch.float32, torch.bfloat16, torch.int32, torch.int64
_P, _I = ctypes.c_void_p, ctypes.c_int32
# switchyard_kernels.h's SY_PROJ_* and SY_ERR_*; the Structures below mirror its sy_proj, sy_layer, sy_model
# (tests/kernels/test_kernel_c_interface.py compares all of them with what the compiled library reports).
_F32_PANELS, _INT8, _INT4, _BF16_STRIPS = 1, 2, 3, 4
_ERR_BLOCK, _ERR_TABLE, _ERR_POSITION, _ERR_SLOT, _ERR_NO_HEAD, _ERR_TOKEN = -1, -3, -4, -5, -7, -8


class _Proj(ctypes.Structure):
    _fields_ = [("kind", _I), ("group_size", _I), ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("w", _P),
                ("aux", _P), ("bias", _P)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("k_cache", _P), ("v_cache", _P), ("qkv", _Proj),
                ("o", _Proj), ("gate_up", _Proj), ("down", _Proj)]


class _Model(ctypes.Structure):
    _fields_ = [("num_layers", _I), ("hidden", _I), ("num_heads", _I), ("num_kv_heads", _I), ("head_dim", _I),
                ("inter", _I), ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("kv_bf16", _I),
                ("block_size", _I), ("cache_sb", ctypes.c_int64), ("cache_so", ctypes.c_int64),
                ("cache_sh", ctypes.c_int64), ("num_blocks", ctypes.c_int64), ("cos_sin", _P),
                ("max_position", ctypes.c_int64), ("layers", _P), ("final_norm", _P), ("head", _Proj)]


@dataclass(frozen=True, slots=True)
class DecoderLayerWeights:
    """What one Llama-family decoder layer gives the native step."""

    input_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    qkv: object  # the packed projections (Linear.packed)
    o: object
    gate_up: object
    down: object
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor


def _projection(packed: object, n: int, k: int) -> _Proj | None:
    """The C descriptor of a packed projection of shape [n, k], or None if the step cannot run it."""
    if isinstance(packed, PackedLinear) and packed.panels is not None:
        kind, w, aux, group = _F32_PANELS, packed.panels, None, 0
    elif isinstance(packed, Int8Strips):
        kind, w, aux, group = _INT8, packed.packed, packed.scales, 0
    elif isinstance(packed, Int4Strips):
        kind, w, aux, group = _INT4, packed.packed, packed.sz, packed.group_size
    elif isinstance(packed, BF16Strips):
        kind, w, aux, group = _BF16_STRIPS, packed.packed, None, 0
    else:
        return None
    if (packed.n, packed.k) != (n, k):
        return None
    return _Proj(kind, group, n, k, data_ptr(w), data_ptr(aux), data_ptr(packed.bias))


def _owned(packed: object) -> list[torch.Tensor]:
    bias = [packed.bias] if isinstance(packed, PackedLinear) and packed.bias is not None else []
    return packed.owned_tensors() + bias


class DecodeStep:
    """The layer loop of a decode step: step(hidden, positions, slots, block_tables, context_lens) ->
    (hidden, residual), both fp32 [B, hidden]; see build_decode_step."""

    def __init__(self, lib: ctypes.CDLL, model: _Model, layers: ctypes.Array, keep: list[torch.Tensor]) -> None:
        self._lib, self._model, self._layers, self._keep = lib, model, layers, keep
        self._model_p = ctypes.addressof(model)
        self.hidden = model.hidden
        self.has_head = bool(model.final_norm)
        self.head_rows = int(model.head.n) if self.has_head else 0
        self._workspace = ThreadScratch()
        self._size = 0
        self._embed: torch.Tensor | None = None  # the token embedding table, for greedy() (set_embedding)

    def set_embedding(self, table: torch.Tensor) -> bool:
        """Give the step the model's token embedding table ([vocab, hidden] fp32 or bf16, CPU), which greedy()
        looks tokens up in; the table must not be replaced afterwards. Returns whether greedy() is now on."""
        if (table.dim() != 2 or table.shape[1] != self.hidden or table.dtype not in (_F32, _BF16)
                or table.device.type != "cpu" or not table.is_contiguous() or not self.has_head):
            return False
        self._embed = table
        return True

    @property
    def can_greedy(self) -> bool:
        return self._embed is not None

    def greedy(self, tokens: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
               stop_ids: torch.Tensor, budget: torch.Tensor, steps: int,
               interrupt: torch.Tensor | None = None) -> torch.Tensor:
        """Up to `steps` greedy decode steps in one native call (cpu_decode.c sy_decode_greedy): row b feeds
        tokens[b] at positions[b], then each step's argmax (the first on ties) to the next. It ends after the
        step in which a row makes one of its stop_ids (int32 [B, S], -1 pads) or its budget[b]-th token.
        block_tables (int32 [B, W]) must already hold every position the steps write. `interrupt` (int32 [1])
        ends the call after the step during which another thread sets it nonzero. Returns int64 [B, steps run]:
        each row's new tokens. tokens/positions int64 [B], budget int32 [B] (>= 1)."""
        if self._embed is None:
            raise ValueError("decode step: greedy() needs the embedding table (set_embedding)")
        batch = tokens.shape[0]
        if (tokens.dtype != _I64 or positions.dtype != _I64 or block_tables.dtype != _I32 or stop_ids.dtype != _I32
                or budget.dtype != _I32 or positions.shape != (batch,) or budget.shape != (batch,)
                or block_tables.dim() != 2 or block_tables.shape[0] != batch or stop_ids.dim() != 2
                or stop_ids.shape[0] != batch or steps < 1 or not all(t.is_contiguous() for t in (
                    tokens, positions, block_tables, stop_ids, budget))
                or (interrupt is not None and (interrupt.dtype != _I32 or interrupt.numel() != 1))):
            raise ValueError("decode step: greedy inputs do not match the batch (int64 tokens/positions [B], int32 "
                             "block tables [B, W], stop ids [B, S] and budgets [B], all contiguous; steps >= 1)")
        out = torch.empty(batch, steps, dtype=_I64)
        buffers = [torch.empty(batch, self.hidden, dtype=_F32) for _ in range(3)]
        logits = torch.empty(batch, self.head_rows, dtype=_F32)
        done = ctypes.c_int(0)
        threads = max(1, torch.get_num_threads())
        table = self._embed
        for _ in range(2):
            ws = self._workspace.get(self._size)
            rc = self._lib.sy_decode_greedy(
                self._model_p, table.data_ptr(), int(table.dtype == _BF16), table.shape[0], batch, tokens.data_ptr(),
                positions.data_ptr(), block_tables.data_ptr(), block_tables.shape[1], stop_ids.data_ptr(),
                stop_ids.shape[1], budget.data_ptr(), steps, data_ptr(interrupt), out.data_ptr(), ctypes.byref(done),
                *(b.data_ptr() for b in buffers), logits.data_ptr(), ws, self._workspace.buf.numel(), threads)
            if rc <= 0:
                break
            self._size = int(rc)
        if rc < 0:
            _raise(int(rc), self._model, (positions + steps).to(_I32))
        return out[:, :done.value]

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, residual, _ = self._run(hidden, positions, slots, block_tables, context_lens, False)
        return out, residual

    def logits(self, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
               context_lens: torch.Tensor) -> torch.Tensor:
        """The step through the final norm and the head: fp32 logits [B, head_rows] (needs has_head)."""
        if not self.has_head:
            raise ValueError("decode step: this plan has no head (build_decode_step was not given one it can run)")
        return self._run(hidden, positions, slots, block_tables, context_lens, True)[2]

    def _run(self, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
             context_lens: torch.Tensor, with_logits: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        batch = hidden.shape[0]
        if hidden.dtype != _F32 or not hidden.is_contiguous():
            hidden = hidden.float().contiguous()
        if (hidden.shape != (batch, self.hidden) or positions.dtype != _I64 or slots.dtype != _I64
                or block_tables.dtype != _I32 or context_lens.dtype != _I32 or positions.shape != (batch,)
                or slots.shape != (batch,) or context_lens.shape != (batch,) or block_tables.dim() != 2
                or block_tables.shape[0] != batch or not positions.is_contiguous() or not slots.is_contiguous()
                or not block_tables.is_contiguous() or not context_lens.is_contiguous()):
            raise ValueError("decode step: inputs do not match the batch (hidden [B, H] and int64 positions/slots, "
                             "int32 block tables and lengths, all contiguous)")
        out = torch.empty(batch, self.hidden, dtype=_F32)
        residual = torch.empty(batch, self.hidden, dtype=_F32)
        logits = torch.empty(batch, self.head_rows, dtype=_F32) if with_logits else None
        threads = max(1, torch.get_num_threads())
        for _ in range(2):
            ws = self._workspace.get(self._size)  # grows to what the C side asked for (once per new shape)
            rc = self._lib.sy_decode_layers(
                self._model_p, hidden.data_ptr(), batch, positions.data_ptr(), slots.data_ptr(),
                block_tables.data_ptr(), block_tables.shape[1], context_lens.data_ptr(), out.data_ptr(),
                residual.data_ptr(), data_ptr(logits), ws, self._workspace.buf.numel(), threads)
            if rc <= 0:
                break
            self._size = int(rc)
        if rc < 0:
            _raise(int(rc), self._model, context_lens)
        return out, residual, logits


def _raise(rc: int, model: _Model, lens: torch.Tensor) -> None:
    if rc == _ERR_BLOCK:
        raise ValueError(f"decode step: a block table entry is outside the pool of {model.num_blocks} blocks")
    if rc == _ERR_TABLE:
        raise ValueError(f"decode step: context length {int(lens.max())} needs more blocks than the block table has")
    if rc == _ERR_POSITION:
        raise IndexError(f"decode step: a position is outside the rotary table of {model.max_position} positions")
    if rc == _ERR_SLOT:
        raise IndexError(f"decode step: a slot is beyond the cache's {model.num_blocks * model.block_size} slots")
    if rc == _ERR_NO_HEAD:
        raise ValueError("decode step: logits asked of a plan without a head")
    if rc == _ERR_TOKEN:
        raise ValueError("decode step: a token id is outside the embedding table")
    raise RuntimeError(f"decode step: a native kernel failed (rc={rc})")


def build_decode_step(layers: Sequence[DecoderLayerWeights], *, num_heads: int, num_kv_heads: int, head_dim: int,
                      eps: float, scale: float, cos_sin: torch.Tensor, final_norm: torch.Tensor | None = None,
                      head: object | None = None) -> DecodeStep | None:
    """The native step over `layers` (Llama-family decoder layers in order), or None where it does not apply.
    With `final_norm` ([hidden]) and `head` (the vocabulary projection as the CPU kernels packed it) the step
    can end in logits too, if the kernels take that head (else DecodeStep.has_head is False)."""
    lib = cpu_native.library()
    if lib is None or not layers or cos_sin.dtype != _F32 or not cos_sin.is_contiguous() or cos_sin.dim() != 2:
        return None
    first = layers[0]
    hidden = first.input_norm.shape[0]
    qd, kvd = num_heads * head_dim, num_kv_heads * head_dim
    cache = first.k_cache
    if (head_dim % 16 or head_dim > MAX_HEAD_DIM or num_heads > MAX_Q_HEADS or num_kv_heads <= 0
            or num_heads % num_kv_heads or cos_sin.shape[1] != head_dim or cache.dim() != 4
            or cache.dtype not in (_F32, _BF16) or cache.shape[2:] != (num_kv_heads, head_dim)
            or cache.stride(3) != 1):
        return None
    num_blocks, block_size = cache.shape[:2]
    if cache.dtype == _BF16 and block_size * kvd > MAX_BLOCK_ROW:
        return None
    inter = getattr(first.down, "k", 0)
    keep: list[torch.Tensor] = [cos_sin]
    rows = (_Layer * len(layers))()
    for row, layer in zip(rows, layers):
        norms = []
        for norm in (layer.input_norm, layer.post_norm):
            if norm.shape != (hidden,) or norm.device.type != "cpu":
                return None
            norms.append(norm.detach().to(_F32).contiguous())
        projections = [_projection(layer.qkv, qd + 2 * kvd, hidden), _projection(layer.o, hidden, qd),
                       _projection(layer.gate_up, 2 * inter, hidden), _projection(layer.down, hidden, inter)]
        if any(p is None for p in projections):
            return None
        for c in (layer.k_cache, layer.v_cache):
            if c.shape != cache.shape or c.stride() != cache.stride() or c.dtype != cache.dtype:
                return None
        row.input_norm, row.post_norm = norms[0].data_ptr(), norms[1].data_ptr()
        row.k_cache, row.v_cache = layer.k_cache.data_ptr(), layer.v_cache.data_ptr()
        row.qkv, row.o, row.gate_up, row.down = projections
        keep += norms + [layer.k_cache, layer.v_cache]
        for packed in (layer.qkv, layer.o, layer.gate_up, layer.down):
            keep += _owned(packed)
    model = _Model(len(layers), hidden, num_heads, num_kv_heads, head_dim, inter, eps, scale,
                   int(cache.dtype == _BF16), block_size, cache.stride(0), cache.stride(1), cache.stride(2),
                   num_blocks, cos_sin.data_ptr(), cos_sin.shape[0], ctypes.addressof(rows))
    if not lib.sy_decode_plan_ok(ctypes.addressof(model)):
        return None  # a projection kind or shape this build's kernels do not run
    if final_norm is not None and head is not None:
        _attach_head(lib, model, keep, final_norm, head, hidden)
    return DecodeStep(lib, model, rows, keep)


def _attach_head(lib: ctypes.CDLL, model: _Model, keep: list[torch.Tensor], final_norm: torch.Tensor, head: object,
                 hidden: int) -> None:
    """Put the final norm and the head into the plan, or leave the plan without a head if the kernels cannot
    run it (a head left unpacked, another shape)."""
    n = getattr(head, "n", 0)
    proj = _projection(head, n, hidden) if n else None
    if proj is None or final_norm.shape != (hidden,) or final_norm.device.type != "cpu":
        return
    norm = final_norm.detach().to(_F32).contiguous()
    model.final_norm, model.head = norm.data_ptr(), proj
    if not lib.sy_decode_plan_ok(ctypes.addressof(model)):
        model.final_norm, model.head = None, _Proj()
        return
    keep += [norm, *_owned(head)]
