"""Soak: a real gateway holds 1,000 concurrent streams, then serves 200,000 short requests; its memory must not grow.

One run on 127.0.0.1: the stand-in upstream (its own process, so its memory and CPU are not the gateway's),
`switchyard serve` on an `engine`-kind backend over it with the SQLite ledger on, and this process as the client.

  1. warm-up: 2,000 short requests;
  2. streams: N streams at once (stand-in paced so each lasts ~10 s); every one must end with all its tokens
     and `[DONE]`; the most open at one time is reported;
  3. short requests: R requests at concurrency 8, in checkpoints; at each one, a latency probe (200 requests
     one at a time through the gateway, and 200 straight to the stand-in: the difference is the overhead).

The gateway's RSS is sampled every 0.5 s throughout. Growth is measured from the end of warm-up (streams done and
the first 10% of the short requests served) to the end, and to the peak. Afterwards the ledger must hold one row
per request sent. Prints a table, files bench/results/soak/<machine>.json, .md and .png (RSS and latency over
time).

    .venv/bin/python -m bench.soak [--streams 1000] [--requests 200000] [--quick]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import store
from bench.gateway_overhead import KEY
from bench.loadgen import build_request, run_load
from bench.machine_info import cpu_model, free_port
from bench.servers import start, stop, wait_http

ROOT = Path(__file__).resolve().parent.parent
STREAM_TOKENS = 20
STREAM_TOKEN_DELAY_MS = 500.0
PROBE_REQUESTS = 200
CONCURRENCY = 8
GROWTH_TARGET = 0.10


def rss_mib(pid: int) -> float:
    """Resident set of a process and its children (from /proc), MiB."""
    total = 0
    for p in [pid, *_children(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def _children(pid: int) -> list[int]:
    try:
        kids = [int(k) for t in Path(f"/proc/{pid}/task").iterdir()
                for k in (t / "children").read_text().split()]
    except OSError:
        return []
    return kids + [g for k in kids for g in _children(k)]


class RssSampler(threading.Thread):
    def __init__(self, pid: int, t0: float, every_s: float = 0.5):
        super().__init__(daemon=True)
        self.pid, self.t0, self.every_s = pid, t0, every_s
        self.samples: list[tuple[float, float]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            self.samples.append((time.perf_counter() - self.t0, rss_mib(self.pid)))
            self.halt.wait(self.every_s)

    def now(self) -> float:
        return rss_mib(self.pid)


# ---- phase 2: concurrent streams


@dataclass(slots=True)
class StreamTally:
    open_now: int = 0
    most_open: int = 0
    complete: int = 0
    failed: list[str] = field(default_factory=list)


async def one_stream(url: str, tally: StreamTally, timeout_s: float) -> None:
    body = json.dumps({"model": "soak", "stream": True, "max_tokens": STREAM_TOKENS,
                       "messages": [{"role": "user", "content": "stream please"}]}).encode()
    host, port, raw = build_request(url, body, {"Authorization": f"Bearer {KEY}"})
    writer = None
    opened = False
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(raw)
            head = await reader.readuntil(b"\r\n\r\n")
            if head[9:12] != b"200":
                raise RuntimeError(f"status {head[9:12].decode()}")
            tally.open_now += 1
            opened = True
            tally.most_open = max(tally.most_open, tally.open_now)
            text = bytearray()
            while True:  # chunked transfer: size line, data, CRLF; a 0-size chunk ends it
                size = int((await reader.readuntil(b"\r\n")).strip(), 16)
                chunk = await reader.readexactly(size + 2)
                if size == 0:
                    break
                text += chunk[:-2]
        tokens = len(set(re.findall(rb"tok\d+", text)))
        if tokens != STREAM_TOKENS or not text.rstrip().endswith(b"data: [DONE]"):
            raise RuntimeError(f"{tokens} tokens, ends {bytes(text[-40:])!r}")
        tally.complete += 1
    except Exception as e:  # noqa: BLE001 - every failure is counted and reported
        tally.failed.append(f"{type(e).__name__}: {e}"[:200])
    finally:
        if opened:
            tally.open_now -= 1
        if writer is not None:
            writer.close()


async def hold_streams(url: str, streams: int) -> tuple[StreamTally, float]:
    tally = StreamTally()
    t0 = time.perf_counter()
    timeout = 60 + STREAM_TOKENS * STREAM_TOKEN_DELAY_MS / 1000 * 4
    await asyncio.gather(*(one_stream(url, tally, timeout) for _ in range(streams)))
    return tally, time.perf_counter() - t0


# ---- phase 3: short requests with latency probes


def short_body(model: str) -> bytes:
    return json.dumps({"model": model, "max_tokens": 8,
                       "messages": [{"role": "user", "content": "Say something short please"}]}).encode()


def probe(url: str, model: str) -> dict:
    """p50/p99 of PROBE_REQUESTS one at a time (no queueing: the latency the request itself pays)."""
    r = asyncio.run(run_load(url, short_body(model), {"Authorization": f"Bearer {KEY}"}, concurrency=1,
                             requests=PROBE_REQUESTS, warmup=5))
    return {"p50_ms": r.p50, "p99_ms": r.percentile(99), "ok": len(r.latencies_ms), "errors": r.errors}


def checkpoint_sizes(total: int, checkpoints: int) -> list[int]:
    base, extra = divmod(total, checkpoints)
    return [base + (1 if i < extra else 0) for i in range(checkpoints) if base or i < extra]


def run_short(gateway: str, upstream: str, sampler: RssSampler, total: int, checkpoints: int,
              t0: float) -> tuple[list[dict], int]:
    """Checkpoint rows, and how many requests went to the gateway."""
    rows = []
    sent = 0
    for i, n in enumerate(checkpoint_sizes(total, checkpoints)):
        load = asyncio.run(run_load(gateway, short_body("soak"), {"Authorization": f"Bearer {KEY}"},
                                    concurrency=CONCURRENCY, requests=n, warmup=0))
        via, direct = probe(gateway, "soak"), probe(upstream, "standin")
        sent += n + PROBE_REQUESTS + 5  # + the probe's warm-up
        rows.append({"t_s": time.perf_counter() - t0, "done": sum(r["requests"] for r in rows) + n,
                     "requests": n, "rps": load.rps, "errors": load.errors, "p50_ms": load.p50,
                     "p99_ms": load.percentile(99), "rss_mib": sampler.now(),
                     "probe_gateway": via, "probe_direct": direct,
                     "overhead_p50_ms": via["p50_ms"] - direct["p50_ms"],
                     "overhead_p99_ms": via["p99_ms"] - direct["p99_ms"]})
        r = rows[-1]
        print(f"  {r['done']:>7} requests  {r['rps']:7.0f} rps  errors {r['errors']}  RSS {r['rss_mib']:7.1f} MiB  "
              f"overhead p50 {r['overhead_p50_ms']:.2f} ms p99 {r['overhead_p99_ms']:.2f} ms", flush=True)
        if i == 0:
            print(f"  ({n / load.seconds:.0f} requests/s: ~{total / max(load.rps, 1) / 60:.1f} min for {total})",
                  flush=True)
    return rows, sent


# ---- results


def ledger_rows(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT count(*) FROM requests").fetchone()[0]


def summarise(rows: list[dict], samples: list[tuple[float, float]], warm_t: float) -> dict:
    after = [rss for t, rss in samples if t >= warm_t]
    warm = after[0] if after else float("nan")
    end = statistics.median(after[-5:]) if after else float("nan")  # the last 2.5 s, not one sample
    overhead50 = [r["overhead_p50_ms"] for r in rows]
    overhead99 = [r["overhead_p99_ms"] for r in rows]
    return {"rss_start_mib": samples[0][1] if samples else None, "rss_warm_mib": warm, "rss_end_mib": end,
            "rss_peak_after_warm_mib": max(after) if after else None,
            "growth_end": end / warm - 1, "growth_peak": max(after) / warm - 1 if after else None,
            "overhead_p50_ms_median": statistics.median(overhead50) if rows else None,
            "overhead_p99_ms_median": statistics.median(overhead99) if rows else None,
            "overhead_p99_ms_max": max(overhead99) if rows else None,
            "short_rps_median": statistics.median(r["rps"] for r in rows) if rows else None,
            "short_errors": sum(r["errors"] for r in rows)}


def plot(path: Path, samples: list[tuple[float, float]], rows: list[dict], marks: dict[str, float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    top.plot([t for t, _ in samples], [r for _, r in samples], lw=1, color="tab:blue")
    top.set_ylabel("gateway RSS (MiB)")
    for label, t in marks.items():
        for ax in (top, bottom):
            ax.axvline(t, color="grey", ls=":", lw=1)
        top.annotate(label, (t, top.get_ylim()[1]), fontsize=8, rotation=90, va="top", ha="right")
    t = [r["t_s"] for r in rows]
    bottom.plot(t, [r["overhead_p50_ms"] for r in rows], "o-", ms=3, label="overhead p50 (1 at a time)")
    bottom.plot(t, [r["overhead_p99_ms"] for r in rows], "o-", ms=3, label="overhead p99 (1 at a time)")
    bottom.plot(t, [r["p50_ms"] for r in rows], "s--", ms=3, label=f"gateway p50 at concurrency {CONCURRENCY}")
    bottom.set_ylabel("ms")
    bottom.set_xlabel("seconds since start")
    bottom.legend(fontsize=8)
    fig.suptitle("Switchyard soak: RSS and latency over time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_policy(path: Path, upstream: str, streams: int) -> None:
    path.write_text(f"""
backends:
  standin:
    kind: engine
    model: standin
    api_base: {upstream}
    max_connections: {streams + 64}
routes:
  soak:
    strategy: fixed
    backend: standin
""")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--checkpoints", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 100 streams, 4,000 requests")
    parser.add_argument("--out", type=Path, default=None,
                        help="write this JSON file (and .md, .png beside it) instead of filing the run in "
                             "bench/results/soak/<machine>")
    parser.add_argument("--render", type=Path, metavar="JSON", help="redraw the table, .md and plot of a result")
    args = parser.parse_args()
    if args.render:
        report(json.loads(args.render.read_text()), args.render, write_json=False)
        return 0
    if args.quick:
        args.streams, args.requests, args.checkpoints = 100, 4000, 8

    tmp = Path(tempfile.mkdtemp(prefix="sy-soak-"))
    processes: list[subprocess.Popen] = []
    t0 = time.perf_counter()
    try:
        up_port = free_port()
        processes.append(start([sys.executable, "-m", "gateway.testing.standin", "--port", str(up_port),
                                "--engine-extension"], {}, tmp / "standin.log"))
        upstream = f"http://127.0.0.1:{up_port}/v1"
        wait_http(upstream.removesuffix("/v1") + "/_control", 60)
        gw_port = free_port()
        write_policy(tmp / "policy.yaml", upstream, args.streams)
        ledger = tmp / "ledger.db"
        gw = start([sys.executable, "-m", "gateway.cli", "serve", "--policy", str(tmp / "policy.yaml"),
                    "--port", str(gw_port), "--database-url", f"sqlite:///{ledger}", "--log-level", "warning"],
                   {"SWITCHYARD_MASTER_KEY": KEY, "SWITCHYARD_DATA_DIR": str(tmp / "data")}, tmp / "gateway.log")
        processes.append(gw)
        base = f"http://127.0.0.1:{gw_port}"
        wait_http(base + "/health", 180)
        gateway = base + "/v1/chat/completions"
        direct = upstream + "/chat/completions"
        sampler = RssSampler(gw.pid, t0)
        sampler.start()
        marks = {"warm-up": time.perf_counter() - t0}

        print(f"warm-up: 2,000 requests (gateway pid {gw.pid}, RSS {sampler.now():.1f} MiB)", flush=True)
        warm = asyncio.run(run_load(gateway, short_body("soak"), {"Authorization": f"Bearer {KEY}"},
                                    concurrency=CONCURRENCY, requests=2000, warmup=0))
        sent = 2000  # every request the gateway answers, error or not, is a ledger row

        marks["streams"] = time.perf_counter() - t0
        print(f"streams: {args.streams} at once, {STREAM_TOKENS} tokens {STREAM_TOKEN_DELAY_MS:.0f} ms apart",
              flush=True)
        import httpx

        httpx.post(upstream.removesuffix("/v1") + "/_control", json={"token_delay_ms": STREAM_TOKEN_DELAY_MS})
        tally, stream_s = asyncio.run(hold_streams(gateway, args.streams))
        httpx.post(upstream.removesuffix("/v1") + "/_control", json={"token_delay_ms": 0.0})
        sent += args.streams
        print(f"  {tally.complete}/{args.streams} complete, {tally.most_open} open at once, {stream_s:.1f} s, "
              f"RSS {sampler.now():.1f} MiB" + (f"; first failure: {tally.failed[0]}" if tally.failed else ""),
              flush=True)

        marks["short requests"] = time.perf_counter() - t0
        print(f"short requests: {args.requests:,} at concurrency {CONCURRENCY}, {args.checkpoints} checkpoints",
              flush=True)
        rows, short_sent = run_short(gateway, direct, sampler, args.requests, args.checkpoints, t0)
        sent += short_sent
        warm_index = max(0, -(-len(rows) // 10) - 1)  # the checkpoint that ends the first 10%
        warm_t = rows[warm_index]["t_s"] if rows else time.perf_counter() - t0
        marks["warm (growth from here)"] = warm_t
        time.sleep(2.0)  # the ledger writer's last batch
        sampler.halt.set()
        sampler.join()
    finally:
        for process in reversed(processes):
            stop(process)
    rows_in_ledger = ledger_rows(ledger)
    summary = summarise(rows, sampler.samples, warm_t)
    summary.update(warmup_errors=warm.errors, streams=args.streams, streams_complete=tally.complete,
                   streams_most_open=tally.most_open, stream_failures=tally.failed[:10], stream_seconds=stream_s, requests=args.requests,
                   requests_sent=sent, ledger_rows=rows_in_ledger, seconds=time.perf_counter() - t0)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=False).stdout.strip()
    payload = {"commit": f"{head} + working tree", "machine": {"cpus": os.cpu_count(), "cpu": cpu_model(),
                                                               "platform": platform.platform()},
               "settings": {"streams": args.streams, "stream_tokens": STREAM_TOKENS,
                            "stream_token_delay_ms": STREAM_TOKEN_DELAY_MS, "requests": args.requests,
                            "checkpoints": args.checkpoints, "concurrency": CONCURRENCY,
                            "probe_requests": PROBE_REQUESTS, "ledger": "sqlite, on"},
               "summary": summary, "marks_s": marks, "checkpoints": rows,
               "rss_samples": [[round(t, 2), round(r, 2)] for t, r in sampler.samples]}
    report(payload, args.out, label="quick" if args.quick else "")
    return 0 if tally.complete == args.streams and summary["short_errors"] == 0 else 1


def second_half_growth(payload: dict) -> float:
    """RSS growth over the second half of the short requests: a leak keeps growing there, a warm-up does not."""
    start, end = payload["marks_s"]["short requests"], payload["rss_samples"][-1][0]
    half = [rss for t, rss in payload["rss_samples"] if t >= (start + end) / 2]
    return half[-1] / half[0] - 1


def table(payload: dict) -> str:
    s, cfg = payload["summary"], payload["settings"]
    verdict = "met" if s["growth_end"] < GROWTH_TARGET else "NOT met"
    return "\n".join([
        f"Soak on {payload['machine']['cpu']} ({payload['machine']['cpus']} CPUs), {s['seconds']:.0f} s",
        "",
        "| measure | value |",
        "|---|---:|",
        (f"| streams complete / most open at once | {s['streams_complete']} / {s['streams_most_open']} of "
        f"{s['streams']} ({cfg['stream_tokens']} tokens each, {s['stream_seconds']:.1f} s) |"),
        f"| short requests (errors) | {s['requests']:,} ({s['short_errors']}) |",
        f"| short requests/s, median of checkpoints (concurrency {cfg['concurrency']}) | {s['short_rps_median']:.0f} |",
        (f"| RSS start → warm → end (peak after warm) MiB | {s['rss_start_mib']:.1f} → {s['rss_warm_mib']:.1f} → "
        f"{s['rss_end_mib']:.1f} ({s['rss_peak_after_warm_mib']:.1f}) |"),
        (f"| RSS growth after warm-up, end (peak) | {s['growth_end']:+.1%} ({s['growth_peak']:+.1%}); "
        f"target < {GROWTH_TARGET:.0%}: {verdict} |"),
        f"| RSS growth over the second half of the short requests | {second_half_growth(payload):+.1%} |",
        (f"| overhead vs stand-in direct, p50 / p99 ms (median of {cfg['checkpoints']} probes of "
        f"{cfg['probe_requests']}) | {s['overhead_p50_ms_median']:.2f} / {s['overhead_p99_ms_median']:.2f} |"),
        f"| worst probe's p99 overhead ms | {s['overhead_p99_ms_max']:.2f} |",
        f"| ledger rows / requests sent to the gateway | {s['ledger_rows']:,} / {s['requests_sent']:,} |",
    ])


def report(payload: dict, out: Path | None, label: str = "", write_json: bool = True) -> None:
    """Print the table; file the run (bench/store.py) or write `out` with the Markdown and the plot beside it."""
    text = table(payload)
    print("\n" + text)
    if out is None:
        saved, png = store.save("soak", payload, markdown=text + "\n", label=label), store.artifact("soak", ".png")
    else:
        if write_json:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(payload, indent=1))
        out.with_suffix(".md").write_text(text + "\n")
        saved, png = out, out.with_suffix(".png")
    plot(png, [tuple(x) for x in payload["rss_samples"]], payload["checkpoints"], payload["marks_s"])
    print(f"\nsaved {saved} and {png}")




if __name__ == "__main__":
    sys.exit(main())
