"""Compile every Triton kernel for a GPU architecture on a machine without one (ahead-of-time check).

Runs the real ops wrappers on small CPU tensors with GPU launch configurations, intercepts each kernel
launch, and compiles it for the requested target through Triton's normal JIT path (warmup: compile, no
launch) all the way to a cubin. Catches what the CPU interpreter cannot: type errors the compiler
rejects, unsupported ops, tl.dot shape limits, shared-memory overuse.

    python -m kernels.compile_check --arch 90 --arch 80          # all shapes
    python -m kernels.compile_check --arch 90 --quick            # one case per kernel (used by the tests)

Must run with TRITON_INTERPRET unset (the kernels must be decorated as compiled functions).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("kernels.compile_check needs TRITON_INTERPRET unset")

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver as driver_mod
from triton.runtime.jit import JITFunction

from kernels import reference, switches, triton_attention, triton_pointwise, triton_quant
from kernels import triton_ops as tk

# Heuristic GEMV tiles (the autotuner benchmarks on a device); its candidates are compiled separately.
switches.configure(kernel_autotune=False)

# Max dynamic shared memory per block (bytes) by SM version; a kernel above it would fail to launch.
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}


@dataclass(slots=True)
class _FakeDriver:
    """Just enough of a Triton driver to pick a compile target; launches are never reached."""

    target: GPUTarget

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target


@dataclass(slots=True)
class CompileLog:
    compiled: list[tuple[str, int]] = field(default_factory=list)  # (kernel name, shared memory bytes)


def _compile_only(log: CompileLog):
    original = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = original(self, *args, grid=grid, warmup=True, **kwargs)
        log.compiled.append((self.fn.__name__, int(getattr(kernel.metadata, "shared", 0))))
        return kernel

    return original, run


def _paged(batch, heads_kv, head_dim, block_size, dtype, blocks_per_seq=8):
    k_cache = torch.zeros(batch * blocks_per_seq, block_size, heads_kv, head_dim, dtype=dtype)
    tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32).view(batch, blocks_per_seq)
    lens = torch.full((batch,), blocks_per_seq * block_size - 3, dtype=torch.int32)
    return k_cache, k_cache.clone(), tables, lens


def cases(quick: bool) -> list[tuple[str, Callable[[], object]]]:
    out: list[tuple[str, Callable[[], object]]] = []
    dtypes = [torch.bfloat16] if quick else [torch.bfloat16, torch.float16, torch.float32]
    for dtype in dtypes:
        for head_dim, heads_kv, group in ([(128, 8, 4)] if quick else [(128, 8, 4), (64, 2, 1), (128, 1, 8),
                                                                        (96, 4, 2)]):
            def decode(dtype=dtype, head_dim=head_dim, heads_kv=heads_kv, group=group):
                k, v, tables, lens = _paged(2, heads_kv, head_dim, 16, dtype)
                q = torch.zeros(2, heads_kv * group, head_dim, dtype=dtype)
                tk.paged_decode_attention(q, k, v, tables, lens, 0.1)  # split-KV + merge
                tk.paged_decode_attention(q, k, v, tables, lens, 0.1, num_splits=1)

            def prefill(dtype=dtype, head_dim=head_dim, heads_kv=heads_kv, group=group):
                k, v, tables, lens = _paged(2, heads_kv, head_dim, 16, dtype)
                q = torch.zeros(40, heads_kv * group, head_dim, dtype=dtype)
                cu = torch.tensor([0, 30, 40], dtype=torch.int32)
                tk.paged_prefill_attention(q, k, v, tables, cu, lens, 0.1)

            out += [(f"decode {dtype} D={head_dim} G={group}", decode),
                    (f"prefill {dtype} D={head_dim} G={group}", prefill)]

        def pointwise(dtype=dtype):
            x = torch.zeros(4, 4096, dtype=dtype)
            tk.rms_norm(x, torch.zeros(4096, dtype=dtype), 1e-5)
            tk.rms_norm(x, torch.zeros(4096, dtype=dtype), 1e-5, residual=x)
            q, kk = torch.zeros(4, 32, 128, dtype=dtype), torch.zeros(4, 8, 128, dtype=dtype)
            tk.apply_rotary(q, kk, torch.arange(4), reference.rotary_cos_sin(128, 16, 1e4, None))
            cache = torch.zeros(4, 16, 8, 128, dtype=dtype)
            tk.store_kv(kk, kk, cache, cache.clone(), torch.arange(4))

        def int8(dtype=dtype):
            w_q = torch.zeros(512, 1024, dtype=torch.int8)
            scales = torch.ones(512)
            for rows in [1] if quick else [1, 3, 64, 256]:
                tk.int8_linear(torch.zeros(rows, 1024, dtype=dtype), w_q, scales)
            tk.int8_linear(torch.zeros(16, 1024, dtype=dtype), w_q, scales, torch.zeros(512, dtype=dtype))

        out += [(f"rms_norm/rotary/store_kv {dtype}", pointwise), (f"int8_linear {dtype}", int8)]
        for group_size in [128] if quick else [32, 64, 128]:
            def int4(dtype=dtype, group_size=group_size):
                packed = torch.zeros(512, 512, dtype=torch.uint8)
                scales = torch.ones(512, 1024 // group_size)
                for rows in [1, 64] if quick else [1, 4, 64, 256]:
                    x = torch.zeros(rows, 1024, dtype=dtype)
                    tk.int4_linear(x, packed, scales, scales, group_size)
                    tk.int4_linear(x, packed, scales, None, group_size)

            out.append((f"int4_linear {dtype} g={group_size}", int4))
    if not quick:
        out.append(("GEMV autotune candidates bf16", _gemv_candidates))
    return out


def _gemv_candidates() -> None:
    x = torch.zeros(1, 1024, dtype=torch.bfloat16)
    out = torch.empty(1, 512, dtype=torch.bfloat16)
    w8, scales = torch.zeros(512, 1024, dtype=torch.int8), torch.ones(512)
    w4, gscales = torch.zeros(512, 512, dtype=torch.uint8), torch.ones(512, 8)
    for cfg in triton_quant.gemv_configs():
        meta = dict(cfg.kwargs, num_warps=cfg.num_warps)
        triton_quant._int8_gemv_kernel[(1, 1)](x, w8, scales, scales, out, 512, 1024, 1024, 1024, 512,
                                               HAS_BIAS=False, UPCAST=True, **meta)
        triton_quant._int4_gemv_kernel[(1, 1)](x, w4, gscales, gscales, scales, out, 512, 1024, 1024, 512, 8, 8,
                                               512, GROUP=128, HAS_ZEROS=True, HAS_BIAS=False, UPCAST=True,
                                               **meta)


def _reset_jit_caches() -> None:
    # JITFunction caches its compile target per device index: drop it when switching architectures.
    for module in (triton_attention, triton_pointwise, triton_quant):
        for obj in vars(module).values():
            if isinstance(obj, JITFunction):
                obj.device_caches.clear()


def check(arch: int, quick: bool, verbose: bool = True) -> CompileLog:
    log = CompileLog()
    _reset_jit_caches()
    original, patched = _compile_only(log)
    previous_driver = driver_mod._active  # None on a machine without a GPU driver
    driver_mod.set_active(_FakeDriver(GPUTarget("cuda", arch, 32)))
    JITFunction.run = patched
    try:
        for name, fn in cases(quick):
            start = time.perf_counter()
            before = len(log.compiled)
            fn()
            if verbose:
                shared = max((s for _, s in log.compiled[before:]), default=0)
                print(f"sm_{arch}  {name:<40} {len(log.compiled) - before:2d} launches  "
                      f"max shared {shared / 1024:6.1f} KiB  {time.perf_counter() - start:5.1f}s", flush=True)
    finally:
        JITFunction.run = original
        driver_mod._active = previous_driver
        _reset_jit_caches()
    limit = SHARED_LIMIT.get(arch)
    too_big = [(name, shared) for name, shared in log.compiled if limit and shared > limit]
    if too_big:
        raise RuntimeError(f"sm_{arch}: shared memory above the {limit} B limit: {too_big}")
    return log


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, action="append", help="SM version, e.g. 90 (H100/H200), 80 (A100)")
    parser.add_argument("--quick", action="store_true", help="one case per kernel")
    args = parser.parse_args(argv)
    for arch in args.arch or [90]:
        log = check(arch, args.quick)
        print(f"sm_{arch}: compiled {len(log.compiled)} kernel launches OK")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
