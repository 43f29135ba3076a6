"""CPU buffers that Linux may back with 2 MiB (transparent huge) pages, and moving tensors into them: the
packed weights of the native GEMMs, a model's parameters (hosted/cpu_memory.py).

Batch-1 decode streams every weight once per step; on 4 KiB pages the stream stalls at each page (TLB walk,
prefetcher restart): the GEMV read 21 GB/s on 4 KiB pages vs 30 GB/s on 2 MiB pages here (2 threads).
"""
from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable, Iterable
from typing import Protocol

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_CHUNK_BYTES = 256 << 20  # tensors move a chunk at a time: the extra memory while moving
_ALIGN = 64


def empty_on_huge_pages(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat, untouched CPU tensor: madvise(MADV_HUGEPAGE) before the first touch. Where madvise is
    unavailable (or the buffer is under two huge pages) it is a plain torch.empty."""
    t = torch.empty(numel, dtype=dtype)
    nbytes = numel * t.element_size()
    if sys.platform.startswith("linux") and nbytes >= 2 * HUGE_PAGE:
        start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
        end = (t.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)
        except (OSError, AttributeError):  # not glibc / no madvise: plain pages
            pass
    return t


class Relocatable(Protocol):
    """Something holding tensors (a packed weight: cpu_native.PackedLinear, cpu_lowp strips; a parameter): the
    tensors, and how to point it at copies of them."""

    def owned_tensors(self) -> list[torch.Tensor]: ...

    def rebind(self, take: Callable[[torch.Tensor], torch.Tensor]) -> None: ...


def move_to_huge_pages(packed: Iterable[Relocatable]) -> int:
    """Copy the tensors of `packed`, in the order given (a model's execution order: one step then reads one
    stream), into huge-page buffers of up to _CHUNK_BYTES and rebind each object to its copies (a group under
    two huge pages stays where it is). Returns the bytes moved."""
    moved = 0
    group: list[Relocatable] = []
    size = 0
    for p in packed:
        group.append(p)
        size += sum(_aligned(t) for t in p.owned_tensors())
        if size >= _CHUNK_BYTES:
            moved += _move(group, size)
            group, size = [], 0
    return moved + (_move(group, size) if group else 0)


def _aligned(t: torch.Tensor) -> int:
    return -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN


def _move(group: list[Relocatable], size: int) -> int:
    if size < 2 * HUGE_PAGE:
        return 0
    arena = empty_on_huge_pages(size + _ALIGN, torch.uint8)
    offset = -arena.data_ptr() % _ALIGN

    def take(t: torch.Tensor) -> torch.Tensor:
        nonlocal offset
        n = t.numel() * t.element_size()
        view = arena[offset:offset + n].view(t.dtype).view(t.shape)
        with torch.no_grad():
            view.copy_(t)
        offset += _aligned(t)
        return view

    for p in group:
        p.rebind(take)
    return size
