"""Kernel benchmarks: paged decode attention bandwidth and int8/int4 GEMV vs fp16 torch.matmul.

On CUDA: times the Triton kernels (through kernels.ops) against the card's peak HBM bandwidth and
against torch peers measured in the same run (fp16 torch.matmul for the GEMVs, torch SDPA over a
dense contiguous KV cache for decode attention). Writes <out>.json and <out>.md.

    python -m bench.kernels_bench    # on the GPU; files bench/results/kernels/<gpu>.{json,md}
    python -m bench.kernels_bench --cpu-smoke --out /tmp/smoke   # tiny shapes, reference path, CPU

Bytes counted: decode attention reads K and V for every context position of every KV head (plus q
and out); a GEMV reads the whole weight (int8: N*K + 4N bytes of scales; int4: N*K/2 + scales and
zeros at 4 bytes each per group; fp16: 2*N*K).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial

import torch
import torch.nn.functional as F

from bench import store
from bench.machine_info import cpu_model, gpu_slug
from bench.roofline import peak_bandwidth
from kernels import ops, switches


@dataclass(slots=True)
class Row:
    bench: str
    shape: str
    impl: str
    ms: float
    gbps: float | None
    pct_peak: float | None
    vs_peer: float | None  # peer time / this time (>1 = faster than the peer)


def timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """Median milliseconds of fn()."""
    if device.type == "cuda":
        import triton.testing

        def cuda_time(fn):
            return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))

        return cuda_time

    def cpu_time(fn):
        fn()
        samples = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)

    return cpu_time


def _row(bench, shape, impl, ms, nbytes, peak, peer_ms=None) -> Row:
    gbps = nbytes / (ms * 1e-3) / 1e9
    return Row(bench, shape, impl, round(ms, 4), round(gbps, 1),
               round(100 * gbps * 1e9 / peak, 1) if peak else None,
               round(peer_ms / ms, 2) if peer_ms else None)


def bench_decode(device, dtype, time_ms, peak, configs) -> list[Row]:
    rows = []
    for batch, ctx, hq, hkv, hd in configs:
        block_size = 16
        nblk = math.ceil(ctx / block_size)
        num_blocks = batch * nblk
        k_cache = torch.randn(num_blocks, block_size, hkv, hd, device=device, dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        # Shuffled blocks: a realistic, non-contiguous paged layout.
        tables = torch.randperm(num_blocks, device=device).view(batch, nblk).to(torch.int32)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        q = torch.randn(batch, hq, hd, device=device, dtype=dtype)
        scale = hd ** -0.5
        nbytes = 2 * batch * ctx * hkv * hd * k_cache.element_size() + 2 * q.numel() * q.element_size()
        shape = f"B={batch} ctx={ctx} Hq={hq} Hkv={hkv} D={hd}"

        # Peer: torch SDPA over a dense contiguous cache of the same size (no paging).
        k_dense = torch.randn(batch, hkv, ctx, hd, device=device, dtype=dtype)
        v_dense = torch.randn_like(k_dense)
        peer_ms = time_ms(partial(F.scaled_dot_product_attention, q[:, :, None, :], k_dense, v_dense,
                                  scale=scale, enable_gqa=True))
        ours_ms = time_ms(partial(ops.paged_decode_attention, q, k_cache, v_cache, tables, lens, scale))
        rows.append(_row("decode_attention", shape, "torch SDPA (dense KV)", peer_ms, nbytes, peak))
        rows.append(_row("decode_attention", shape, f"paged ({ops.active_backend(q)})", ours_ms, nbytes, peak,
                         peer_ms))
    return rows


def bench_linear(device, dtype, time_ms, peak, shapes, batches, group_sizes) -> list[Row]:
    rows = []
    for n, k in shapes:
        w = torch.randn(n, k, device=device, dtype=torch.float32) * 0.02
        w16 = w.to(dtype)
        w_q, s8 = ops.quantize_int8(w)
        int4 = {g: ops.quantize_int4(w, g) for g in group_sizes}
        del w
        for m in batches:
            x = torch.randn(m, k, device=device, dtype=dtype)
            act = 2 * m * (k + n)
            shape = f"M={m} N={n} K={k}"
            peer_ms = time_ms(partial(torch.matmul, x, w16.t()))
            rows.append(_row("linear", shape, f"torch.matmul {str(dtype)[6:]}", peer_ms, 2 * n * k + act, peak))
            ms = time_ms(partial(ops.int8_linear, x, w_q, s8))
            rows.append(_row("linear", shape, f"int8 ({ops.active_backend(x)})", ms, n * k + 4 * n + act, peak,
                             peer_ms))
            for g, (packed, scales, zeros) in int4.items():
                ms = time_ms(partial(ops.int4_linear, x, packed, scales, zeros, g))
                nbytes = n * k // 2 + 8 * n * (k // g) + act
                rows.append(_row("linear", shape, f"int4 g{g} ({ops.active_backend(x)})", ms, nbytes, peak,
                                 peer_ms))
    return rows


def markdown(meta: dict, rows: list[Row]) -> str:
    versions = (f"torch {meta['torch']}, triton {meta['triton']}, dtype {meta['dtype']}, "
                f"peak bandwidth {meta['peak_gbps'] or 'unknown'} GB/s")
    note = "CPU smoke run: reference path, tiny shapes; the numbers mean nothing." if meta["cpu_smoke"] else ""
    lines = [f"# Kernel benchmarks — {meta['device']}", "", versions, note, "",
             "| bench | shape | impl | ms | GB/s | % of peak | speed vs peer |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        pct = "" if r.pct_peak is None else f"{r.pct_peak}"
        vs = "" if r.vs_peer is None else f"{r.vs_peer}x"
        lines.append(f"| {r.bench} | {r.shape} | {r.impl} | {r.ms} | {r.gbps} | {pct} | {vs} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="output path without extension (.json and .md written) instead "
                                                    "of filing the run in bench/results/kernels/<device>")
    parser.add_argument("--label", default="", help="a name for this run in the results history")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny shapes on CPU through the reference path: exercises the code, measures nothing")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = parser.parse_args(argv)

    if args.cpu_smoke:
        switches.configure(kernels="reference")
        device = torch.device("cpu")
        dtype = torch.float32
        decode_cfgs = [(1, 40, 4, 2, 16), (3, 33, 8, 2, 16)]
        shapes, batches, groups = [(64, 128)], [1, 4], [32, 128]
    else:
        if not torch.cuda.is_available():
            parser.error("no CUDA device: run with --cpu-smoke on a CPU machine")
        device = torch.device("cuda")
        dtype = getattr(torch, args.dtype)
        # Llama-3-8B attention shape (32 q heads, 8 kv heads, head_dim 128) at several batch/context sizes.
        decode_cfgs = [(1, 4096, 32, 8, 128), (1, 32768, 32, 8, 128), (16, 4096, 32, 8, 128),
                       (64, 2048, 32, 8, 128), (64, 4096, 32, 8, 128)]
        # Llama-3-8B projections: qkv (fused, GQA), o, gate/up, down, and the 128k-vocab lm_head.
        shapes = [(6144, 4096), (4096, 4096), (14336, 4096), (4096, 14336), (128256, 4096)]
        batches, groups = [1, 64], [32, 128]

    peak = peak_bandwidth(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    import triton

    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({cpu_model()})",
        "torch": torch.__version__, "triton": triton.__version__, "dtype": str(dtype)[6:],
        "peak_gbps": peak / 1e9 if peak else None, "cpu_smoke": args.cpu_smoke,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    time_ms = timer(device)
    with torch.inference_mode():
        rows = bench_decode(device, dtype, time_ms, peak, decode_cfgs)
        rows += bench_linear(device, dtype, time_ms, peak, shapes, batches, groups)

    table = markdown(meta, rows)
    machine = gpu_slug(meta["device"]) if device.type == "cuda" else None
    saved = store.save("kernels", {"meta": meta, "rows": [asdict(r) for r in rows]}, markdown=table,
                       label=args.label, out=args.out, machine=machine)
    print(table)
    print(f"saved {saved}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
