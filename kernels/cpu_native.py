"""Compiled CPU kernels for the engine's memory-bound hot paths (the CPU counterpart of the Triton kernels).

`cpu_native.c` holds two kernels that torch's CPU ops do poorly on this kind of machine:
  * paged decode attention: each cached K/V row is read once, straight from its block (the torch path
    gathers the rows into a buffer first and multiplies tiny matrices with MKL);
  * y = x W^T for a few rows of x (batch-1 decode): MKL's GEMV reads several weight rows at once and
    reaches about half the memory bandwidth a single sequential stream gets.
The source is compiled with the system C compiler (`$CC`, else cc/gcc/clang) at first use and cached
under `$SWITCHYARD_CACHE_DIR` (default `$XDG_CACHE_HOME/switchyard` or `~/.cache/switchyard`), keyed by the
source, the compiler and the CPU, so a shared home across machines never loads a build for another CPU.
If anything fails (no compiler, old compiler, unsupported shape) the callers fall back to the torch
reference; `SWITCHYARD_CPU_NATIVE=0` turns the native path off. kernels.ops decides when to call it.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_native.c")
# Small-M linear: above this many rows MKL's GEMM wins (measured on the SmolLM-135M shapes).
LINEAR_MAX_ROWS = 4
_FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=gnu11"]

_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib": CDLL | None once resolved, "why": reason when None


def enabled() -> bool:
    return os.environ.get("SWITCHYARD_CPU_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


def reset() -> None:
    """Forget the resolved library (tests flip SWITCHYARD_CPU_NATIVE and re-resolve)."""
    with _lock:
        _state.clear()


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
        return None, "SWITCHYARD_CPU_NATIVE=0"
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not compiler:
        return None, "no C compiler found (set CC)"
    try:
        version = subprocess.run([compiler, "--version"], check=False, capture_output=True, text=True, timeout=30).stdout
        source = SOURCE.read_bytes()
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"{compiler}: {exc}"
    errors = []
    # With OpenMP first (threads shared with torch's libgomp); without it the kernels run on one thread.
    for extra in (["-fopenmp"], []):
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
        _declare(lib)
        log.info("native CPU kernels: %s (%s)", path, " ".join(flags))
        return lib, ""
    return None, "; ".join(errors)


def _compile(compiler: str, flags: list[str], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, "-o", tmp, str(SOURCE), "-lm"], check=False, capture_output=True,
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


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.sy_decode_attention.argtypes = [p, p, p, i32, i64, i64, i64, i64, i32, p, i64, p, i32, i32, i32, i32, p,
                                        p, i64, i32]
    lib.sy_decode_attention.restype = i32
    lib.sy_linear_f32.argtypes = [p, i64, p, i64, p, p, i64, i32, i64, i64, i32]
    lib.sy_linear_f32.restype = None


# --------------------------------------------------------------------------- wrappers

_MAX_Q_HEADS, _MAX_HEAD_DIM, _MAX_BLOCK_ROW = 128, 256, 16384  # as in cpu_native.c


class _Scratch(threading.local):
    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.inference: bool = False


_scratch = _Scratch()


def _scores_buffer(numel: int) -> torch.Tensor:
    inference = torch.is_inference_mode_enabled()
    s = _scratch
    if s.buf is None or s.buf.numel() < numel or s.inference != inference:
        s.buf, s.inference = torch.empty(numel, dtype=torch.float32), inference
    return s.buf


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor | None:
    """As kernels.ops.paged_decode_attention, or None when this path cannot take the call (the caller
    then uses the reference). Raises ValueError for a block table entry outside the pool."""
    lib = library()
    if lib is None or q.device.type != "cpu" or k_cache.device.type != "cpu" or q.requires_grad:
        return None
    batch, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if (k_cache.dtype not in (torch.float32, torch.bfloat16) or v_cache.dtype != k_cache.dtype
            or k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1
            or head_dim % 16 or head_dim > _MAX_HEAD_DIM or num_q_heads > _MAX_Q_HEADS
            or (k_cache.dtype == torch.bfloat16 and block_size * num_kv_heads * head_dim > _MAX_BLOCK_ROW)):
        return None
    out = torch.empty(batch, num_q_heads, head_dim, dtype=torch.float32)
    if batch == 0:
        return out.to(q.dtype)
    lens = context_lens.to(torch.int32).contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    max_len = int(lens.max())
    if max_len > tables.shape[1] * block_size:
        raise ValueError(f"paged_decode_attention: context length {max_len} needs more blocks than the "
                         f"{tables.shape[1]} columns of block_tables")
    qs = (q.float() * scale).contiguous()
    threads = max(1, torch.get_num_threads())
    per_thread = num_q_heads * ((max_len + 15) // 16 * 16)
    scores = _scores_buffer(threads * per_thread)
    rc = lib.sy_decode_attention(
        qs.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), int(k_cache.dtype == torch.bfloat16),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), num_blocks, block_size, tables.data_ptr(),
        tables.stride(0), lens.data_ptr(), batch, num_q_heads, num_kv_heads, head_dim, out.data_ptr(),
        scores.data_ptr(), per_thread, threads)
    if rc == 1:
        raise ValueError(f"paged_decode_attention: a block table entry is outside the pool of {num_blocks} blocks")
    if rc != 0:
        return None
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [M, K] @ weight[N, K]^T (+ bias) in fp32 for M <= LINEAR_MAX_ROWS; None when not applicable."""
    if (x.dim() != 2 or x.shape[0] > LINEAR_MAX_ROWS or x.shape[0] == 0 or x.dtype != torch.float32
            or weight.dtype != torch.float32 or x.device.type != "cpu" or weight.device.type != "cpu"
            or x.stride(1) != 1 or weight.stride(1) != 1 or weight.dim() != 2 or weight.shape[1] != x.shape[1]
            or (bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()))
            or x.requires_grad or weight.requires_grad):
        return None
    lib = library()
    if lib is None:
        return None
    rows, n = x.shape[0], weight.shape[0]
    y = torch.empty(rows, n, dtype=torch.float32)
    lib.sy_linear_f32(x.data_ptr(), x.stride(0), weight.data_ptr(), weight.stride(0),
                      bias.data_ptr() if bias is not None else None, y.data_ptr(), y.stride(0), rows, n,
                      x.shape[1], max(1, torch.get_num_threads()))
    return y
