"""Compiled CPU kernels for the engine's memory-bound hot paths (the CPU counterpart of the Triton kernels).

`cpu_native.c` holds kernels that torch's CPU ops do poorly on this kind of machine:
  * paged decode attention: each cached K/V row is read once, straight from its block (the torch path
    gathers the rows into a buffer first and multiplies tiny matrices with MKL);
  * y = x W^T for a few rows of x (batch-1 decode): MKL's GEMV reads several weight rows at once and
    reaches about half the memory bandwidth a single sequential stream gets;
  * y = x W^T from a prepacked panel copy of W (PackedLinear): at decode batch sizes the weights stream
    from DRAM every step, and this GEMM prefetches the next panel while computing one (oneDNN's and MKL's
    did not overlap the two);
  * rotary embedding, KV-cache write and RMSNorm + residual, fused where torch needs several ops.
The source is compiled with the system C compiler (`$CC`, else cc/gcc/clang) at first use and cached
under `$SWITCHYARD_CACHE_DIR` (default `$XDG_CACHE_HOME/switchyard` or `~/.cache/switchyard`), keyed by the
source, the compiler and the CPU, so a shared home across machines never loads a build for another CPU.
If anything fails (no compiler, old compiler, unsupported shape) the callers fall back to the torch
reference; the `cpu_native` switch (kernels/switches.py; SWITCHYARD_CPU_NATIVE=0) turns the native path off.
kernels.ops decides when to call it.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels import native_interface, switches

log = logging.getLogger(__name__)

# cpu_lowp.c: the bf16 / int8 / int4 projections (kernels/cpu_lowp.py wraps them); cpu_decode.c: a whole decode
# step's layers in one call over these kernels (kernels/cpu_decode.py); cpu_team.c: that step's barriers.
# cpu_amx_attention.c: bf16 prefill attention on AMX tiles. Headers are hashed with the sources, not compiled alone.
# cpu_bf16_rows.c: the bf16 RMSNorm / rotary / SiLU-and-multiply of the per-op forward. cpu_abi.c: the layout the
# build compiled (sizes, offsets, constants), for tests. switchyard_kernels.h: what they all share (prototypes,
# structs, constants), read by kernels/native_interface.py for the ctypes signatures.
SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu_native.c", "cpu_lowp.c", "cpu_amx.c", "cpu_amx_attention.c",
                                                            "cpu_bf16_rows.c", "cpu_decode.c", "cpu_team.c", "cpu_abi.c"))
HEADERS = tuple(Path(__file__).with_name(name) for name in ("switchyard_kernels.h", "cpu_exp.h", "cpu_bf16.h"))
# Small-M linear: above this many rows MKL's GEMM wins (measured on the SmolLM-135M shapes).
LINEAR_MAX_ROWS = 4
_FLAGS = ["-O3", "-shared", "-fPIC", "-std=gnu11"]


def _variants() -> tuple[list[str], ...]:
    """Tried in order: OpenMP shares torch's threads; -march=native enables AVX-512 or AVX2 (the vector code
    also builds without it, slower); a compiler lacking one of them still gets a working library.
    The `cpu_march` switch (SWITCHYARD_CPU_MARCH) names another target (x86-64-v3: the AVX2 kernels on a machine
    with AVX-512, for a fleet of mixed machines sharing one cache, or to test them)."""
    march = f"-march={switches.current().cpu_march.strip() or 'native'}"
    vendor = ["-DSY_PREFETCH_INTEL"] if _cpu_vendor() == "GenuineIntel" else []  # prefetch hints (cpu_lowp.c)
    return ([march, "-fopenmp", *vendor], [march, *vendor], ["-fopenmp", *vendor], vendor)


def _cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD), '' where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""

_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib": CDLL | None once resolved, "why": reason when None


def enabled() -> bool:
    return switches.current().cpu_native


def amx_enabled() -> bool:
    """The cpu_amx switch off (SWITCHYARD_CPU_AMX=0) keeps the bf16 projections off AMX tiles (cpu_amx.c) where
    the CPU has them."""
    return switches.current().cpu_amx


def reset() -> None:
    """Forget the resolved library (resolved again on next use)."""
    with _lock:
        _state.clear()


def _on_switches(before: switches.Switches, after: switches.Switches) -> None:
    """A change of the switches the library depends on: resolve it again (built for the new target, or none)."""
    if (before.cpu_native, before.cpu_amx, before.cpu_march) != (after.cpu_native, after.cpu_amx, after.cpu_march):
        reset()


switches.on_change(_on_switches)


def library() -> ctypes.CDLL | None:
    """The loaded kernels, building them on first use; None when disabled or unavailable."""
    lib = _state.get("lib", False)
    if lib is not False:
        return lib  # type: ignore[return-value]
    with _lock:
        if "lib" not in _state:
            _state["lib"], _state["why"] = _resolve()
            if _state["lib"] is None and enabled():
                log.warning("native CPU kernels unavailable (%s); using the torch reference", _state["why"])
    return _state["lib"]  # type: ignore[return-value]


def unavailable_reason() -> str | None:
    library()
    return None if _state.get("lib") is not None else str(_state.get("why"))


def _resolve() -> tuple[ctypes.CDLL | None, str]:
    if not enabled():
        return None, "SWITCHYARD_CPU_NATIVE=0 (the cpu_native switch is off)"
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not compiler:
        return None, "no C compiler found (set CC)"
    try:
        version = subprocess.run([compiler, "--version"], check=False, capture_output=True, text=True, timeout=30).stdout
        source = b"\0".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"{compiler}: {exc}"
    errors = []
    for extra in _variants():
        flags = _FLAGS + extra
        key = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), version.encode(),
                                         _cpu_identity().encode()])).hexdigest()[:20]
        path = _cache_dir() / f"cpu_native-{key}.so"
        try:
            if not path.is_file():
                _compile(compiler, flags, path)
            lib = ctypes.CDLL(str(path))
        except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
            errors.append(str(exc).strip().splitlines()[-1] if str(exc).strip() else repr(exc))
            continue
        try:
            native_interface.declare(lib)
        except (RuntimeError, ValueError) as exc:  # a header the build does not match, or outside its format
            return None, str(exc)
        lib.sy_amx_enable(int(amx_enabled()))
        log.info("native CPU kernels: %s (%s)", path, " ".join(flags))
        return lib, ""
    return None, "; ".join(errors)


def _compile(compiler: str, flags: list[str], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, "-o", tmp, *map(str, SOURCES), "-lm"], check=False, capture_output=True,
                              text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} {' '.join(flags)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, path)  # atomic: concurrent builders never see a half-written library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _cache_dir() -> Path:
    explicit = os.environ.get("SWITCHYARD_CACHE_DIR")
    base = Path(explicit) if explicit else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "switchyard"
    path = base / "kernels"
    try:
        path.mkdir(parents=True, exist_ok=True)
        if os.access(path, os.W_OK):
            return path
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"switchyard-kernels-{os.getuid()}"


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    wanted = ("model name", "flags", "Features", "CPU part")
    lines = {ln.split(":", 1)[0].strip(): ln for ln in text.splitlines() if ln.split(":", 1)[0].strip() in wanted}
    return platform.machine() + "\n" + "\n".join(sorted(lines.values()))


# --------------------------------------------------------------------------- wrappers
# Each returns None (or False) when it cannot take the call, and the caller (kernels.ops) uses the torch
# reference instead. They are on the per-layer path of every decode step, so checks are kept to what
# memory safety needs; the C side re-checks indices against the pool.

# switchyard_kernels.h's SY_MAX_Q_HEADS, SY_MAX_HEAD_DIM, SY_MAX_BLOCK_ROW (tests compare them with the build's)
MAX_Q_HEADS, MAX_HEAD_DIM, MAX_BLOCK_ROW = 128, 256, 16384
_F32, _BF16, _I32, _I64 = torch.float32, torch.bfloat16, torch.int32, torch.int64


class _PerThread(threading.local):
    def __init__(self) -> None:
        # scratch kept between calls, by use ("scores": attention scores, "vt": AMX prefill attention's V^T):
        # (tensor, whether made in inference mode)
        self.buffers: dict[str, tuple[torch.Tensor, bool]] = {}
        self.lens: torch.Tensor | None = None  # context_lens of the last call and its max (a step's layers share it)
        self.max_len = 0


_local = _PerThread()


def _thread_buffer(use: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """This thread's scratch for `use`, at least numel elements, kept between calls (every layer of a step needs
    it; a tensor made outside inference mode is not reused inside it, nor the other way round)."""
    inference = torch.is_inference_mode_enabled()
    held = _local.buffers.get(use)
    if held is None or held[0].numel() < numel or held[1] != inference:
        held = _local.buffers[use] = (torch.empty(max(numel, 1 << 16), dtype=dtype), inference)
    return held[0]


def _scores_buffer(numel: int) -> torch.Tensor:
    return _thread_buffer("scores", numel, _F32)


def _attention_fits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, converted_heads: int) -> bool:
    """Whether the native attention kernels take these tensors: CPU, no autograd, fp32/bf16 caches of one layout,
    head_dim a multiple of 16 within the kernels' limits (`converted_heads`: the KV heads of a bf16 block the
    kernel converts at once)."""
    head_dim, num_q_heads, block_size = q.shape[-1], q.shape[1], k_cache.shape[1]
    dtype = k_cache.dtype
    return (not q.requires_grad and q.device.type == "cpu" and k_cache.device.type == "cpu"
            and dtype in (_F32, _BF16) and v_cache.dtype == dtype and k_cache.stride() == v_cache.stride()
            and k_cache.stride(3) == 1 and head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM
            and num_q_heads <= MAX_Q_HEADS
            and (dtype != _BF16 or block_size * converted_heads * head_dim <= MAX_BLOCK_ROW))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    tree_masks: torch.Tensor | None = None,
    tree_starts: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """As kernels.ops.paged_decode_attention (fp32 or bf16 caches, head_dim a multiple of 16), or None.
    Raises ValueError for a block table entry outside the pool or a table too narrow for a length."""
    lib = library()
    if lib is None or not _attention_fits(q, k_cache, v_cache, converted_heads=k_cache.shape[2]):
        return None
    batch, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    cache_dtype = k_cache.dtype
    out = torch.empty(batch, num_q_heads, head_dim, dtype=_F32)
    if batch == 0:
        return out.to(q.dtype)
    qf = q if q.dtype == _F32 and q.stride(2) == 1 else q.float().contiguous()
    lens = context_lens if context_lens.dtype == _I32 and context_lens.is_contiguous() else \
        context_lens.to(_I32).contiguous()
    tables = block_tables if block_tables.dtype == _I32 and block_tables.is_contiguous() else \
        block_tables.to(_I32).contiguous()
    masks, starts = _tree_pointers(tree_masks, tree_starts, batch)
    st = _local
    if context_lens is not st.lens:  # a new step (the C side checks every length against the sizes used)
        st.lens, st.max_len = context_lens, max(int(lens.max()), 1)
    threads = max(1, torch.get_num_threads())
    for attempt in range(2):
        per_thread = num_q_heads * ((st.max_len + 15) // 16 * 16)
        scores = _scores_buffer(threads * per_thread)
        rc = lib.sy_decode_attention(
            qf.data_ptr(), qf.stride(0), qf.stride(1), scale, k_cache.data_ptr(), v_cache.data_ptr(),
            int(cache_dtype == _BF16), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), num_blocks,
            block_size, tables.data_ptr(), tables.stride(0), tables.shape[1], lens.data_ptr(), masks.pointer,
            starts.pointer, batch, num_q_heads, num_kv_heads, head_dim, out.data_ptr(), scores.data_ptr(), per_thread,
            threads)
        if rc != 3 or attempt:
            break
        st.max_len = max(int(lens.max()), 1)  # lengths changed in place since they were cached: re-read
    if rc == 1:
        raise ValueError(f"paged_decode_attention: a block table entry is outside the pool of {num_blocks} blocks")
    if rc == 3:
        raise ValueError(f"paged_decode_attention: context length {int(lens.max())} needs more blocks than "
                         f"the {tables.shape[1]} columns of block_tables")
    if rc != 0:
        return None
    return out if q.dtype == _F32 else out.to(q.dtype)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                            scale: float, tree_masks: torch.Tensor | None = None,
                            tree_starts: torch.Tensor | None = None) -> torch.Tensor | None:
    """As kernels.ops.paged_prefill_attention (fp32 or bf16 caches, head_dim a multiple of 16), or None.
    Raises ValueError for a block table entry outside the pool, a table too narrow for a length, or more new
    tokens than a sequence's length."""
    lib = library()
    if (lib is None or not _attention_fits(q, k_cache, v_cache, converted_heads=1)
            or cu_seqlens_q.shape[0] != context_lens.shape[0] + 1):
        return None
    tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    cache_dtype = k_cache.dtype
    seqs = context_lens.shape[0]
    if tokens == 0 or seqs == 0:
        return torch.empty(tokens, num_q_heads, head_dim, dtype=q.dtype)
    lens = context_lens.to(_I32).contiguous()
    cu = cu_seqlens_q.to(_I32).contiguous()
    tables = block_tables.to(_I32).contiguous()
    if int(cu[-1]) - int(cu[0]) != tokens:
        raise ValueError(f"paged_prefill_attention: cu_seqlens_q spans {int(cu[-1]) - int(cu[0])} tokens, q has {tokens}")
    threads = max(1, torch.get_num_threads())
    masks, starts = _tree_pointers(tree_masks, tree_starts, tokens)
    # Tree masks take the fp32-math kernel below, not the AMX tiles (which have no masks): a verify chunk is a few
    # dozen rows, where the tiles' gain is small.
    if q.dtype == _BF16 and cache_dtype == _BF16 and masks.pointer is None:  # before any fp32 copy of q
        amx = _amx_prefill_attention(lib, q, k_cache, v_cache, tables, cu, lens, scale, threads)
        if amx is not None:
            return amx
    out = torch.empty(tokens, num_q_heads, head_dim, dtype=_F32)
    qf = q if q.dtype == _F32 and q.stride(2) == 1 else q.float().contiguous()
    per_thread = num_q_heads * ((max(int(lens.max()), 1) + 15) // 16 * 16)
    scores = _scores_buffer(threads * per_thread)
    rc = lib.sy_prefill_attention(
        qf.data_ptr(), qf.stride(0), qf.stride(1), scale, k_cache.data_ptr(), v_cache.data_ptr(),
        int(cache_dtype == _BF16), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), num_blocks, block_size,
        tables.data_ptr(), tables.stride(0), tables.shape[1], cu.data_ptr(), lens.data_ptr(), masks.pointer,
        starts.pointer, seqs, num_q_heads, num_kv_heads, head_dim, out.data_ptr(), scores.data_ptr(), per_thread,
        threads)
    _raise_prefill_error(rc, num_blocks, tables.shape[1])
    if rc != 0:
        return None
    return out if q.dtype == _F32 else out.to(q.dtype)


class _Pointer:
    """A tensor kept alive for as long as the address the kernel reads is used (None: NULL)."""

    __slots__ = ("pointer", "tensor")

    def __init__(self, tensor: torch.Tensor | None) -> None:
        self.tensor = tensor
        self.pointer = None if tensor is None else tensor.data_ptr()


_NO_TREE = (_Pointer(None), _Pointer(None))


def _tree_pointers(tree_masks: torch.Tensor | None, tree_starts: torch.Tensor | None,
                   rows: int) -> tuple[_Pointer, _Pointer]:
    """The kernels' tree_masks (int64) / tree_starts (int32) arguments: NULL for none."""
    if tree_masks is None:
        return _NO_TREE
    if tree_starts is None or tree_masks.shape != (rows,) or tree_starts.shape != (rows,):
        raise ValueError(f"attention: tree_masks / tree_starts must hold one entry per row ({rows})")
    masks = tree_masks if tree_masks.dtype == _I64 and tree_masks.is_contiguous() else \
        tree_masks.to(_I64).contiguous()
    starts = tree_starts if tree_starts.dtype == _I32 and tree_starts.is_contiguous() else \
        tree_starts.to(_I32).contiguous()
    return _Pointer(masks), _Pointer(starts)


def _raise_prefill_error(rc: int, num_blocks: int, table_width: int) -> None:
    """The prefill attention kernels' bad-input codes as errors (1: a block id, 3: a length); others pass."""
    if rc == 1:
        raise ValueError(f"paged_prefill_attention: a block table entry is outside the pool of {num_blocks} blocks")
    if rc == 3:
        raise ValueError("paged_prefill_attention: a sequence has more new tokens than its length, or needs more "
                         f"blocks than the {table_width} columns of block_tables")


# V^T scratch of one AMX prefill-attention call: a batch's sequences go through the kernel in groups whose V^T fits
# in this many bytes (a longer sequence alone), so long cached prefixes never make one call allocate gigabytes.
AMX_PREFILL_SCRATCH_BYTES = 64 << 20
AMX_KEY_CHUNK = 64  # SY_AMX_KEY_CHUNK: the kernel's V^T holds each sequence's positions rounded up to it


def _amx_prefill_attention(lib: ctypes.CDLL, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           tables: torch.Tensor, cu: torch.Tensor, lens: torch.Tensor, scale: float,
                           threads: int) -> torch.Tensor | None:
    """bf16 q over a bf16 cache on AMX tiles (cpu_amx_attention.c): bf16 out, or None where the tiles are not
    there (the CPU, the OS, SWITCHYARD_CPU_AMX=0) or the shape does not fit them (head_dim % 32, block_size % 16)."""
    if q.stride(2) != 1 or q.stride(1) % 2 or q.stride(0) % 2:  # the kernel reads q's d pairs as 32-bit words
        q = q.contiguous()
    tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty(tokens, num_q_heads, head_dim, dtype=_BF16)
    lens_list, cu_list = lens.tolist(), cu.tolist()
    # V^T per (sequence, kv head), each sequence's positions rounded up to the kernel's key chunks
    vt_values = [(n + AMX_KEY_CHUNK) * num_kv_heads * head_dim for n in lens_list]
    vt_offsets = torch.empty(len(lens_list), dtype=torch.int64)
    start = 0
    while start < len(lens_list):
        end, values = start + 1, vt_values[start]
        while end < len(lens_list) and (values + vt_values[end]) * 2 <= AMX_PREFILL_SCRATCH_BYTES:
            values += vt_values[end]
            end += 1
        vt = _thread_buffer("vt", values, _BF16)
        row = cu_list[start] - cu_list[0]  # the kernel numbers q and out rows from its first sequence's
        rc = lib.sy_amx_prefill_attention_bf16(
            q.data_ptr() + row * q.stride(0) * 2, q.stride(0), q.stride(1), scale, k_cache.data_ptr(),
            v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), num_blocks, block_size,
            tables.data_ptr() + start * tables.stride(0) * 4, tables.stride(0), tables.shape[1],
            cu.data_ptr() + start * 4, lens.data_ptr() + start * 4, end - start, num_q_heads, num_kv_heads, head_dim,
            out.data_ptr() + row * num_q_heads * head_dim * 2, vt.data_ptr(), values, vt_offsets.data_ptr(), threads)
        _raise_prefill_error(rc, num_blocks, tables.shape[1])
        if rc != 0:
            return None  # no tiles (decided before anything is written, the same for every group)
        start = end
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [M, K] @ weight[N, K]^T (+ bias) in fp32 for M <= LINEAR_MAX_ROWS; None when not applicable."""
    if (x.dim() != 2 or x.shape[0] > LINEAR_MAX_ROWS or x.shape[0] == 0 or x.dtype != _F32
            or weight.dtype != _F32 or x.device.type != "cpu" or weight.device.type != "cpu"
            or x.stride(1) != 1 or weight.stride(1) != 1 or weight.dim() != 2 or weight.shape[1] != x.shape[1]
            or (bias is not None and (bias.dtype != _F32 or not bias.is_contiguous()
                                      or bias.shape != (weight.shape[0],)))
            or x.requires_grad or weight.requires_grad):
        return None
    lib = library()
    if lib is None:
        return None
    rows, n = x.shape[0], weight.shape[0]
    y = torch.empty(rows, n, dtype=_F32)
    lib.sy_linear_f32(x.data_ptr(), x.stride(0), weight.data_ptr(), weight.stride(0),
                      bias.data_ptr() if bias is not None else None, y.data_ptr(), y.stride(0), rows, n,
                      x.shape[1], max(1, torch.get_num_threads()))
    return y


PANEL_N = 48  # output features per panel of sy_pack_panels_f32 (SY_PANEL_N)
# Where the panel GEMM is the AVX2 build (16 registers: passes of 4 rows x 24 columns over each panel), torch's
# own GEMM (oneDNN / MKL, with a row-major weight) ran 1.19-1.41x faster from 256 rows up on the SmolLM2 layer
# shapes (Zen 3, paired: prefill is ~75% GEMM there), while below ~128 rows the panels won (1.2x at 64). The
# AVX-512 tile keeps every row count.
AVX2_TORCH_MIN_ROWS = 256


class PackedLinear:
    """A CPU fp32 projection prepared once (kernels.ops.prepack_linear): the weight copied into the native
    GEMM's panel layout (without the native library: oneDNN's blocked layout, as MKL re-packs the weight on
    every call), with the checks done up front so the per-call path is short. Holds references to weight
    and bias: it stays valid while their storage does (do not replace them in place after packing)."""

    __slots__ = ("_b", "_gemm", "_p", "_panel_rows_below", "bias", "k", "n", "onednn", "panels", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, lib: ctypes.CDLL | None) -> None:
        self.weight, self.bias = weight, bias
        self.n, self.k = weight.shape
        self.panels: torch.Tensor | None = None
        self.onednn: torch.Tensor | None = None
        if lib is not None:
            self.panels = torch.empty(-(-self.n // PANEL_N) * self.k * PANEL_N, dtype=_F32)
            lib.sy_pack_panels_f32(weight.data_ptr(), weight.stride(0), self.n, self.k, self.panels.data_ptr())
        else:
            self.onednn = _onednn_weight(weight)
        # From one row up: at batch 1 the panels streamed as fast as the row-major GEMV (engine decode steps
        # within noise of each other), above it they are faster.
        self._gemm = lib.sy_gemm_panels_f32 if lib is not None else None
        self._p = self.panels.data_ptr() if self.panels is not None else None
        # the panels take inputs of fewer rows than this; torch's GEMM on the row-major weight the rest
        self._panel_rows_below = (AVX2_TORCH_MIN_ROWS if lib is not None and lib.sy_panel_vector_bits() == 256
                                  else sys.maxsize)
        self._b = bias.data_ptr() if bias is not None else None

    @property
    def extra_bytes(self) -> int:
        """Memory the packed copy adds beside the weight."""
        copy = self.panels if self.panels is not None else self.onednn
        return 0 if copy is None else copy.numel() * copy.element_size()

    def owned_tensors(self) -> list[torch.Tensor]:
        return [self.panels] if self.panels is not None else []  # (oneDNN's blocked tensor is opaque)

    def rebind(self, take) -> None:
        """Point at a copy of the panels (kernels.huge_pages.move_to_huge_pages)."""
        if self.panels is not None:
            self.panels = take(self.panels)
            self._p = self.panels.data_ptr()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == _F32 and x.dim() == 2 and not x.requires_grad:
            rows, k = x.shape
            if k == self.k and rows > 0:
                if self._gemm is not None and rows < self._panel_rows_below:
                    return self.panel_gemm(x)
                if self.onednn is not None:
                    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.onednn, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def panel_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, k] fp32 @ W^T (+ bias) on the panels, whatever the row count (needs the native library)."""
        if x.stride(1) != 1:
            x = x.contiguous()
        rows = x.shape[0]
        y = torch.empty(rows, self.n, dtype=_F32)
        self._gemm(x.data_ptr(), x.stride(0), self._p, self._b, y.data_ptr(), self.n, rows, self.n, self.k,
                   torch.get_num_threads())
        return y


def _onednn_weight(weight: torch.Tensor) -> torch.Tensor | None:
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    except (RuntimeError, AttributeError):  # an op this torch build lacks
        return None


def pack_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedLinear | None:
    """PackedLinear for a CPU fp32 weight [N, K] (row-major) and optional bias [N]; None if not applicable."""
    if (weight.device.type != "cpu" or weight.dtype != _F32 or weight.dim() != 2 or weight.stride(1) != 1
            or weight.requires_grad
            or (bias is not None and (bias.dtype != _F32 or not bias.is_contiguous()
                                      or bias.shape != (weight.shape[0],)))):
        return None
    packed = PackedLinear(weight, bias, library())
    return packed if packed.panels is not None or packed.onednn is not None else None


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """As kernels.ops.apply_rotary for fp32 or bf16 q and k on CPU (new contiguous tensors), or None."""
    lib = library()
    dtype = q.dtype
    if (lib is None or dtype not in (_F32, _BF16) or k.dtype != dtype or cos_sin.dtype != _F32
            or positions.dtype != _I64
            or q.device.type != "cpu" or k.device.type != "cpu" or cos_sin.device.type != "cpu"
            or q.dim() != 3 or k.dim() != 3 or q.stride(2) != 1 or k.stride(2) != 1 or not cos_sin.is_contiguous()
            or not positions.is_contiguous() or q.requires_grad or k.requires_grad):
        return None
    tokens, num_q_heads, head_dim = q.shape
    if (k.shape[0] != tokens or k.shape[2] != head_dim or head_dim % 2 or cos_sin.dim() != 2
            or cos_sin.shape[1] != head_dim or positions.shape != (tokens,)):
        return None
    q_out = torch.empty(q.shape, dtype=dtype)
    k_out = torch.empty(k.shape, dtype=dtype)
    rotary = lib.sy_rotary_f32 if dtype == _F32 else lib.sy_rotary_bf16
    rc = rotary(q.data_ptr(), q.stride(0), q.stride(1), num_q_heads, k.data_ptr(), k.stride(0),
                           k.stride(1), k.shape[1], tokens, head_dim, positions.data_ptr(), cos_sin.data_ptr(),
                           cos_sin.shape[0], q_out.data_ptr(), k_out.data_ptr())
    if rc:
        raise IndexError(f"apply_rotary: a position is outside the rotary table of {cos_sin.shape[0]} positions")
    return q_out, k_out


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> bool:
    """As kernels.ops.store_kv for fp32 on CPU; False (nothing done) when not applicable."""
    lib = library()
    if (lib is None or key.dtype != _F32 or value.dtype != _F32 or k_cache.dtype != _F32 or v_cache.dtype != _F32
            or slot_mapping.dtype != _I64 or not slot_mapping.is_contiguous() or key.device.type != "cpu"
            or value.device.type != "cpu" or k_cache.device.type != "cpu" or v_cache.device.type != "cpu"
            or key.stride(2) != 1 or value.stride(2) != 1
            or k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1 or k_cache.dim() != 4
            or key.shape[1:] != k_cache.shape[2:] or key.shape != value.shape
            or slot_mapping.shape != (key.shape[0],)):
        return False
    num_blocks, block_size, heads, head_dim = k_cache.shape
    rc = lib.sy_store_kv_f32(key.data_ptr(), value.data_ptr(), key.stride(0), key.stride(1), value.stride(0),
                             value.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
                             k_cache.stride(1), k_cache.stride(2), num_blocks * block_size, block_size,
                             slot_mapping.data_ptr(), key.shape[0], heads, head_dim)
    if rc:
        raise IndexError(f"store_kv: a slot is beyond the cache's {num_blocks * block_size} slots")
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """As kernels.ops.rms_norm for fp32 or bf16 (x, residual and weight alike) on CPU: out, or (out, x + residual);
    None when not applicable. Within ~1 ulp of the reference (the mean's summation order differs; bf16 rounds
    where the reference does)."""
    lib = library()
    dtype = x.dtype
    if (lib is None or dtype not in (_F32, _BF16) or weight.dtype != dtype or x.dim() != 2 or x.device.type != "cpu"
            or x.stride(1) != 1 or not weight.is_contiguous() or weight.shape != (x.shape[1],)
            or x.requires_grad or weight.requires_grad
            or (residual is not None and (residual.dtype != dtype or residual.shape != x.shape
                                          or residual.stride(1) != 1 or residual.requires_grad))):
        return None
    tokens, hidden = x.shape
    out = torch.empty(tokens, hidden, dtype=dtype)
    new_res = torch.empty(tokens, hidden, dtype=dtype) if residual is not None else None
    args = (x.data_ptr(), x.stride(0), residual.data_ptr() if residual is not None else None,
            residual.stride(0) if residual is not None else 0, weight.data_ptr(), out.data_ptr(),
            new_res.data_ptr() if new_res is not None else None, tokens, hidden, eps)
    if dtype == _F32:
        lib.sy_rms_norm_f32(*args)
    else:
        lib.sy_rms_norm_bf16(*args, max(1, torch.get_num_threads()))
    return out if residual is None else (out, new_res)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """As kernels.ops.silu_and_mul for fp32 or bf16 on CPU, or None. Within a few ulp of the reference (bf16:
    rounded where the reference rounds)."""
    lib = library()
    dtype = gate_up.dtype
    if (lib is None or dtype not in (_F32, _BF16) or gate_up.dim() != 2 or gate_up.device.type != "cpu"
            or gate_up.stride(1) != 1 or gate_up.shape[1] % 2 or gate_up.requires_grad):
        return None
    tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(tokens, inter, dtype=dtype)
    silu_mul = lib.sy_silu_mul_f32 if dtype == _F32 else lib.sy_silu_mul_bf16
    silu_mul(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), tokens, inter,
                        max(1, torch.get_num_threads()))
    return out
