"""What sharing budgets and rate limits through Redis costs a request: p50 latency, Redis off vs on.

Two `switchyard serve` processes on one stand-in upstream (a subprocess, 127.0.0.1): one as today (its own budget
book and windows), one with `--redis-url` on a private redis-server (the hot path's one Lua script: RPM + TPM +
the budget's reservation; the settle goes after the answer). The key has a budget, an RPM and a TPM, so every
request runs the whole script. Concurrency 1, rounds alternated between the two so drift on a shared machine hits
both alike. Target (issue 32): Redis on within +0.3 ms p50 of Redis off.

`--base COMMIT` adds a third gateway, Redis on, served from a git worktree of that commit (this checkout's venv):
the hot path before and after, measured in the same run and the same alternation.

    python -m bench.redis_overhead [--requests 400] [--rounds 5] [--base COMMIT]

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


def _gateway(tmp: Path, name: str, upstream: str, redis_url: str | None, tree: Path | None = None) -> tuple:
    port = free_port()
    policy = tmp / f"{name}.yaml"
    policy.write_text(f"backends:\n  eng: {{kind: engine, model: m, api_base: \"{upstream}\", gpu_hour_usd: 3.6}}\n"
                      "routes:\n  local: {backend: eng}\n")
    # -P: the worktree's packages (PYTHONPATH) and not this checkout's (the working directory) when `tree` is given
    cmd = [sys.executable, *(["-P"] if tree else []), "-m", "gateway.cli", "serve", "--policy", str(policy),
           "--port", str(port), "--database-url", f"sqlite:///{tmp / (name + '.db')}", "--log-level", "warning"]
    if redis_url:
        cmd += ["--redis-url", redis_url]
    env = {"SWITCHYARD_MASTER_KEY": KEY, "SWITCHYARD_DATA_DIR": str(tmp / name), "SWITCHYARD_STAGE_PROFILE": "1",
           **({"PYTHONPATH": str(tree)} if tree else {})}
    process = start(cmd, env, tmp / f"{name}.log")
    root = f"http://127.0.0.1:{port}"
    wait_http(f"{root}/health", 180)
    key = httpx.post(f"{root}/admin/keys", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                     json={"team": "bench", "budget_usd": 1e6, "rpm": 10**7, "tpm": 10**9}).json()["key"]
    return process, root, key


def _script_us(url: str) -> float | None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        return client.info("commandstats").get("cmdstat_evalsha", {}).get("usec_per_call")
    finally:
        client.close()


def _stages(root: str) -> dict[str, float]:
    """Per-stage p50 (us) of the gateway's chat route (SWITCHYARD_STAGE_PROFILE=1: GET /admin/stage-profile)."""
    summary = httpx.get(f"{root}/admin/stage-profile", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    if summary.status_code != 200:
        return {}
    routes = summary.json()
    route = max(routes.values(), key=lambda r: r.get("requests", 0), default={})
    return {stage: values["p50"] for stage, values in route.get("stages_us", {}).items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400, help="requests per round and target")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="write this JSON file instead of filing the run")
    parser.add_argument("--base", default=None, help="also measure Redis on as of this commit (a git worktree)")
    args = parser.parse_args()
    sides = [("redis off", None, None), ("redis on", True, None)]
    if args.base:
        from bench.overhead_before_after import worktree

        sides.append((f"redis on @{args.base}", True, worktree(args.base)))
    latencies: dict[str, list[float]] = {name: [] for name, _, _ in sides}
    errors = dict.fromkeys(latencies, 0)
    stages: dict[str, dict] = {}
    script_us: float | None = None
    with tempfile.TemporaryDirectory() as tmpdir, run_standin(subprocess_mode=True) as upstream, \
            RedisServer() as redis_server:
        tmp = Path(tmpdir)
        processes = []
        try:
            targets = {}
            for i, (name, on, tree) in enumerate(sides):
                process, root, key = _gateway(tmp, f"g{i}", upstream, redis_server.url if on else None, tree)
                processes.append(process)
                targets[name] = (f"{root}/v1/chat/completions", key)
            for _ in range(args.rounds):
                for name, (url, key) in targets.items():
                    result = asyncio.run(run_load(url, BODY, {"Authorization": f"Bearer {key}"}, concurrency=1,
                                                  requests=args.requests, warmup=50))
                    latencies[name] += result.latencies_ms
                    errors[name] += result.errors
            for name, (url, _) in targets.items():  # where the time goes: the gateway's own stage profile
                stages[name] = _stages(url.split("/v1")[0])
            script_us = _script_us(redis_server.url)
            for name, on, _ in sides:
                if on:
                    health = httpx.get(targets[name][0].split("/v1")[0] + "/health", timeout=10).json()
                    assert health["shared_state"]["status"] == "shared", (name, health["shared_state"])
        finally:
            for process in processes:
                stop(process)
    rows = {name: {"p50_ms": statistics.median(values), "p90_ms": statistics.quantiles(values, n=10)[-1],
                   "requests": len(values), "errors": errors[name], "stages_p50_us": stages.get(name, {})}
            for name, values in latencies.items()}
    delta = rows["redis on"]["p50_ms"] - rows["redis off"]["p50_ms"]
    payload = {"machine": machine(), "requests_per_round": args.requests, "rounds": args.rounds,
               "concurrency": 1, "results": rows, "p50_delta_ms": delta, "target_p50_delta_ms": 0.3,
               "script_us_per_call_in_redis": script_us}
    if args.base:
        payload["base"] = args.base
        payload["base_p50_delta_ms"] = rows[sides[2][0]]["p50_ms"] - rows["redis off"]["p50_ms"]
    print(f"machine: {payload['machine']['cpu_model']} ({payload['machine']['cpus']} CPUs)")
    width = max(len(name) for name in rows)
    print(f"{'target':<{width}} {'p50 ms':>8} {'p90 ms':>8} {'requests':>9} {'errors':>7}")
    for name, row in rows.items():
        print(f"{name:<{width}} {row['p50_ms']:>8.3f} {row['p90_ms']:>8.3f} {row['requests']:>9} "
              f"{row['errors']:>7}")
    print(f"Redis on - off, p50: {delta:+.3f} ms (target <= +0.3 ms)")
    print(f"the admission script inside Redis: {script_us} us a call (INFO commandstats); the rest of the reserve "
          "stage is the round trip: the socket, the other process's turn on the CPUs, the reply's parse")
    for stage in ("reserve", "admit", "finish"):
        print(f"stage {stage} p50 us: " + ", ".join(f"{name} {row['stages_p50_us'].get(stage, float('nan')):.0f}"
                                                      for name, row in rows.items()))
    if args.base:
        print(f"Redis on @{args.base} - off, p50: {payload['base_p50_delta_ms']:+.3f} ms (before)")
    print(f"saved {store.save('redis_overhead', payload, out=args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
