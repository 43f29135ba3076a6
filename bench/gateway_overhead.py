"""Gateway overhead: latency added and peak throughput, against the upstream direct and LiteLLM's proxy.

One run, one machine, four targets on the same stand-in OpenAI upstream (127.0.0.1):
  (a) the upstream direct, (b) this gateway on an `engine`-kind backend, (c) this gateway on a
  `litellm`-kind backend, (d) LiteLLM's own proxy (`litellm[proxy]`, in its own venv so its
  pinned dependencies cannot disturb ours). Ledger logging is on (SQLite) for the gateway.

    python bench/gateway_overhead.py [--quick] [--litellm-venv .venv-bench]

Prints a table and writes bench/results/gateway_overhead.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import LoadResult, run_load

ROOT = Path(__file__).resolve().parent.parent
# The newest litellm whose `proxy` extra resolves from the package registry here (1.109+ pins proxy
# packages that are not published there); close to the gateway's own litellm.
LITELLM_PROXY_VERSION = "1.108.0"
KEY = "sk-bench"
BODY = json.dumps({"model": "MODEL", "messages": [{"role": "user", "content": "Say something short please"}],
                   "max_tokens": 16})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_http(url: str, timeout: float, headers: dict | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(url, timeout=2, headers=headers).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{url} not ready after {timeout:.0f} s")


def start(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, env={**os.environ, **env}, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            cwd=ROOT, start_new_session=True)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def measure(url: str, model: str, args: argparse.Namespace) -> dict:
    body = BODY.replace("MODEL", model).encode()
    headers = {"Authorization": f"Bearer {KEY}"}
    latency: LoadResult = asyncio.run(run_load(url, body, headers, concurrency=1, requests=args.latency_requests,
                                               warmup=50))
    peak = {}
    for concurrency in args.concurrency:
        result = asyncio.run(run_load(url, body, headers, concurrency=concurrency, seconds=args.seconds,
                                      warmup=20))
        peak[concurrency] = {"rps": result.rps, "errors": result.errors, "p50_ms": result.p50}
    return {"p50_ms": latency.p50, "p99_ms": latency.percentile(99), "latency_errors": latency.errors,
            "throughput": peak, "peak_rps": max(v["rps"] for v in peak.values())}


def ensure_litellm_proxy(venv: Path) -> Path | None:
    exe = venv / "bin" / "litellm"
    if exe.exists():
        return exe
    version = LITELLM_PROXY_VERSION
    print(f"creating {venv} with litellm[proxy]=={version} (one-off)…", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    done = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"litellm[proxy]=={version}"], check=False)
    return exe if done.returncode == 0 and exe.exists() else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latency-requests", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=5.0, help="duration of each throughput run")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--litellm-venv", type=Path, default=ROOT / ".venv-bench")
    parser.add_argument("--skip-litellm-proxy", action="store_true")
    parser.add_argument("--quick", action="store_true", help="a smoke run: few requests, short runs")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gateway_overhead.json")
    args = parser.parse_args()
    if args.quick:
        args.latency_requests, args.seconds, args.concurrency = 100, 1.0, [8]

    tmp = Path(tempfile.mkdtemp(prefix="sy-bench-"))
    processes: list[subprocess.Popen] = []
    results: dict[str, dict] = {}
    try:
        up_port = free_port()
        processes.append(start([sys.executable, "-m", "gateway.testing.standin", "--port", str(up_port),
                                "--engine-extension"], {}, tmp / "standin.log"))
        upstream = f"http://127.0.0.1:{up_port}/v1"
        wait_http(upstream.removesuffix("/v1") + "/_control", 60)

        gw_port = free_port()
        policy = tmp / "policy.yaml"
        policy.write_text(f"""
backends:
  engine_standin:
    kind: engine
    model: standin
    api_base: {upstream}
  litellm_standin:
    kind: litellm
    model: openai/gpt-4o-mini
    api_base: {upstream}
    api_key_env: BENCH_UPSTREAM_KEY
routes:
  via-engine:
    strategy: fixed
    backend: engine_standin
  via-litellm:
    strategy: fixed
    backend: litellm_standin
  via-router:
    strategy: difficulty
    easy: engine_standin
    hard: engine_standin
""")
        processes.append(start([sys.executable, "-m", "gateway.cli", "serve", "--policy", str(policy), "--port",
                                str(gw_port), "--database-url", f"sqlite:///{tmp / 'ledger.db'}",
                                "--log-level", "warning"],
                               {"SWITCHYARD_MASTER_KEY": KEY, "SWITCHYARD_DATA_DIR": str(tmp / "data"),
                                "BENCH_UPSTREAM_KEY": "sk-upstream"}, tmp / "gateway.log"))
        gateway = f"http://127.0.0.1:{gw_port}/v1"
        wait_http(gateway.removesuffix("/v1") + "/health", 180)

        proxy_url = None
        if not args.skip_litellm_proxy:
            exe = ensure_litellm_proxy(args.litellm_venv)
            if exe is None:
                print("LiteLLM proxy unavailable: (d) skipped")
            else:
                lp_port = free_port()
                config = tmp / "litellm.yaml"
                config.write_text(f"""
model_list:
  - model_name: gpt-4o-mini
    litellm_params:
      model: openai/gpt-4o-mini
      api_base: {upstream}
      api_key: sk-upstream
general_settings:
  master_key: {KEY}
litellm_settings:
  telemetry: false
""")
                processes.append(start([str(exe), "--config", str(config), "--port", str(lp_port), "--host",
                                        "127.0.0.1", "--num_workers", "1"],
                                       {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"},
                                       tmp / "litellm-proxy.log"))
                proxy_url = f"http://127.0.0.1:{lp_port}/v1"
                wait_http(proxy_url.removesuffix("/v1") + "/health/liveliness", 300)

        targets = [("upstream direct", upstream, "standin"),
                   ("gateway, engine backend", gateway, "via-engine"),
                   ("gateway, engine backend, difficulty router on", gateway, "via-router"),
                   ("gateway, litellm backend", gateway, "via-litellm")]
        if proxy_url:
            targets.append(("LiteLLM proxy", proxy_url, "gpt-4o-mini"))
        for name, base, model in targets:
            print(f"measuring {name}…", flush=True)
            results[name] = measure(base + "/chat/completions", model, args)
    finally:
        for process in reversed(processes):
            stop(process)

    direct = results["upstream direct"]
    for name, r in results.items():
        r["overhead_p50_ms"] = r["p50_ms"] - direct["p50_ms"]
        r["overhead_p99_ms"] = r["p99_ms"] - direct["p99_ms"]
    proxy = results.get("LiteLLM proxy")
    print()
    print("| target | p50 ms | p99 ms | overhead p50 ms | overhead p99 ms | peak RPS | × LiteLLM proxy RPS |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        ratio = f"{r['peak_rps'] / proxy['peak_rps']:.1f}×" if proxy else "n/a"
        print(f"| {name} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['overhead_p50_ms']:.2f} | "
              f"{r['overhead_p99_ms']:.2f} | {r['peak_rps']:.0f} | {ratio} |")
    payload = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
               "settings": {"latency_requests": args.latency_requests, "seconds": args.seconds,
                            "concurrency": args.concurrency, "ledger": "sqlite, on"},
               "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"\nsaved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
