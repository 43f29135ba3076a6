"""Gateway overhead: latency added and peak throughput, against the upstream direct and LiteLLM's proxy.

One run, one machine, four targets on the same stand-in OpenAI upstream (127.0.0.1):
  (a) the upstream direct, (b) this gateway on an `engine`-kind backend, (c) this gateway on a
  `litellm`-kind backend, (d) LiteLLM's own proxy (`litellm[proxy]`, in its own venv so its
  pinned dependencies cannot disturb ours). Ledger logging is on (SQLite) for the gateway.

    python -m bench.gateway_overhead [--quick] [--litellm-venv .venv-bench]
    python -m bench.gateway_overhead --render-docs   # only rewrite docs/benchmarks.md's table from the JSON

Prints a table and files the run in bench/results/gateway_overhead/<machine>.json (bench/store.py; `--out FILE`
writes that file instead). The gateway runs with
SWITCHYARD_STAGE_PROFILE=1 (gateway/stage_profile.py): for each gateway target the concurrency-1 run's
per-stage times (auth, body, route, reserve, admit, send, upstream, dispatch, finish, respond) are printed
and saved beside the latencies, so a missed target says where the time goes. The run is compared with the
previous run filed for this machine (same CPU model and count): how far each path moved. The
table in docs/benchmarks.md between the `gateway-overhead` markers is written from the JSON, never typed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench import store
from bench.loadgen import LoadResult, run_load
from bench.machine_info import free_port, machine
from bench.servers import start, stop, wait_http

ROOT = Path(__file__).resolve().parent.parent
# The newest litellm whose `proxy` extra resolves from the package registry here (1.109+ pins proxy
# packages that are not published there); close to the gateway's own litellm.
LITELLM_PROXY_VERSION = "1.108.0"
KEY = "sk-bench"
BENCH = "gateway_overhead"
BODY = json.dumps({"model": "MODEL", "messages": [{"role": "user", "content": "Say something short please"}],
                   "max_tokens": 16})


def stage_profile(gateway_root: str, reset: bool) -> dict:
    """The gateway's per-route stage summary (GET /admin/stage-profile), cleared after reading if `reset`."""
    response = httpx.get(f"{gateway_root}/admin/stage-profile", params={"reset": "1" if reset else "0"},
                         headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    response.raise_for_status()
    return response.json()


DISTINCT = "distinct prompts"  # a target name's suffix: every request's prompt differs (no score cache hit)
_TOPICS = ("the weather", "a recipe", "tax law", "a proof", "jazz", "compilers", "tides", "chess", "bees", "rust")


def bodies(model: str, distinct: bool) -> bytes | list[bytes]:
    """The request body (the same every time), or 2,000 bodies whose prompts all differ, of the same length."""
    if not distinct:
        return BODY.replace("MODEL", model).encode()
    return [json.dumps({"model": model, "max_tokens": 16, "messages": [
        {"role": "user", "content": f"Say something short about {_TOPICS[i % 10]}, note {i:05d}"}]}).encode()
        for i in range(2000)]


def measure(url: str, model: str, args: argparse.Namespace, gateway_root: str | None = None,
            distinct: bool = False) -> dict:
    body = bodies(model, distinct)
    headers = {"Authorization": f"Bearer {KEY}"}
    if gateway_root:
        stage_profile(gateway_root, reset=True)  # warm-ups and earlier targets are not in this target's stages
    latency: LoadResult = asyncio.run(run_load(url, body, headers, concurrency=1, requests=args.latency_requests,
                                               warmup=50))
    stages = stage_profile(gateway_root, reset=True).get(model) if gateway_root else None
    peak = {}
    for concurrency in args.concurrency:
        result = asyncio.run(run_load(url, body, headers, concurrency=concurrency, seconds=args.seconds,
                                      warmup=20))
        peak[concurrency] = {"rps": result.rps, "errors": result.errors, "p50_ms": result.p50}
    result = {"p50_ms": latency.p50, "p99_ms": latency.percentile(99), "latency_errors": latency.errors,
              "throughput": peak, "peak_rps": max(v["rps"] for v in peak.values())}
    if stages:
        result["stages_us"] = stages["stages_us"]  # concurrency 1, warm-up included (50 of the requests)
    return result


STAGE_ORDER = ["edge", "auth", "body", "route", "reserve", "admit", "send", "upstream", "dispatch", "finish",
               "respond", "overhead"]


def stage_table(results: dict) -> list[str]:
    """Per-stage p50 (µs) of each gateway target at concurrency 1."""
    profiled = {name: r["stages_us"] for name, r in results.items() if r.get("stages_us")}
    if not profiled:
        return []
    stages = [s for s in STAGE_ORDER if any(s in st for st in profiled.values())]
    lines = ["| stage p50 µs | " + " | ".join(profiled) + " |", "|---|" + "---:|" * len(profiled)]
    for stage in stages:
        cells = [f"{st[stage]['p50']:.0f}" if stage in st else "" for st in profiled.values()]
        lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    return lines


def drift(previous: dict | None, current: dict) -> list[str]:
    """How far each path's overhead moved since the last run on the same machine (empty: no comparable run)."""
    if not previous or previous.get("machine", {}).get("cpu_model") != current["machine"]["cpu_model"] \
            or previous.get("machine", {}).get("cpus") != current["machine"]["cpus"]:
        return []
    lines = [(f"| vs previous run ({previous.get('finished_at', 'undated')}) | overhead p50 ms then → now | "
             "peak RPS then → now |"), "|---|---:|---:|"]
    for name, now in current["results"].items():
        then = previous.get("results", {}).get(name)
        if then is None or name == "upstream direct":
            continue
        lines.append(f"| {name} | {then['overhead_p50_ms']:.2f} → {now['overhead_p50_ms']:.2f} "
                     f"({now['overhead_p50_ms'] - then['overhead_p50_ms']:+.2f}) | "
                     f"{then['peak_rps']:.0f} → {now['peak_rps']:.0f} ({now['peak_rps'] / then['peak_rps'] - 1:+.0%}) |")
    return lines


def headline_table(payload: dict) -> list[str]:
    results = payload["results"]
    proxy = results.get("LiteLLM proxy")
    lines = ["| target | p50 ms | p99 ms | overhead p50 ms | overhead p99 ms | peak RPS | × LiteLLM proxy RPS |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        ratio = f"{r['peak_rps'] / proxy['peak_rps']:.1f}×" if proxy else "n/a"
        lines.append(f"| {name} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['overhead_p50_ms']:.2f} | "
                     f"{r['overhead_p99_ms']:.2f} | {r['peak_rps']:.0f} | {ratio} |")
    return lines


DOCS = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- gateway-overhead: begin (bench/gateway_overhead.py --render-docs) -->", \
    "<!-- gateway-overhead: end -->"


def render_docs(payload: dict, docs: Path = DOCS) -> bool:
    """Rewrite the block between the markers in docs/benchmarks.md from `payload` (False: no markers there)."""
    text = docs.read_text()
    if BEGIN not in text or END not in text:
        return False
    m = payload["machine"]
    block = [BEGIN, "", (f"Latest run: {payload.get('finished_at', 'undated')}, {m.get('cpu_model') or 'unknown CPU'} "
             f"({m['cpus']} CPUs); latency at concurrency 1 ({payload['settings']['latency_requests']} requests), "
             f"peak over concurrency {', '.join(map(str, payload['settings']['concurrency']))}; ledger "
             f"{payload['settings']['ledger']}."), "", *headline_table(payload)]
    stages = stage_table(payload["results"])
    if stages:
        block += ["", ("Where the gateway's time goes (stage p50 in µs at concurrency 1; `upstream` is the HTTP "
                  "exchange as the gateway sees it; gateway/stage_profile.py):"), "", *stages]
    block += ["", END]
    head, rest = text.split(BEGIN, 1)
    docs.write_text(head + "\n".join(block) + rest.split(END, 1)[1])
    return True


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
    parser.add_argument("--out", type=Path, default=None,
                        help="write this JSON file (and compare with it) instead of this machine's results record")
    parser.add_argument("--label", default="", help="a name for this run in the results history (--quick: 'quick')")
    parser.add_argument("--render-docs", action="store_true",
                        help="only rewrite docs/benchmarks.md's gateway-overhead table from --out (default: the "
                             "latest full run on this machine), then exit")
    args = parser.parse_args()
    label = args.label or ("quick" if args.quick else "")
    if args.render_docs:
        latest = json.loads(args.out.read_text()) if args.out else store.latest(BENCH, label="")
        if latest is None:
            print(f"no full {BENCH} run filed for {machine()['slug']}", file=sys.stderr)
            return 1
        if not render_docs(latest):
            print(f"no gateway-overhead markers in {DOCS}", file=sys.stderr)
            return 1
        print(f"rewrote the gateway-overhead table in {DOCS}")
        return 0
    if args.out is not None:
        previous = json.loads(args.out.read_text()) if args.out.exists() else None
    else:
        previous = store.latest(BENCH, label=label)
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
                                "BENCH_UPSTREAM_KEY": "sk-upstream", "SWITCHYARD_STAGE_PROFILE": "1"},
                               tmp / "gateway.log"))
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
                   (f"gateway, engine backend, difficulty router on, {DISTINCT}", gateway, "via-router"),
                   ("gateway, litellm backend", gateway, "via-litellm")]
        if proxy_url:
            targets.append(("LiteLLM proxy", proxy_url, "gpt-4o-mini"))
        for name, base, model in targets:
            print(f"measuring {name}…", flush=True)
            root = gateway.removesuffix("/v1") if base == gateway else None
            results[name] = measure(base + "/chat/completions", model, args, gateway_root=root,
                                    distinct=name.endswith(DISTINCT))
    finally:
        for process in reversed(processes):
            stop(process)

    direct = results["upstream direct"]
    for name, r in results.items():
        r["overhead_p50_ms"] = r["p50_ms"] - direct["p50_ms"]
        r["overhead_p99_ms"] = r["p99_ms"] - direct["p99_ms"]
    payload = {"machine": machine(), "finished_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "settings": {"latency_requests": args.latency_requests, "seconds": args.seconds,
                            "concurrency": args.concurrency, "ledger": "sqlite, on", "stage_profile": "on"},
               "results": results}
    print()
    print("\n".join(headline_table(payload)))
    for table in (stage_table(results), drift(previous, payload)):
        if table:
            print()
            print("\n".join(table))
    if previous and not drift(previous, payload):
        print("\n(previous run was on another machine: no drift comparison)")
    print(f"\nsaved {store.save(BENCH, payload, label=label, out=args.out)}")
    if not args.quick and args.out is None and not label and render_docs(payload):
        print(f"rewrote the gateway-overhead table in {DOCS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
