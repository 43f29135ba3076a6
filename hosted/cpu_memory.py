"""CPU memory tuning for the engine's own process: glibc malloc keeps freed memory, and the weights and the
KV pool sit on 2 MiB (transparent huge) pages. Linux/glibc only; elsewhere each step is a no-op."""
from __future__ import annotations

import ctypes
import platform
import sys

import torch

from kernels.huge_pages import HUGE_PAGE, empty_on_huge_pages

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's upper limit for M_MMAP_THRESHOLD on 64-bit


def keep_freed_heap_memory() -> None:
    """Tell glibc malloc to keep freed memory for reuse instead of handing it back to the OS after every
    step. torch's CPU allocator does not cache, so each step's large activations (tens of MB at 2048
    tokens) were mapped afresh and page-faulted in: ~10% of prefill time in the kernel zeroing pages, gone
    with this. The cost is that the process keeps its peak heap (the engine's own process)."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
        libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    except (OSError, AttributeError):
        pass


def cpu_zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The KV pool: decode attention reads blocks scattered over all of it; with 4 KiB pages nearly every
    block costs TLB misses (~20% slower reads measured here)."""
    numel = 1
    for n in shape:
        numel *= n
    return empty_on_huge_pages(numel, dtype).zero_().view(shape)


_MOVE_CHUNK_BYTES = 256 << 20  # parameters are moved a chunk at a time: the extra memory while moving


def move_parameters_to_huge_pages(model: torch.nn.Module) -> None:
    """Copy the parameters into huge-page-backed buffers (up to _MOVE_CHUNK_BYTES each, per dtype) and point
    them there. Batch-1 decode streams every weight once per step; on 4 KiB pages the stream stalls at each
    page (TLB walk, prefetcher restart): the GEMV read 14-16 GB/s on 4 KiB pages, 17-20 GB/s on 2 MiB pages
    here (1 thread; 21 vs 30 GB/s with 2)."""
    seen: set[int] = set()
    pending: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in model.parameters():  # tied weights appear once
        if id(p) in seen or p.device.type != "cpu" or not p.is_contiguous():
            continue
        seen.add(id(p))
        group = pending.setdefault(p.dtype, [])
        group.append(p)
        if sum(q.numel() * q.element_size() for q in group) >= _MOVE_CHUNK_BYTES:
            _move_group(group)
            group.clear()
    for group in pending.values():
        _move_group(group)


def _move_group(params: list[torch.nn.Parameter]) -> None:
    align = 64  # elements: keeps every parameter's start cache-line aligned
    sizes = [-(-p.numel() // align) * align for p in params]
    if not params or sum(sizes) * params[0].element_size() < 4 * HUGE_PAGE:
        return
    flat = empty_on_huge_pages(sum(sizes), params[0].dtype)
    offset = 0
    with torch.no_grad():
        for p, size in zip(params, sizes):
            view = flat[offset:offset + p.numel()].view(p.shape)
            view.copy_(p.data)
            p.data = view
            offset += size


def tune_process_for(model: torch.nn.Module) -> None:
    """Once, when a CPU runner is built (before any weight is packed: packed linears keep data pointers)."""
    keep_freed_heap_memory()
    move_parameters_to_huge_pages(model)
