"""The only kernel entry points the engine calls: one dispatch layer over Triton and the torch reference.

Dispatch (the variable is looked at per call, so tests can flip it):
  SWITCHYARD_KERNELS unset/"auto": CUDA tensors -> Triton (when triton imports); CPU tensors -> the
                                    compiled CPU kernels of kernels/cpu_native.py where they apply
                                    (decode attention; fp32 rotary, KV write, RMSNorm, SiLU-and-multiply, the
                                    prepacked panel GEMM and the few-row GEMV), else the plain-torch reference
                                    (vectorised; the rest of the engine's CPU path).
  SWITCHYARD_KERNELS=triton:        Triton always (on CPU this needs TRITON_INTERPRET=1 and is slow).
  SWITCHYARD_KERNELS=reference:     the reference always (SWITCHYARD_CPU_NATIVE=0 only turns the native
                                    CPU kernels off).

Layouts: see kernels/reference.py (KV cache [num_blocks, block_size, num_kv_heads, head_dim]).
"""

from __future__ import annotations

import os
from types import ModuleType

import torch
import torch.nn.functional as F

from kernels import cpu_native, reference

_MODES = ("auto", "triton", "reference")
_ENV_VAR = "SWITCHYARD_KERNELS"
# os.environ's own backing dict, looked up directly: ~30x cheaper than os.environ.get, which matters at
# ~300 kernel calls per decode step. monkeypatch.setenv and os.environ[...] = ... update it as well.
try:
    _ENV_DATA, _ENV_KEY = os.environ._data, os.environ.encodekey(_ENV_VAR)  # type: ignore[attr-defined]
except AttributeError:  # an os.environ without these internals: use the public API
    _ENV_DATA, _ENV_KEY = os.environ, _ENV_VAR
_parsed: list = [None, "auto"]  # [raw value, mode]: parsed again only when the value changes


def backend_mode() -> str:
    raw = _ENV_DATA.get(_ENV_KEY)
    if raw is None:
        return "auto"
    if raw == _parsed[0]:
        return _parsed[1]
    text = raw.decode() if isinstance(raw, bytes) else raw
    mode = text.strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(f"SWITCHYARD_KERNELS={mode!r} is not one of {', '.join(_MODES)}")
    _parsed[:] = [raw, mode]
    return mode


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


def _use_triton(t: torch.Tensor) -> bool:
    mode = backend_mode()
    if mode == "auto":
        return t.is_cuda and _triton_module() is not None
    if mode == "reference":
        return False
    if _triton_module() is None:  # mode == "triton"
        raise RuntimeError("SWITCHYARD_KERNELS=triton but triton is not importable")
    if not t.is_cuda and not _interpret_env():
        raise RuntimeError("SWITCHYARD_KERNELS=triton with CPU tensors needs TRITON_INTERPRET=1")
    return True


def _native_cpu(t: torch.Tensor) -> bool:
    """CPU tensor in auto mode: the compiled CPU kernels may take the call (they return None if not)."""
    return not t.is_cuda and backend_mode() == "auto"


def active_backend(t: torch.Tensor) -> str:
    """'triton' or 'reference': what a call with tensors on t's device would run (on CPU in auto mode the
    reference side includes the native kernels where they apply: see native_cpu_active)."""
    return "triton" if _use_triton(t) else "reference"


def native_cpu_active(t: torch.Tensor) -> bool:
    """Whether calls with tensors on t's device may use the compiled CPU kernels (kernels/cpu_native.py)."""
    return _native_cpu(t) and cpu_native.library() is not None


# --------------------------------------------------------------------------- KV cache


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """In place: k_cache/v_cache slot slot_mapping[t] <- key[t]/value[t]; slot < 0 is skipped."""
    if key.shape != value.shape or key.dim() != 3 or key.shape[0] != slot_mapping.shape[0]:
        raise ValueError(
            f"store_kv: key {tuple(key.shape)}, value {tuple(value.shape)}, "
            f"slot_mapping {tuple(slot_mapping.shape)} do not agree"
        )
    if _use_triton(key):
        _triton_module().store_kv(key, value, k_cache, v_cache, slot_mapping)
    elif not (_native_cpu(key) and cpu_native.store_kv(key, value, k_cache, v_cache, slot_mapping)):
        reference.store_kv(key, value, k_cache, v_cache, slot_mapping)


# --------------------------------------------------------------------------- attention


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


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, Hq, D]; seq b attends to positions 0..context_lens[b]-1 through block_tables [B, max_blocks]."""
    _check_attention(q, k_cache, v_cache)
    if _use_triton(q):
        return _triton_module().paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    if _native_cpu(q):
        out = cpu_native.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
        if out is not None:
            return out
    return reference.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Packed new tokens q [Tq, Hq, D] with causal attention over cached prefix + themselves."""
    _check_attention(q, k_cache, v_cache)
    if _use_triton(q):
        return _triton_module().paged_prefill_attention(
            q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale
        )
    return reference.paged_prefill_attention(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale
    )


# --------------------------------------------------------------------------- norm + rotary


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """out = rmsnorm(x); with residual: (rmsnorm(x + residual), x + residual). Output in x.dtype."""
    if _use_triton(x):
        return _triton_module().rms_norm(x, weight, eps, residual)
    if _native_cpu(x):
        out = cpu_native.rms_norm(x, weight, eps, residual)
        if out is not None:
            return out
    return reference.rms_norm(x, weight, eps, residual)


def rotary_cos_sin(
    head_dim: int,
    max_position: int,
    base: float,
    scaling: dict | None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """[max_position, head_dim] fp32 table: first half cos, second half sin (built once, on CPU)."""
    return reference.rotary_cos_sin(head_dim, max_position, base, scaling, device)


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] at positions [T] (HF rotate_half style); new tensors."""
    if _use_triton(q):
        return _triton_module().apply_rotary(q, k, positions, cos_sin)
    if _native_cpu(q):
        out = cpu_native.apply_rotary(q, k, positions, cos_sin)
        if out is not None:
            return out
    return reference.apply_rotary(q, k, positions, cos_sin)


# --------------------------------------------------------------------------- activation


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate then up) -> silu(gate) * up [T, I]: one pass on CPU (fp32), torch elsewhere."""
    if _native_cpu(gate_up):
        out = cpu_native.silu_and_mul(gate_up)
        if out is not None:
            return out
    return reference.silu_and_mul(gate_up)


# --------------------------------------------------------------------------- linear


def prepack_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> cpu_native.PackedLinear | None:
    """Prepare a dense projection once for ops.linear(..., packed=) on CPU fp32: a copy of the weight in the
    native GEMM's panel layout (cpu_native.PackedLinear; 1.2-1.5x oneDNN's packed GEMM at 8-128 rows with
    the weights coming from DRAM, as in decode, and level with it at 512-2048 rows), or in oneDNN's blocked
    layout when the native kernels are unavailable (MKL re-packs the weight on every call). The copy costs
    as much memory as the weight. None where it does not apply (CUDA, other dtypes)."""
    if weight.is_cuda or backend_mode() != "auto":
        return None
    return cpu_native.pack_linear(weight, bias)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: cpu_native.PackedLinear | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) -> [M, N], a dense projection. On CPU (auto mode) with `packed`
    from prepack_linear(weight, bias): the native panel GEMM (or oneDNN). Without it: the GEMV
    for fp32 up to cpu_native.LINEAR_MAX_ROWS rows. Otherwise torch's matmul (cuBLAS / MKL)."""
    if _native_cpu(x):
        if packed is not None:
            return packed(x)
        out = cpu_native.linear(x, weight, bias)
        if out is not None:
            return out
    return F.linear(x, weight, bias)


# --------------------------------------------------------------------------- quantized linear


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return reference.quantize_int8(w)


def quantize_int4(
    w: torch.Tensor, group_size: int, symmetric: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    return reference.quantize_int4(w, group_size, symmetric)


def int8_linear(
    x: torch.Tensor,
    w_q: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ (w_q [N, K] * scales[:, None]).T (+ bias) -> [M, N] in x.dtype."""
    if _use_triton(x):
        return _triton_module().int8_linear(x, w_q, scales, bias)
    # (torch's aten._weight_int8pack_mm was measured 2-20x slower than the reference on this CPU.)
    return reference.int8_linear(x, w_q, scales, bias)


def int4_linear(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ dequant(w_packed [N, K//2]).T (+ bias) -> [M, N] in x.dtype."""
    if _use_triton(x):
        return _triton_module().int4_linear(x, w_packed, scales, zeros, group_size, bias)
    return reference.int4_linear(x, w_packed, scales, zeros, group_size, bias)
