"""The `kind: litellm` backend call alone, full litellm call against the fast path, side by side in one run.

Against the stand-in upstream (its own process, 127.0.0.1), one LiteLLMBackend with `fast_path: false` (every
call through `litellm.acompletion`) and one with the default fast path (litellm's request translation, our own
pooled aiohttp session: gateway/backends/openai_wire_fast.py), in alternated rounds; and the floor: one bare
aiohttp POST per call to the same upstream. Per call, concurrency 1: wall p50/p99 and this process's CPU ms
(the upstream's CPU is not counted). `--profile` adds where the full litellm call's CPU goes (cProfile,
exclusive time by area), the breakdown docs/api-path.md quotes.

    python -m bench.litellm_path [--calls 400] [--rounds 3] [--profile]

Prints a table and files the run in bench/results/litellm_path/<machine>.json. The machine is shared: compare the ratios.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import os
import platform
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import aiohttp
import orjson

from bench import store
from bench.machine_info import cpu_model, free_port
from bench.servers import start, stop, wait_port
from gateway.backends.litellm_backend import LiteLLMBackend
from gateway.policy import BackendSpec

ROOT = Path(__file__).resolve().parent.parent

KEY_ENV = "BENCH_LITELLM_PATH_KEY"
CHAT = {"model": "bench", "messages": [{"role": "user", "content": "Say something short please"}], "max_tokens": 16}

# Exclusive CPU time by area: the first pattern found in a function's file (or, for a C builtin, its caller's).
AREAS = [
    ("litellm: logging objects, callbacks, success handlers", ("litellm_logging", "logging_worker", "logging_utils",
                                                               "litellm/integrations", "custom_logger")),
    ("litellm: cost calculation and response metadata", ("cost_calculator", "llm_cost_calc", "response_metadata",
                                                          "token_counter", "model_prices")),
    ("litellm: response objects (ModelResponse…)", ("convert_dict_to_response", "litellm/types/",
                                                     "llm_response_utils")),
    ("openai SDK: request building, pydantic response parsing", ("site-packages/openai/",)),
    ("pydantic", ("pydantic",)),
    ("litellm: request path (main, utils, provider config, get_llm_provider)", ("/litellm/",)),
    ("HTTP: httpx, aiohttp transport", ("/httpx/", "/httpx2/", "/httpcore/", "/aiohttp/", "/yarl/", "/multidict/")),
    ("asyncio event loop and sockets", ("asyncio", "selectors", "socket", "ssl")),
    ("the gateway's own code", ("/gateway/",)),
]


def start_standin() -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = start([sys.executable, "-m", "gateway.testing.standin", "--port", str(port)], None,
                    Path(tempfile.gettempdir()) / f"sy-litellm-path-standin-{port}.log")
    try:
        wait_port(port, 60, process)
    except (TimeoutError, RuntimeError):
        stop(process)
        raise
    return process, f"http://127.0.0.1:{port}/v1"


async def _time_calls(call, calls: int) -> dict:
    """Per-call wall times and this process's CPU time per call."""
    walls: list[float] = []
    cpu0 = time.process_time()
    for _ in range(calls):
        t0 = time.perf_counter()
        await call()
        walls.append(time.perf_counter() - t0)
    cpu = time.process_time() - cpu0
    walls.sort()
    return {"p50_ms": statistics.median(walls) * 1e3, "p99_ms": walls[int(len(walls) * 0.99) - 1] * 1e3,
            "cpu_ms_per_call": cpu / calls * 1e3, "calls": calls}


def _drain(backend: LiteLLMBackend):
    async def call() -> None:
        async with contextlib.aclosing(backend.stream(dict(CHAT), "chat")) as chunks:
            async for _ in chunks:
                pass
    return call


def _bare(session: aiohttp.ClientSession, url: str):
    body = orjson.dumps({**CHAT, "model": "gpt-4o-mini"})

    async def call() -> None:
        async with session.post(url + "/chat/completions", data=body,
                                headers={"content-type": "application/json", "authorization": "Bearer sk-bench"}) as r:
            orjson.loads(await r.read())
    return call


_STDLIB = os.path.dirname(os.__file__)


def _owner(stats: dict, func: tuple) -> str:
    """The file a function's time is charged to: its own, or for a C builtin or a general stdlib helper (typing,
    abc, copy, threading…) the file of its main caller, up the stack until one is neither."""
    for _ in range(8):
        where = func[0]
        helper = where == "~" or where.startswith("<frozen") or (
            where.startswith(_STDLIB) and "asyncio" not in where and "selectors" not in where)
        callers = stats[func][4] if func in stats else None
        if not helper or not callers:
            return where
        func = max(callers.items(), key=lambda kv: kv[1][2])[0]
    return func[0]


def categorize(stats: pstats.Stats) -> list[tuple[str, float]]:
    """Exclusive time by area (C builtins such as pydantic-core's validators count in their caller's area)."""
    totals: dict[str, float] = {}
    raw = stats.stats  # type: ignore[attr-defined]
    for func, (_cc, _nc, tt, _ct, _callers) in raw.items():
        where = _owner(raw, func)
        area = next((name for name, patterns in AREAS if any(p in where for p in patterns)), "other")
        totals[area] = totals.get(area, 0.0) + tt
    return sorted(totals.items(), key=lambda kv: -kv[1])


async def profile_full_call(url: str, calls: int) -> dict:
    backend = LiteLLMBackend(_spec(url, fast=False))
    for _ in range(30):
        await backend.complete(dict(CHAT), "chat")
    profiler = cProfile.Profile(time.process_time)  # CPU, not waiting on the upstream
    profiler.enable()
    for _ in range(calls):
        await backend.complete(dict(CHAT), "chat")
    profiler.disable()
    await backend.aclose()
    areas = categorize(pstats.Stats(profiler))
    total = sum(t for _, t in areas)
    return {"calls": calls, "profiled_ms_per_call": total / calls * 1e3,
            "areas": [{"area": a, "ms_per_call": t / calls * 1e3, "share": t / total} for a, t in areas]}


def _spec(url: str, fast: bool) -> BackendSpec:
    return BackendSpec(name="fast" if fast else "full", kind="litellm", model="openai/gpt-4o-mini", api_base=url,
                       api_key_env=KEY_ENV, fast_path=fast)


async def measure(url: str, calls: int, rounds: int) -> dict[str, list[dict]]:
    full, fast = LiteLLMBackend(_spec(url, False)), LiteLLMBackend(_spec(url, True))
    assert fast._fast is not None and full._fast is None
    session = aiohttp.ClientSession()
    targets = {
        "bare aiohttp POST (floor)": _bare(session, url),
        "litellm call, fast_path: false": lambda: full.complete(dict(CHAT), "chat"),
        "fast path (default)": lambda: fast.complete(dict(CHAT), "chat"),
        "litellm call, fast_path: false, stream": _drain(full),
        "fast path (default), stream": _drain(fast),
    }
    for call in targets.values():  # warm-up: imports, pools, litellm's first-call set-up
        for _ in range(30):
            await call()
    results: dict[str, list[dict]] = {name: [] for name in targets}
    for r in range(rounds):
        order = list(targets.items()) if r % 2 == 0 else list(reversed(targets.items()))
        for name, call in order:
            results[name].append(await _time_calls(call, calls))
    await session.close()
    await full.aclose()
    await fast.aclose()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=400, help="calls per target per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="also profile the full litellm call")
    parser.add_argument("--out", type=Path, default=None,
                        help="write this JSON file instead of filing the run in bench/results/litellm_path/<machine>.json")
    parser.add_argument("--label", default="", help="a name for this run in the results history")
    args = parser.parse_args()
    os.environ[KEY_ENV] = "sk-bench"
    load_before = os.getloadavg()
    process, url = start_standin()
    try:
        rounds = asyncio.run(measure(url, args.calls, args.rounds))
        profile = asyncio.run(profile_full_call(url, args.calls)) if args.profile else None
    finally:
        stop(process, timeout=10)
    summary = {name: {k: statistics.median(r[k] for r in runs) for k in ("p50_ms", "p99_ms", "cpu_ms_per_call")}
               for name, runs in rounds.items()}
    floor = summary["bare aiohttp POST (floor)"]
    print(f"\n{cpu_model()}, {os.cpu_count()} CPUs, load {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f} "
          f"(shared machine); {args.rounds} alternated rounds × {args.calls} calls, concurrency 1\n")
    print("| backend call | p50 ms | p99 ms | CPU ms/call | p50 over the floor ms | × fast path CPU |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, s in summary.items():
        fast_name = "fast path (default), stream" if name.endswith("stream") else "fast path (default)"
        ratio = s["cpu_ms_per_call"] / summary[fast_name]["cpu_ms_per_call"]
        print(f"| {name} | {s['p50_ms']:.2f} | {s['p99_ms']:.2f} | {s['cpu_ms_per_call']:.2f} | "
              f"{s['p50_ms'] - floor['p50_ms']:.2f} | {ratio:.1f}× |")
    if profile:
        print(f"\nWhere a full litellm call's CPU goes (cProfile, {profile['profiled_ms_per_call']:.1f} ms/call "
              "profiled, exclusive time):\n")
        print("| area | ms/call | share |")
        print("|---|---:|---:|")
        for a in profile["areas"]:
            print(f"| {a['area']} | {a['ms_per_call']:.2f} | {a['share']:.0%} |")
    payload = {"machine": {"cpu_model": cpu_model(), "cpus": os.cpu_count(), "platform": platform.platform(),
                           "load_before": load_before[0], "load_after": os.getloadavg()[0], "shared": True},
               "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "settings": {"calls": args.calls, "rounds": args.rounds, "model": "openai/gpt-4o-mini",
                            "upstream": "gateway.testing.standin, own process"},
               "summary": summary, "rounds": rounds, "profile_full_call": profile}
    print(f"\nsaved {store.save('litellm_path', payload, label=args.label, out=args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
