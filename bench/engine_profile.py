"""Where a decode step's time goes: per-step CPU time of the engine's forward at batch 1 and batch B, a
torch.profiler split by op, and the GEMM rate this CPU reaches on the same shapes.

Model: random weights in the SmolLM-135M shape (as bench/engine_throughput.py), fp32 on CPU. The decode
steps run the real ModelRunner + Sampler on sequences whose KV blocks are allocated but not prefilled
(the values in the cache do not change the work), so a batch-64 step at context 384 can be timed
without spending minutes on prefill.

CPU time (time.process_time: all threads of this process) is the figure to compare variants on a
shared machine; wall time is printed too.

    python -m bench.engine_profile                      # batch 1 and 64, 2 threads
    python -m bench.engine_profile --threads 1 --profile
    python -m bench.engine_profile --gemm               # also the GEMM/GEMV rate table

Prints a table and files the run in bench/results/engine_profile/<machine>.json.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import store
from bench.fixtures import random_smollm
from bench.roofline import copy_bandwidth

ROOT = Path(__file__).resolve().parent.parent


def make_runner(model_dir: Path, batch: int, context: int, dtype: str, headroom: int = 64):
    from hosted.config import EngineConfig, ModelConfig
    from hosted.model_runner import ModelRunner
    from hosted.sampler import Sampler

    mc = ModelConfig.from_dir(model_dir)
    blocks = batch * (-(-(2 * context + headroom) // 16)) + 8
    cfg = EngineConfig(model_dir=str(model_dir), dtype=dtype, device="cpu", max_num_seqs=batch,
                       num_kv_blocks=blocks, max_model_len=2048)
    runner = ModelRunner(mc, cfg, 2048)
    return runner, Sampler(runner.device), mc


def decode_batch(mc, batch: int, context: int, spread: float, seed: int, headroom: int = 64):
    """Sequences with `context` tokens (+/- spread), all but the last one already 'computed', with blocks for
    `headroom` more tokens each."""
    import random

    from hosted.sampling_params import SamplingParams
    from hosted.scheduler import ScheduledBatch
    from hosted.sequence import SeqStatus, Sequence

    rng = random.Random(seed)
    seqs, next_block = [], 0
    for i in range(batch):
        n = max(2, int(context * (1 + spread * (2 * rng.random() - 1))))
        ids = [rng.randrange(100, mc.vocab_size) for _ in range(n)]
        seq = Sequence(request_id=f"p{i}", token_ids=ids, num_prompt_tokens=n,
                       params=SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True), arrival=i)
        seq.status = SeqStatus.RUNNING
        seq.num_computed_tokens = n - 1
        nblk = -(-(n + headroom) // 16)
        seq.block_table = list(range(next_block, next_block + nblk))
        next_block += nblk
        seqs.append(seq)
    items = [(s, 1) for s in seqs]
    return ScheduledBatch(items=items, num_decodes=batch, num_tokens=batch)


def time_steps(runner, sampler, batch, steps: int, warmup: int = 2) -> dict:
    cpu, wall = [], []
    for i in range(warmup + steps):
        w0, c0 = time.perf_counter(), time.process_time()
        with torch.inference_mode():
            logits, seqs = runner.execute(batch)
            result = sampler(logits, seqs)
        c1, w1 = time.process_time(), time.perf_counter()
        # Advance like the engine does, so the context grows by one per step.
        for (seq, _), tok in zip(batch.items, result.token_ids):
            seq.num_computed_tokens += 1
            seq.token_ids.append(tok)
        if i >= warmup:
            cpu.append(c1 - c0)
            wall.append(w1 - w0)
    return {"cpu_ms_median": 1000 * statistics.median(cpu), "cpu_ms_min": 1000 * min(cpu),
            "wall_ms_median": 1000 * statistics.median(wall), "wall_ms_min": 1000 * min(wall), "steps": steps}


def profile_steps(runner, sampler, batch, steps: int, rows: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with torch.inference_mode():
                logits, seqs = runner.execute(batch)
                result = sampler(logits, seqs)
            for (seq, _), tok in zip(batch.items, result.token_ids):
                seq.num_computed_tokens += 1
                seq.token_ids.append(tok)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def gemm_rates(threads: int) -> list[dict]:
    """GFLOPS of F.linear on the model's shapes at a few row counts (CPU time and wall)."""
    import torch.nn.functional as F

    h, inter, v = 576, 1536, 49152
    shapes = {"qkv": (960, h), "o": (h, h), "gate_up": (2 * inter, h), "down": (h, inter), "lm_head": (v, h)}
    out = []
    for m in (1, 16, 64, 512, 2048):
        for name, (n, k) in shapes.items():
            if name == "lm_head" and m > 64:
                continue
            w = torch.randn(n, k)
            x = torch.randn(m, k)
            F.linear(x, w)
            reps = max(3, int(2e9 / (2 * m * n * k + 1)))
            reps = min(reps, 400)
            c0, w0 = time.process_time(), time.perf_counter()
            for _ in range(reps):
                F.linear(x, w)
            c1, w1 = time.process_time(), time.perf_counter()
            flops = 2 * m * n * k * reps
            bytes_ = (n * k + m * k + m * n) * 4 * reps
            out.append({"m": m, "op": name, "n": n, "k": k, "gflops_wall": flops / (w1 - w0) / 1e9,
                        "gflops_per_cpu_s": flops / (c1 - c0) / 1e9, "gb_s_wall": bytes_ / (w1 - w0) / 1e9})
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batches", default="1,64", help="comma-separated decode batch sizes")
    ap.add_argument("--context", type=int, default=384, help="mean context length of the batched decode")
    ap.add_argument("--context-1", type=int, default=256, help="context length at batch 1")
    ap.add_argument("--spread", type=float, default=0.8, help="context lengths vary by +/- this fraction")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler table per batch size")
    ap.add_argument("--profile-rows", type=int, default=25)
    ap.add_argument("--gemm", action="store_true", help="also measure F.linear rates on the model's shapes")
    ap.add_argument("--model-dir", default=None, help="reuse a saved checkpoint directory (built if missing)")
    ap.add_argument("--out", default=None, help="write this JSON file instead of filing the run in "
                                                "bench/results/engine_profile/<machine>.json")
    ap.add_argument("--label", default="", help="a name for this run in the results history")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    results: dict = {"config": vars(args), "load_avg_at_start": os.getloadavg(), "steps": {}}
    with tempfile.TemporaryDirectory(prefix="sy-prof-") as tmp:
        model_dir = Path(args.model_dir or Path(tmp) / "model")
        model_dir.mkdir(parents=True, exist_ok=True)
        if not (model_dir / "config.json").is_file():
            random_smollm(model_dir, args.layers)
        for b in (int(x) for x in args.batches.split(",")):
            ctx = args.context_1 if b == 1 else args.context
            headroom = args.steps + 8
            runner, sampler, mc = make_runner(model_dir, b, ctx, args.dtype, headroom)
            batch = decode_batch(mc, b, ctx, 0.0 if b == 1 else args.spread, seed=b, headroom=headroom)
            r = time_steps(runner, sampler, batch, args.steps)
            r["context_mean"] = statistics.mean(s.num_tokens for s, _ in batch.items)
            results["steps"][str(b)] = r
            print(f"batch {b:>3} (mean context {r['context_mean']:.0f}): CPU {r['cpu_ms_median']:.1f} ms/step "
                  f"(min {r['cpu_ms_min']:.1f}), wall {r['wall_ms_median']:.1f} ms/step "
                  f"(min {r['wall_ms_min']:.1f})", flush=True)
            if args.profile:
                print(profile_steps(runner, sampler, batch, max(2, args.steps // 2), args.profile_rows), flush=True)
            if b == 1:
                weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
                kv = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * 4 * r["context_mean"]
                copy = copy_bandwidth(256)["gb_s"]
                bw = (weights + kv) / (r["wall_ms_min"] / 1000) / 1e9
                results["batch1_bandwidth"] = {"bytes_per_step": weights + kv, "gb_s_at_min_wall": bw,
                                               "copy_gb_s": copy, "fraction": bw / copy}
                print(f"  batch-1 bandwidth at min wall: {bw:.1f} GB/s vs copy {copy:.1f} GB/s "
                      f"({100 * bw / copy:.0f}%)", flush=True)
            del runner, sampler, batch
            gc.collect()
    if args.gemm:
        rates = gemm_rates(args.threads)
        results["gemm"] = rates
        print(f"{'m':>5} {'op':<8} {'n':>6} {'k':>5} {'GFLOPS wall':>12} {'GFLOP/CPU-s':>12} {'GB/s wall':>10}")
        for g in rates:
            print(f"{g['m']:>5} {g['op']:<8} {g['n']:>6} {g['k']:>5} {g['gflops_wall']:>12.1f} "
                  f"{g['gflops_per_cpu_s']:>12.1f} {g['gb_s_wall']:>10.1f}")
    results["load_avg_at_end"] = os.getloadavg()
    print(f"saved {store.save('engine_profile', results, label=args.label, out=args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
