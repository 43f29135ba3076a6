"""The memory-bandwidth roofline: one probe for every benchmark, so two of them cannot disagree on a machine.

`read_bandwidth` is the decode roofline on CPU (a decode step streams its weights once: a read, not a copy);
`copy_bandwidth` times one large tensor copy (read + write), the usual GPU probe; `peak_bandwidth` is a GPU's
datasheet figure. Every probe is best-of-N: the bound is the fastest the machine was seen to go.
"""
from __future__ import annotations

import time
from functools import partial

import torch

# Datasheet HBM bandwidth, bytes/s, matched on the device name (first match wins: specific names first).
PEAK_BANDWIDTH: list[tuple[str, float]] = [
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100 NVL", 3.9e12),
    ("H100", 3.35e12),  # SXM5 / HBM3
    ("GH200", 4.0e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),  # 40 GB
    ("L40S", 0.864e12),
    ("L4", 0.3e12),
    ("A10", 0.6e12),
]


def peak_bandwidth(device_name: str) -> float | None:
    for key, bw in PEAK_BANDWIDTH:
        if key.lower() in device_name.lower():
            return bw
    return None


def _best(fn, repeats: int) -> float:
    fn()  # one untimed pass: page faults and first-touch out of the way
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def read_bandwidth(mib: int, threads: int | None = None, repeats: int = 5) -> dict:
    """Streaming read of a buffer well above the last-level cache: torch.sum over fp32 (with `threads` threads)."""
    if threads is not None:
        torch.set_num_threads(threads)
    x = torch.ones((mib << 20) // 4, dtype=torch.float32)
    best = _best(x.sum, repeats)
    n = x.numel() * 4
    del x
    return {"buffer_bytes": n, "best_seconds": best, "gb_s": n / best / 1e9, "threads": torch.get_num_threads()}


def copy_bandwidth(megabytes: int, device: torch.device | str = "cpu", repeats: int | None = None) -> dict:
    """Read + write bytes per second of one large tensor copy; on CUDA timed with events over 5 copies."""
    device = torch.device(device)
    n = megabytes << 20
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    copy = partial(dst.copy_, src)
    best = _cuda_best(copy, device, repeats or 10) if device.type == "cuda" else _best(copy, repeats or 6)
    del copy, src, dst
    return {"bytes_moved": 2 * n, "best_seconds": best, "gb_s": 2 * n / best / 1e9}


def _cuda_best(fn, device: torch.device, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        best = min(best, start.elapsed_time(end) / 1e3 / 5)
    return best
