"""Engine fleet balancing: cache-aware vs round-robin vs least-loaded, through the real gateway.

Three stand-in engines (gateway/testing/standin.py, each its own process) model an engine's prefix cache: the
prompt's words in 16-word blocks, chained; a block seen before is cached, and the first byte waits for the
uncached words' prefill (`--prefill-ms` a word), one prefill at a time per replica (later requests queue).
One `switchyard serve` process holds one fleet backend per strategy over the same three engines (a route
each); the engines' caches and counters are reset between strategies.

Workload: `--apps` shared system prompts (`--system-words` each), `--conversations` conversations of `--turns`
turns (each turn resends the history plus a new question), `--concurrency` conversations at a time, streamed.
Measured per strategy: prefix hit rate (cached / prompt tokens, the engines' own count), TTFT p50/p95 (client:
time to the first content chunk), throughput (requests/s), load spread (requests per replica, max / mean).
Targets (issue 32): cache-aware >= 2x round-robin's hit rate, >= 30% lower p50 TTFT, no replica > 1.5x mean.

    .venv/bin/python -m bench.fleet            # prints a table, files bench/results/fleet/<machine>.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

from bench import store
from bench.machine_info import free_port, machine
from bench.servers import wait_http
from gateway.testing.standin import run_standin, standin_control, standin_stats

ROOT = Path(__file__).resolve().parent.parent

KEY = "sk-bench-fleet"
STRATEGIES = ("cache_aware", "round_robin", "least_loaded")


def workload(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """[(system prompt, [question per turn])] per conversation, from a fixed seed."""
    rng = random.Random(args.seed)
    vocab = [f"w{i}" for i in range(5000)]
    systems = [" ".join(rng.choices(vocab, k=args.system_words)) for _ in range(args.apps)]
    return [(systems[i % args.apps], [" ".join(rng.choices(vocab, k=args.question_words)) for _ in range(args.turns)])
            for i in range(args.conversations)]


async def one_turn(client: httpx.AsyncClient, url: str, model: str, messages: list[dict], max_tokens: int,
                   ) -> tuple[float, str]:
    """(TTFT seconds, answer text) of one streamed chat completion."""
    started = time.perf_counter()
    ttft, parts = None, []
    body = {"model": model, "messages": messages, "stream": True, "max_tokens": max_tokens}
    async with client.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                text = (choice.get("delta") or {}).get("content")
                if text:
                    ttft = ttft if ttft is not None else time.perf_counter() - started
                    parts.append(text)
    return (ttft if ttft is not None else time.perf_counter() - started), "".join(parts)


async def run_strategy(gateway: str, strategy: str, convs: list, args: argparse.Namespace) -> dict:
    queue: asyncio.Queue = asyncio.Queue()
    for c in convs:
        queue.put_nowait(c)
    ttfts: list[float] = []
    url = gateway + "/chat/completions"

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            system, questions = queue.get_nowait()
            messages = [{"role": "system", "content": system}]
            for q in questions:
                messages.append({"role": "user", "content": q})
                ttft, answer = await one_turn(client, url, strategy, messages, args.max_tokens)
                ttfts.append(ttft)
                messages.append({"role": "assistant", "content": answer})

    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {KEY}"}, timeout=120, limits=limits) as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(args.concurrency)))
        wall = time.perf_counter() - started
    ttfts.sort()
    return {"requests": len(ttfts), "wall_s": wall, "throughput_rps": len(ttfts) / wall,
            "ttft_p50_ms": statistics.median(ttfts) * 1000,
            "ttft_p95_ms": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))] * 1000}


def policy_text(engines: list[str]) -> str:
    out = ["backends:"]
    for s in STRATEGIES:
        out += [f"  fleet_{s}:", "    kind: engine", "    model: standin", f"    api_bases: [{', '.join(engines)}]",
                "    cpu_hour_usd: 1.0", f"    balance: {{strategy: {s}}}"]
    out.append("routes:")
    for s in STRATEGIES:
        out += [f"  {s}:", "    strategy: fixed", f"    backend: fleet_{s}"]
    return "\n".join(out) + "\n"


def table(results: dict) -> list[str]:
    rr = results["round_robin"]
    lines = [(f"{'strategy':<14}{'hit rate':>10}{'TTFT p50 ms':>13}{'TTFT p95 ms':>13}{'req/s':>8}"
              f"{'max/mean load':>15}  per replica"),
             "-" * 90]
    for s in STRATEGIES:
        r = results[s]
        lines.append(f"{s:<14}{r['hit_rate']:>10.1%}{r['ttft_p50_ms']:>13.1f}{r['ttft_p95_ms']:>13.1f}"
                     f"{r['throughput_rps']:>8.1f}{r['load_max_over_mean']:>15.2f}  {r['per_replica_requests']}")
    ca = results["cache_aware"]
    lines.append(f"cache-aware vs round-robin: hit rate x{ca['hit_rate'] / max(rr['hit_rate'], 1e-9):.2f} "
                 f"(target >= 2), p50 TTFT {1 - ca['ttft_p50_ms'] / rr['ttft_p50_ms']:+.0%} lower "
                 f"(target >= 30%), max/mean load {ca['load_max_over_mean']:.2f} (target <= 1.5)")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--apps", type=int, default=8, help="distinct shared system prompts")
    p.add_argument("--system-words", type=int, default=300)
    p.add_argument("--question-words", type=int, default=60)
    p.add_argument("--conversations", type=int, default=36)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--prefill-ms", type=float, default=0.25, help="stand-in prefill time per uncached word")
    p.add_argument("--cache-blocks", type=int, default=256,
                   help="each stand-in's prefix cache, in 16-word blocks (its KV capacity)")
    p.add_argument("--seed", type=int, default=32)
    p.add_argument("--out", type=Path, default=None,
                   help="write this JSON file instead of filing the run in bench/results/fleet/<machine>.json")
    p.add_argument("--label", default="", help="a name for this run in the results history")
    args = p.parse_args()
    convs = workload(args)
    results: dict = {}
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        engines = [stack.enter_context(run_standin(subprocess_mode=True, engine_extension=True,
                                                   prefill_ms_per_token=args.prefill_ms,
                                                   prefix_cache_blocks=args.cache_blocks)) for _ in range(3)]
        (tmp / "policy.yaml").write_text(policy_text(engines))
        port = free_port()
        log = stack.enter_context(open(tmp / "gateway.log", "wb"))
        gw = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--policy", str(tmp / "policy.yaml"),
                               "--port", str(port), "--database-url", f"sqlite:///{tmp / 'ledger.db'}",
                               "--log-level", "warning"],
                              env={**os.environ, "SWITCHYARD_MASTER_KEY": KEY, "SWITCHYARD_DATA_DIR": str(tmp / "data")},
                              stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        try:
            wait_http(f"http://127.0.0.1:{port}/health", 180)
            for strategy in STRATEGIES:
                for e in engines:
                    standin_control(e, reset=True)  # empty caches and counters
                r = asyncio.run(run_strategy(f"http://127.0.0.1:{port}/v1", strategy, convs, args))
                stats = [standin_stats(e) for e in engines]
                per = [s["completed"] for s in stats]
                prompt, cached = sum(s["prompt_tokens"] for s in stats), sum(s["cached_tokens"] for s in stats)
                r.update(hit_rate=cached / prompt if prompt else 0.0, per_replica_requests=per,
                         load_max_over_mean=max(per) / (sum(per) / len(per)))
                results[strategy] = r
        finally:
            if gw.poll() is None:
                os.killpg(gw.pid, signal.SIGINT)
                try:
                    gw.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(gw.pid, signal.SIGKILL)
    lines = table(results)
    print(f"machine: {machine()['cpu_model']} ({machine()['cpus']} CPUs)")
    print("\n".join(lines))
    ca, rr = results["cache_aware"], results["round_robin"]
    payload = {"benchmark": "fleet", "machine": machine(), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "workload": {k: v for k, v in vars(args).items() if k not in ("out", "label")}, "results": results,
               "targets": {"hit_rate_ratio_vs_round_robin": ca["hit_rate"] / max(rr["hit_rate"], 1e-9),
                           "p50_ttft_reduction_vs_round_robin": 1 - ca["ttft_p50_ms"] / rr["ttft_p50_ms"],
                           "max_over_mean_load": ca["load_max_over_mean"]}}
    print(f"saved {store.save('fleet', payload, label=args.label, out=args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
