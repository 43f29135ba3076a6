"""CPU memory tuning for the engine's own process: glibc malloc keeps freed memory, and the weights and the
KV pool sit on 2 MiB (transparent huge) pages. Linux/glibc only; elsewhere each step is a no-op."""
from __future__ import annotations

import ctypes
import platform
import sys

import torch

from kernels.huge_pages import empty_on_huge_pages, move_to_huge_pages

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


class _Parameter:
    """A parameter as kernels.huge_pages moves it: its data, re-pointed at the copy."""

    __slots__ = ("param",)

    def __init__(self, param: torch.nn.Parameter) -> None:
        self.param = param

    def owned_tensors(self) -> list[torch.Tensor]:
        return [self.param.data]

    def rebind(self, take) -> None:
        self.param.data = take(self.param.data)


def move_parameters_to_huge_pages(model: torch.nn.Module) -> None:
    """Copy the parameters into huge-page-backed buffers and point them there. Batch-1 decode streams every
    weight once per step; on 4 KiB pages the stream stalls at each page (TLB walk, prefetcher restart): the
    GEMV read 14-16 GB/s on 4 KiB pages, 17-20 GB/s on 2 MiB pages here (1 thread; 21 vs 30 GB/s with 2)."""
    params = {id(p): p for p in model.parameters() if p.device.type == "cpu" and p.is_contiguous()}  # tied: once
    move_to_huge_pages(_Parameter(p) for p in params.values())


def tune_process_for(model: torch.nn.Module) -> None:
    """Once, when a CPU runner is built (before any weight is packed: packed linears keep data pointers)."""
    keep_freed_heap_memory()
    move_parameters_to_huge_pages(model)
