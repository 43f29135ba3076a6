"""The only kernel entry points the engine calls: one dispatch layer over Triton, the native CPU kernels and
the torch reference, decided once per device.

`select(device, mode)` returns a `Kernels`: the entry points of one backend. The engine calls it once, when its
model runner is built, and its layers hold the result. `mode` defaults to the process's `kernels` switch
(kernels/switches.py: the engine's config, or the SWITCHYARD_KERNELS override read once at start); nothing here
reads the environment. The module-level functions of the same names choose per call (from their tensors' device
and the switch): for tests, benchmarks and one-off use.

Backends (the `kernels` switch, `mode`):
  unset/"auto":  CUDA -> "triton" (when triton imports, else "reference"); CPU -> "cpu": the compiled CPU
                 kernels of kernels/cpu_native.py where they apply (decode attention; fp32 rotary, KV write,
                 RMSNorm, SiLU-and-multiply, the prepacked panel GEMM and the few-row GEMV), else the
                 plain-torch reference (vectorised; the rest of the engine's CPU path).
  "triton":      Triton always (on CPU this needs TRITON_INTERPRET=1 and is slow).
  "reference":   the reference always (the cpu_native switch off only turns the native CPU kernels off).

Layouts: see kernels/reference.py (KV cache [num_blocks, block_size, num_kv_heads, head_dim]).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import cpu_decode, cpu_lowp, cpu_native, reference, switches


def backend_mode() -> str:
    """The process's `kernels` switch (kernels/switches.py)."""
    return switches.current().kernels


_loaded: dict[str, object] = {}  # "module": kernels.triton_ops or None, "interpret": mode it was built in


def _interpret_env() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _triton_module() -> ModuleType | None:
    """kernels.triton_ops, imported on first use (never on a CPU-only run in auto mode)."""
    interpret = _interpret_env()
    if _loaded and _loaded["interpret"] == interpret:
        return _loaded["module"]  # type: ignore[return-value]
    try:
        from triton.runtime.interpreter import InterpretedFunction

        from kernels import triton_ops, triton_pointwise
    except ImportError:  # no triton on this platform
        triton_ops = None
    else:
        # Triton fixes compiled-vs-interpreted when `triton` (its own @jit library functions included)
        # is imported; flipping TRITON_INTERPRET afterwards cannot take effect in this process.
        if isinstance(triton_pointwise._rms_norm_kernel, InterpretedFunction) != interpret:
            raise RuntimeError(
                f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r} was changed after triton was "
                "imported; set it before anything imports triton (or run in a fresh process)"
            )
    _loaded.update(module=triton_ops, interpret=interpret)
    return triton_ops


# --------------------------------------------------------------------------- one backend


@dataclass(frozen=True, slots=True)
class Kernels:
    """The entry points of one backend (signatures as the module-level functions below)."""

    name: str  # "triton" | "cpu" (native CPU kernels, reference fallback) | "reference"
    store_kv: Callable[..., None]
    paged_decode_attention: Callable[..., torch.Tensor]
    paged_prefill_attention: Callable[..., torch.Tensor]
    rms_norm: Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]
    apply_rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    linear: Callable[..., torch.Tensor]
    prepack_linear: Callable[..., cpu_native.PackedLinear | cpu_lowp.LowpStrips | None]
    prepack_int8: Callable[..., cpu_lowp.Int8Strips | None]
    prepack_int4: Callable[..., cpu_lowp.Int4Strips | None]
    int8_linear: Callable[..., torch.Tensor]
    int4_linear: Callable[..., torch.Tensor]
    # A whole decode step's layer loop in one call (kernels/cpu_decode.py), or None where the backend has none.
    build_decode_step: Callable[..., cpu_decode.DecodeStep | None]


_selected: dict[tuple[str, bool, bool], Kernels] = {}


def select(device: torch.device | str, mode: str | None = None) -> Kernels:
    """The backend for tensors on `device` in `mode` (auto | triton | reference; default: the process's `kernels`
    switch), as TRITON_INTERPRET says now."""
    cuda = torch.device(device).type == "cuda"
    if mode is None:
        mode = switches.current().kernels
    elif mode not in switches.MODES:
        raise ValueError(f"kernels mode {mode!r} is not one of {', '.join(switches.MODES)}")
    key = (mode, cuda, _interpret_env())
    kernels = _selected.get(key)
    if kernels is None:
        kernels = _selected[key] = _choose(key[0], cuda)
    return kernels


def _choose(mode: str, cuda: bool) -> Kernels:
    if mode == "reference":
        return REFERENCE
    if mode == "auto":
        if not cuda:
            return CPU
        module = _triton_module()
        return _triton_kernels(module) if module is not None else REFERENCE
    module = _triton_module()  # mode == "triton"
    if module is None:
        raise RuntimeError("kernels=triton (SWITCHYARD_KERNELS) but triton is not importable")
    if not cuda and not _interpret_env():
        raise RuntimeError("kernels=triton (SWITCHYARD_KERNELS) with CPU tensors needs TRITON_INTERPRET=1")
    return _triton_kernels(module)


def active_backend(t: torch.Tensor) -> str:
    """'triton' or 'reference': what a call with tensors on t's device would run (on CPU in auto mode the
    reference side includes the native kernels where they apply: see native_cpu_active)."""
    return "triton" if select(t.device).name == "triton" else "reference"


def native_cpu_active(t: torch.Tensor) -> bool:
    """Whether calls with tensors on t's device may use the compiled CPU kernels (kernels/cpu_native.py)."""
    return select(t.device).name == "cpu" and cpu_native.library() is not None


# --------------------------------------------------------------------------- checks every backend runs


def _check_store_kv(key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    if key.shape != value.shape or key.dim() != 3 or key.shape[0] != slot_mapping.shape[0]:
        raise ValueError(
            f"store_kv: key {tuple(key.shape)}, value {tuple(value.shape)}, "
            f"slot_mapping {tuple(slot_mapping.shape)} do not agree"
        )


def _check_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"attention: q {tuple(q.shape)} must be [*, Hq, D] and caches "
            f"{tuple(k_cache.shape)}/{tuple(v_cache.shape)} [num_blocks, block_size, Hkv, D]"
        )
    if q.shape[-1] != k_cache.shape[-1] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(
            f"attention: head_dim {q.shape[-1]} vs {k_cache.shape[-1]}, or Hq {q.shape[1]} "
            f"not a multiple of Hkv {k_cache.shape[2]}"
        )


def _checked(impl: Callable[..., None]) -> Callable[..., None]:
    def store_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
        _check_store_kv(key, value, slot_mapping)
        impl(key, value, k_cache, v_cache, slot_mapping)

    return store_kv


def _checked_attention(impl: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, *args: object) -> Tensor:
        _check_attention(q, k_cache, v_cache)
        return impl(q, k_cache, v_cache, *args)

    return attention


def _kernels(name: str, *, store_kv, paged_decode_attention, paged_prefill_attention, **rest) -> Kernels:
    return Kernels(name, _checked(store_kv), _checked_attention(paged_decode_attention),
                   _checked_attention(paged_prefill_attention), **rest)


# --------------------------------------------------------------------------- the three backends


def _dense_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, packed: object = None) -> Tensor:
    return F.linear(x, weight, bias)


def _unavailable(*args: object, **kwargs: object) -> None:
    """A backend's packed form or native step where it has none."""
    return


REFERENCE = _kernels(
    "reference", store_kv=reference.store_kv, paged_decode_attention=reference.paged_decode_attention,
    paged_prefill_attention=reference.paged_prefill_attention, rms_norm=reference.rms_norm,
    apply_rotary=reference.apply_rotary, silu_and_mul=reference.silu_and_mul, linear=_dense_linear,
    prepack_linear=_unavailable, prepack_int8=_unavailable, prepack_int4=_unavailable,
    int8_linear=reference.int8_linear, int4_linear=reference.int4_linear, build_decode_step=_unavailable,
)


def _triton_kernels(tk: ModuleType) -> Kernels:
    return _kernels(
        "triton", store_kv=tk.store_kv, paged_decode_attention=tk.paged_decode_attention,
        paged_prefill_attention=tk.paged_prefill_attention, rms_norm=tk.rms_norm, apply_rotary=tk.apply_rotary,
        silu_and_mul=reference.silu_and_mul, linear=_dense_linear, prepack_linear=_unavailable,
        prepack_int8=_unavailable, prepack_int4=_unavailable, int8_linear=tk.int8_linear, int4_linear=tk.int4_linear,
        build_decode_step=_unavailable,
    )


def _native_first(native: Callable[..., torch.Tensor | None], fallback: Callable[..., torch.Tensor]):
    """The native CPU kernel where it applies (it returns None where not), else the reference."""

    def call(*args: object) -> Tensor:
        out = native(*args)
        return fallback(*args) if out is None else out

    return call


def _cpu_store_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    if not cpu_native.store_kv(key, value, k_cache, v_cache, slot_mapping):
        reference.store_kv(key, value, k_cache, v_cache, slot_mapping)


def _cpu_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None,
                packed: cpu_native.PackedLinear | None = None) -> Tensor:
    if packed is not None:
        return packed(x)
    out = cpu_native.linear(x, weight, bias)
    return F.linear(x, weight, bias) if out is None else out


def _cpu_prepack(weight: Tensor, bias: Tensor | None = None) -> cpu_native.PackedLinear | cpu_lowp.LowpStrips | None:
    if weight.is_cuda:
        return None
    if weight.dtype == torch.bfloat16:
        return cpu_lowp.make_bf16(weight, bias)
    return cpu_native.pack_linear(weight, bias)


CPU = _kernels(
    "cpu", store_kv=_cpu_store_kv,
    paged_decode_attention=_native_first(cpu_native.paged_decode_attention, reference.paged_decode_attention),
    paged_prefill_attention=_native_first(cpu_native.paged_prefill_attention, reference.paged_prefill_attention),
    rms_norm=_native_first(cpu_native.rms_norm, reference.rms_norm),
    apply_rotary=_native_first(cpu_native.apply_rotary, reference.apply_rotary),
    silu_and_mul=_native_first(cpu_native.silu_and_mul, reference.silu_and_mul),
    linear=_cpu_linear, prepack_linear=_cpu_prepack,
    # Packed once per layer (Linear.prepack): VNNI int8 x int8 and int4 x int8 dot products. The reference
    # below serves unpacked layers (torch's aten._weight_int8pack_mm was measured 2-20x slower than it).
    prepack_int8=cpu_lowp.make_int8, prepack_int4=cpu_lowp.make_int4,
    int8_linear=reference.int8_linear, int4_linear=reference.int4_linear,
    build_decode_step=cpu_decode.build_decode_step,
)


# --------------------------------------------------------------------------- per-call entry points


def store_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """In place: k_cache/v_cache slot slot_mapping[t] <- key[t]/value[t]; slot < 0 is skipped."""
    select(key.device).store_kv(key, value, k_cache, v_cache, slot_mapping)


def _tree(tree_masks: Tensor | None, tree_starts: Tensor | None) -> tuple[Tensor, ...]:
    """The trailing tree arguments of a backend's attention call: none when there are no masks."""
    if tree_masks is None:
        return ()
    if tree_starts is None or tree_starts.shape != tree_masks.shape:
        raise ValueError("attention: tree_masks and tree_starts must both be given, one entry per row")
    return tree_masks, tree_starts


def paged_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, context_lens: Tensor,
                           scale: float, tree_masks: Tensor | None = None, tree_starts: Tensor | None = None) -> Tensor:
    """q [B, Hq, D]; seq b attends to positions 0..context_lens[b]-1 through block_tables [B, max_blocks].
    tree_masks int64 [B] / tree_starts int32 [B]: tree verification (hosted/layers/attention.py AttentionMetadata;
    reference.tree_allowed); -1 rows are plain."""
    return select(q.device).paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                                   *_tree(tree_masks, tree_starts))


def paged_prefill_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                            cu_seqlens_q: Tensor, context_lens: Tensor, scale: float,
                            tree_masks: Tensor | None = None, tree_starts: Tensor | None = None) -> Tensor:
    """Packed new tokens q [Tq, Hq, D] with causal attention over cached prefix + themselves; tree masks
    ([Tq] each) as paged_decode_attention's."""
    return select(q.device).paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                                    context_lens, scale, *_tree(tree_masks, tree_starts))


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """out = rmsnorm(x); with residual: (rmsnorm(x + residual), x + residual). Output in x.dtype."""
    return select(x.device).rms_norm(x, weight, eps, residual)


def rotary_cos_sin(head_dim: int, max_position: int, base: float, scaling: dict | None,
                   device: torch.device | str | None = None) -> torch.Tensor:
    """[max_position, head_dim] fp32 table: first half cos, second half sin (built once, on CPU)."""
    return reference.rotary_cos_sin(head_dim, max_position, base, scaling, device)


def apply_rotary(q: Tensor, k: Tensor, positions: Tensor, cos_sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] at positions [T] (HF rotate_half style); new tensors."""
    return select(q.device).apply_rotary(q, k, positions, cos_sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate then up) -> silu(gate) * up [T, I]: one pass on CPU (fp32), torch elsewhere."""
    return select(gate_up.device).silu_and_mul(gate_up)


def prepack_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> cpu_native.PackedLinear | None:
    """Prepare a dense projection once for linear(..., packed=) on CPU fp32: a copy of the weight in the
    native GEMM's panel layout (cpu_native.PackedLinear; 1.2-1.5x oneDNN's packed GEMM at 8-128 rows with
    the weights coming from DRAM, as in decode, and level with it at 512-2048 rows), or in oneDNN's blocked
    layout when the native kernels are unavailable (MKL re-packs the weight on every call). The copy costs
    as much memory as the weight. None where it does not apply (CUDA, other dtypes, other backends)."""
    return select(weight.device).prepack_linear(weight, bias)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None,
           packed: cpu_native.PackedLinear | None = None) -> Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) -> [M, N], a dense projection. On CPU (auto mode) with `packed`
    from prepack_linear(weight, bias): the native panel GEMM (or oneDNN). Without it: the GEMV
    for fp32 up to cpu_native.LINEAR_MAX_ROWS rows. Otherwise torch's matmul (cuBLAS / MKL)."""
    return select(x.device).linear(x, weight, bias, packed)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return reference.quantize_int8(w)


def quantize_int4(
    w: torch.Tensor, group_size: int, symmetric: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    return reference.quantize_int4(w, group_size, symmetric)


def int8_linear(x: Tensor, w_q: Tensor, scales: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [M, K] @ (w_q [N, K] * scales[:, None]).T (+ bias) -> [M, N] in x.dtype."""
    return select(x.device).int8_linear(x, w_q, scales, bias)


def int4_linear(x: Tensor, w_packed: Tensor, scales: Tensor, zeros: Tensor | None, group_size: int,
                bias: Tensor | None = None) -> Tensor:
    """x [M, K] @ dequant(w_packed [N, K//2]).T (+ bias) -> [M, N] in x.dtype."""
    return select(x.device).int4_linear(x, w_packed, scales, zeros, group_size, bias)
