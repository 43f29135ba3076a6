"""What sharing budgets and rate limits through Redis costs a request: p50 latency, Redis off vs on.

Two `switchyard serve` processes on one stand-in upstream (a subprocess, 127.0.0.1): one as today (its own budget
book and windows), one with `--redis-url` on a private redis-server (the hot path's one Lua script: RPM + TPM +
the budget's reservation; the settle goes after the answer). The key has a budget, an RPM and a TPM, so every
request runs the whole script. Concurrency 1, rounds alternated between the two so drift on a shared machine hits
both alike. Target (issue 32): Redis on within +0.3 ms p50 of Redis off.

    python -m bench.redis_overhead [--requests 400] [--rounds 5]

Prints a table and files the run in bench/results/redis_overhead/<machine>.json (bench/store.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

from bench import store
from bench.loadgen import run_load
from bench.machine_info import free_port, machine
from bench.servers import start, stop, wait_http
from gateway.shared_state_testing import RedisServer
from gateway.testing.standin import run_standin

KEY = "sk-bench-redis-master"
BODY = json.dumps({"model": "local", "max_tokens": 16,
                   "messages": [{"role": "user", "content": "Say something short about tides."}]}).encode()


def _gateway(tmp: Path, name: str, upstream: str, redis_url: str | None) -> tuple:
    port = free_port()
    policy = tmp / f"{name}.yaml"
    policy.write_text(f"backends:\n  eng: {{kind: engine, model: m, api_base: \"{upstream}\", gpu_hour_usd: 3.6}}\n"
                      "routes:\n  local: {backend: eng}\n")
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--policy", str(policy), "--port", str(port),
           "--database-url", f"sqlite:///{tmp / (name + '.db')}", "--log-level", "warning"]
    if redis_url:
        cmd += ["--redis-url", redis_url]
    process = start(cmd, {"SWITCHYARD_MASTER_KEY": KEY, "SWITCHYARD_DATA_DIR": str(tmp / name)}, tmp / f"{name}.log")
    root = f"http://127.0.0.1:{port}"
    wait_http(f"{root}/health", 180)
    key = httpx.post(f"{root}/admin/keys", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                     json={"team": "bench", "budget_usd": 1e6, "rpm": 10**7, "tpm": 10**9}).json()["key"]
    return process, root, key


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400, help="requests per round and target")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="write this JSON file instead of filing the run")
    args = parser.parse_args()
    latencies: dict[str, list[float]] = {"redis off": [], "redis on": []}
    errors = dict.fromkeys(latencies, 0)
    with tempfile.TemporaryDirectory() as tmpdir, run_standin(subprocess_mode=True) as upstream, \
            RedisServer() as redis_server:
        tmp = Path(tmpdir)
        processes = []
        try:
            targets = {}
            for name, url in (("redis off", None), ("redis on", redis_server.url)):
                process, root, key = _gateway(tmp, name.replace(" ", "_"), upstream, url)
                processes.append(process)
                targets[name] = (f"{root}/v1/chat/completions", key)
            for _ in range(args.rounds):
                for name, (url, key) in targets.items():
                    result = asyncio.run(run_load(url, BODY, {"Authorization": f"Bearer {key}"}, concurrency=1,
                                                  requests=args.requests, warmup=50))
                    latencies[name] += result.latencies_ms
                    errors[name] += result.errors
            health = httpx.get(targets["redis on"][0].split("/v1")[0] + "/health", timeout=10).json()
            assert health["shared_state"]["status"] == "shared", health["shared_state"]
        finally:
            for process in processes:
                stop(process)
    rows = {name: {"p50_ms": statistics.median(values), "p90_ms": statistics.quantiles(values, n=10)[-1],
                   "requests": len(values), "errors": errors[name]} for name, values in latencies.items()}
    delta = rows["redis on"]["p50_ms"] - rows["redis off"]["p50_ms"]
    payload = {"machine": machine(), "requests_per_round": args.requests, "rounds": args.rounds,
               "concurrency": 1, "results": rows, "p50_delta_ms": delta, "target_p50_delta_ms": 0.3}
    print(f"machine: {payload['machine']['cpu_model']} ({payload['machine']['cpus']} CPUs)")
    print(f"{'target':<10} {'p50 ms':>8} {'p90 ms':>8} {'requests':>9} {'errors':>7}")
    for name, row in rows.items():
        print(f"{name:<10} {row['p50_ms']:>8.3f} {row['p90_ms']:>8.3f} {row['requests']:>9} {row['errors']:>7}")
    print(f"Redis on - off, p50: {delta:+.3f} ms (target <= +0.3 ms)")
    print(f"saved {store.save('redis_overhead', payload, out=args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
