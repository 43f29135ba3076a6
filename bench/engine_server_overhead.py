"""What serving costs a batch-1 decode step: the time between two decode steps outside the native step, in-process
and through `switchyard engine serve` (plain and streamed), side by side in one run.

    python -m bench.engine_server_overhead                      # int8, files bench/results/engine_server_overhead/<machine>
    python -m bench.engine_server_overhead --precision int4 --rounds 3

Wall-clock tok/s on these machines moves by ±20% within minutes with the host's memory bandwidth, which hides a
0.3 ms cost in a 4 ms step. So this measures, inside each process, every decode step's native call (the layers and
the head: kernels/cpu_decode.DecodeStep.logits, or a greedy burst's steps: DecodeStep.greedy) and the interval from
one native call to the next's, per step: the difference is what a step spends outside the kernels -- scheduling,
sampling, Python, and in a server the event loop's work on the tokens (it shares the GIL and the two cores with
the engine thread). That difference barely moves with the bandwidth. Intervals longer than --gap-ms per step (a
prefill, an idle gap between requests) are left out. The in-process mode steps the engine without bursts; the
server modes run with the server's --decode-burst-ms (its default unless --burst-ms adds modes).

Modes, in turn for --rounds rounds:
  in-process  LLMEngine.step() on the main thread (the model loaded on a thread that exits, as the server does)
  plain       the server, non-streamed /v1/completions (the engine thread and the event loop, no SSE)
  streamed    the server, streamed /v1/completions with include_usage (the benchmark client of engine_peers)
The server runs in a subprocess whose DecodeStep is instrumented by this script (nothing in the product changes).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench import peers, store

ROOT = Path(__file__).resolve().parent.parent

MODELS = {"fp32": ("F32", ["--dtype", "float32"]), "bf16": ("F32", ["--dtype", "bfloat16"]),
          "int8": ("F32", ["--dtype", "float32", "--quantization", "int8"]),
          "int4": ("Q4_0", ["--dtype", "float32", "--quantization", "int4", "--quantization-group-size", "32"])}

def time_decode_steps(gap_s: float) -> dict:
    """Time every native decode call in this process from now on (DecodeStep.logits: one step; DecodeStep.greedy:
    a burst of steps): for each interval from one call's start to the next's under gap_s per step (prefills and
    idle gaps are longer), the interval, the first call's duration and its number of steps."""
    from kernels import cpu_decode

    totals = {"steps": 0, "native_s": 0.0, "interval_s": 0.0}
    last = [0.0, 0.0, 0]  # the previous call's start, duration and steps

    def timing(real, steps_of):
        def timed(self, *args, **kwargs):
            t0 = time.perf_counter()
            out = real(self, *args, **kwargs)
            t1 = time.perf_counter()
            # the interval is the previous call plus what followed it
            if last[0] and t0 - last[0] < gap_s * last[2]:
                totals["steps"] += last[2]
                totals["native_s"] += last[1]
                totals["interval_s"] += t0 - last[0]
            last[:] = [t0, t1 - t0, steps_of(out)]
            return out
        return timed

    cpu_decode.DecodeStep.logits = timing(cpu_decode.DecodeStep.logits, lambda out: 1)
    cpu_decode.DecodeStep.greedy = timing(cpu_decode.DecodeStep.greedy, lambda out: out.shape[1])
    return totals


# The server's process (python -c): the same hook, its totals written out when the server exits.
_SERVER_SHIM = r"""
import atexit, json, os, sys
from bench.engine_server_overhead import time_decode_steps
totals = time_decode_steps(float(os.environ["SY_BENCH_GAP_S"]))
atexit.register(lambda: open(os.environ["SY_BENCH_OUT"], "w").write(json.dumps(totals)))
from gateway.cli import main
sys.argv = ["switchyard", *sys.argv[1:]]
sys.exit(main())
"""


def engine_args(model: Path, extra: list[str], port: int, threads: int) -> list[str]:
    return ["engine", "serve", "--model", str(model), "--served-model-name", "m", "--host", "127.0.0.1",
            "--port", str(port), "--device", "cpu", "--max-num-seqs", "1", "--max-model-len", "1024",
            "--threads", str(threads), "--no-prefix-caching", "--log-level", "warning", *extra]


class TimedServer(peers._Server):
    """`switchyard engine serve` with its decode steps timed (_SERVER_SHIM)."""

    name = "switchyard-timed"

    def __init__(self, model: Path, extra: list[str], threads: int, gap_s: float, out: Path) -> None:
        super().__init__()
        self.model = "m"
        self.cmd = [sys.executable, "-c", _SERVER_SHIM, *engine_args(model, extra, self.port, threads)]
        self.env = {**os.environ, "OMP_NUM_THREADS": str(threads), "SY_BENCH_OUT": str(out),
                    "SY_BENCH_GAP_S": str(gap_s), "PYTHONPATH": str(ROOT)}


def in_process(model: Path, extra: list[str], args, gap_s: float) -> dict:
    import torch

    from hosted.engine import EngineConfig, LLMEngine
    from hosted.sampling_params import SamplingParams
    from kernels import cpu_decode

    torch.set_num_threads(args.threads)
    opts = dict(zip(extra[::2], extra[1::2]))
    box: dict = {}

    def load() -> None:  # on a thread that then exits, as the server loads
        box["engine"] = LLMEngine(EngineConfig(
            model_dir=str(model), dtype=opts["--dtype"], device="cpu", max_num_seqs=1, max_model_len=1024,
            enable_prefix_caching=False, quantization=opts.get("--quantization"),
            quantization_group_size=int(opts.get("--quantization-group-size", 128))))

    loader = threading.Thread(target=load)
    loader.start()
    loader.join()
    engine = box["engine"]
    real = cpu_decode.DecodeStep.logits, cpu_decode.DecodeStep.greedy
    totals = time_decode_steps(gap_s)
    try:
        prompt = peers.prompt_token_ids(args.prompt_tokens)
        params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
        for i in range(args.requests + 1):
            if i == 1:  # the first request warms up
                totals.update(steps=0, native_s=0.0, interval_s=0.0)
            engine.generate([prompt], params)
    finally:
        cpu_decode.DecodeStep.logits, cpu_decode.DecodeStep.greedy = real
    return totals


def through_server(model: Path, extra: list[str], args, gap_s: float, stream: bool) -> dict:
    """`extra`: the model's flags, plus any serving flags of the mode (--decode-burst-ms)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "totals.json"
        with TimedServer(model, extra, args.threads, gap_s, out) as srv, httpx.Client(timeout=600) as client:
            prompt = peers.prompt_token_ids(args.prompt_tokens)
            peers._stream_completion(client, srv.base_url, "m", prompt, 16)  # warm-up (15 steps: negligible)
            rates = []
            for _ in range(args.requests):
                if stream:
                    rates.append(peers._stream_completion(client, srv.base_url, "m", prompt,
                                                          args.new_tokens)["decode_tok_s"])
                else:
                    body = {"model": "m", "prompt": prompt, "max_tokens": args.new_tokens, "temperature": 0,
                            "ignore_eos": True}
                    client.post(srv.base_url + "/v1/completions", json=body).raise_for_status()
        totals = json.loads(out.read_text())  # written as the server exited
    if stream:
        totals["stream_tok_s"] = statistics.median(rates)
    return totals


def summary(totals: dict) -> dict:
    n = max(totals["steps"], 1)
    return {"steps": totals["steps"], "interval_ms": 1e3 * totals["interval_s"] / n,
            "native_ms": 1e3 * totals["native_s"] / n,
            "outside_ms": 1e3 * (totals["interval_s"] - totals["native_s"]) / n,
            **({"stream_tok_s": totals["stream_tok_s"]} if "stream_tok_s" in totals else {})}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--precision", choices=list(MODELS), default="int8")
    p.add_argument("--rounds", type=int, default=2, help="each mode this many times, in turn")
    p.add_argument("--requests", type=int, default=2, help="counted requests per mode and round")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--gap-ms", type=float, default=20.0, help="longer intervals (prefill, idle) are not counted")
    p.add_argument("--burst-ms", type=float, nargs="*", default=[],
                   help="also streamed with the server's --decode-burst-ms at each of these values")
    p.add_argument("--out", default=None, help="write OUT.json and OUT.md (path without extension) instead of filing "
                                               "the run in bench/results/engine_server_overhead/<machine>")
    p.add_argument("--label", default="", help="a name for this run in the results history")
    args = p.parse_args(argv)
    kind, extra = MODELS[args.precision]
    model = peers.smollm2_llamacpp_models((kind,))[kind]
    gap_s = args.gap_ms / 1e3
    runs: dict[str, list[dict]] = {"in-process": [], "plain": [], "streamed": []}
    runs.update({f"streamed, burst {b:g} ms": [] for b in args.burst_ms})
    for r in range(args.rounds):
        runs["in-process"].append(summary(in_process(model, extra, args, gap_s)))
        runs["plain"].append(summary(through_server(model, extra, args, gap_s, stream=False)))
        runs["streamed"].append(summary(through_server(model, extra, args, gap_s, stream=True)))
        for b in args.burst_ms:
            burst = [*extra, "--decode-burst-ms", f"{b:g}"]
            runs[f"streamed, burst {b:g} ms"].append(summary(through_server(model, burst, args, gap_s, stream=True)))
        print(f"round {r + 1}: " + ", ".join(f"{m} {v[-1]['outside_ms']:.3f} ms outside" for m, v in runs.items()),
              flush=True)
    lines = [f"# Outside the native step, batch 1 — SmolLM2-135M {args.precision}, {args.threads} threads", "",
             (f"{args.prompt_tokens}-token prompt -> {args.new_tokens} tokens, {args.requests} requests x "
              f"{args.rounds} rounds per mode; median over rounds of each round's mean per decode step"), "",
             "| mode | step interval ms | native step ms | outside the native step ms | streamed tok/s |",
             "|---|---:|---:|---:|---:|"]
    med = {}
    for mode, rows in runs.items():
        med[mode] = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "steps"}
        tok = med[mode].get("stream_tok_s")
        lines.append(f"| {mode} | {med[mode]['interval_ms']:.3f} | {med[mode]['native_ms']:.3f} | "
                     f"{med[mode]['outside_ms']:.3f} | {'' if tok is None else f'{tok:.1f}'} |")
    text = "\n".join(lines) + "\n"
    print(text)
    saved = store.save("engine_server_overhead", {"args": vars(args), "rounds": runs, "median": med}, markdown=text,
                       label=args.label or (args.precision if args.precision != "int8" else ""), out=args.out)
    print(f"saved {saved}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
