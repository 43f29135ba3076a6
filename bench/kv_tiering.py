"""KV-cache tiering (issue 34): time to first token of a returning conversation whose history left the device pool,
restored from host memory, restored from disk, or recomputed; throughput of the returning turns in each mode; and
the history length below which recomputing wins. SmolLM2-135M-Instruct at `engine serve`'s default precision.

    python -m bench.kv_tiering --threads 1     # ~5 min on 2 shared CPU cores; bench/results/kv_tiering/<machine>.json
    python -m bench.kv_tiering --conversations 200 --history 2000   # the issue's full size (long)

Each mode runs on a fresh engine: every conversation's first turn (a `--history`-token prompt, one output token)
goes through a device pool that holds about `--pool-histories` histories, so earlier ones are evicted (demoted to
the tier under test, or dropped); then every conversation returns, in a random order, with its history plus a new
user turn. A returning turn still found on the device (the last ones, by LRU) is counted apart, not in the tier's
figures. Disk mode has no host tier and drops the page cache before each returning turn (`echo 1 >
/proc/sys/vm/drop_caches`, root only; the JSON says whether it could), so its reads come from the device. Restores
run with --kv-restore always, so each mode measures what it names; the crossover sweep shows where `auto` would
recompute instead. Same greedy first token in every mode is checked.
"""
from __future__ import annotations

import argparse
import math
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench import store
from bench.machine_info import cpu_model
from hosted import precision
from hosted.engine import EngineConfig, LLMEngine, SamplingParams
from hosted.models import SMOLLM2_MODEL, resolve_model_path

BLOCK = 16
ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def drop_page_cache() -> bool:
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


DEVICE = "cpu"


def engine_for(mode: str, num_blocks: int, disk_dir: str | None) -> LLMEngine:
    chosen = precision.choose(resolve_model_path(SMOLLM2_MODEL), DEVICE)
    kw: dict = {}
    if mode == "host":
        kw = {"kv_host_gb": 16.0, "kv_restore": "always"}
    elif mode == "disk":
        kw = {"kv_disk_dir": disk_dir, "kv_disk_gb": 64.0, "kv_restore": "always"}
    elif mode == "auto":
        kw = {"kv_host_gb": 16.0}
    return LLMEngine(EngineConfig(model_dir=SMOLLM2_MODEL, dtype=chosen.dtype, quantization=chosen.quantization,
                                  quantization_group_size=chosen.group_size or 128, device=DEVICE,
                                  block_size=BLOCK, num_kv_blocks=num_blocks, max_num_seqs=4,
                                  max_num_batched_tokens=2048, **kw))


def first_token(engine: LLMEngine, rid: str, prompt: list[int]) -> tuple[float, int, object]:
    """(seconds to the first token, the token, the final StepOutput) of one request run alone."""
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, ONE)
    last = None
    while engine.has_unfinished():
        for o in engine.step():
            last = o
    return time.perf_counter() - t0, last.new_token_ids[0], last


def conversations(n: int, history: int, vocab: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Histories and each one's next user turn (token ids; content does not change the cost)."""
    rng = random.Random(seed)
    hist = [[rng.randrange(100, vocab - 100) for _ in range(history)] for _ in range(n)]
    turns = [[rng.randrange(100, vocab - 100) for _ in range(32)] for _ in range(n)]
    return hist, turns


def run_mode(mode: str, args, hist, turns, order, disk_dir: str | None) -> dict:
    engine = engine_for(mode, args.pool_blocks, disk_dir)
    for i, h in enumerate(hist):
        first_token(engine, f"t1-{i}", h)
    ttft: list[float] = []
    device_hits, tokens, dropped = 0, {}, True
    t_all = time.perf_counter()
    for i in order:
        if mode == "disk":
            dropped = drop_page_cache() and dropped
        seconds, token, out = first_token(engine, f"t2-{i}", hist[i] + turns[i])
        tokens[i] = token
        restored = out.num_restored_host_tokens + out.num_restored_disk_tokens
        if mode != "recompute" and restored == 0 and out.num_cached_tokens > 0:
            device_hits += 1  # still on the device: not this tier's figure
            continue
        if mode == "recompute" and out.num_cached_tokens > 0:
            device_hits += 1
            continue
        ttft.append(seconds)
    wall = time.perf_counter() - t_all
    s = engine.stats()
    prompt_tokens = sum(len(hist[i]) + len(turns[i]) for i in order)
    row = {"mode": mode, "n": len(ttft), "device_hits": device_hits,
           "p50_ms": 1000 * statistics.median(ttft) if ttft else None,
           "p95_ms": 1000 * sorted(ttft)[max(0, math.ceil(0.95 * len(ttft)) - 1)] if ttft else None,
           "ttft_ms": [round(1000 * t, 1) for t in ttft],
           "returning_turns_per_s": len(order) / wall, "prompt_tokens_per_s": prompt_tokens / wall,
           "tiers": s.kv_tiers, "first_tokens": tokens}
    if mode == "disk":
        row["page_cache_dropped"] = dropped
    if engine.kv_tiers is not None:
        row["measured"] = {"prefill_tok_s": engine.kv_tiers.prefill_tps, "copy_bytes_s": engine.kv_tiers.copy_bps,
                           "bytes_per_block": engine.kv_tiers.bytes_per_block}
        engine.kv_tiers.close()
    return row


def crossover(args, vocab: int) -> list[dict]:
    """TTFT of one returning conversation per history length: recomputed vs restored from host memory, and what
    `--kv-restore auto` chose for it (after the engine measured both costs on the longer lengths first)."""
    lengths = [int(x) for x in args.sweep.split(",")]
    rng = random.Random(7)
    rows = []
    pool = max(lengths) // BLOCK + 8  # room for the longest history
    engines = {m: engine_for(m, pool, None) for m in ("recompute", "host", "auto")}
    for n in sorted(lengths, reverse=True):
        row = {"history": n}
        for mode, engine in engines.items():
            times = []
            for r in range(args.sweep_reps):
                hist = [rng.randrange(100, vocab - 100) for _ in range(n)]
                first_token(engine, f"h{n}-{r}", hist)
                engine.block_manager.evict_cached()  # the history leaves the device (demoted, or dropped)
                if engine.kv_tiers is not None:
                    engine.kv_tiers.flush()
                seconds, _, out = first_token(engine, f"r{n}-{r}", hist + [5, 6, 7, 8])
                times.append(seconds)
                row[f"{mode}_restored_tokens"] = out.num_restored_host_tokens
            row[f"{mode}_ms"] = 1000 * statistics.median(times)
        rows.append(row)
        print(f"history {n:>5}: recompute {row['recompute_ms']:8.1f} ms  host restore {row['host_ms']:8.1f} ms  "
              f"auto {row['auto_ms']:8.1f} ms (restored {row['auto_restored_tokens']} tokens)", flush=True)
    return sorted(rows, key=lambda r: r["history"])


def markdown(result: dict) -> str:
    lines = [(f"SmolLM2-135M-Instruct ({result['precision']}), {result['conversations']} conversations x "
             f"{result['history']}-token histories, device pool {result['pool_blocks']} blocks of {BLOCK} "
             f"(~{result['pool_blocks'] * BLOCK / result['history']:.1f} histories), {cpu_model()}, "
             f"{result['threads']} threads."), "",
             "| returning turn | n | p50 TTFT ms | p95 TTFT ms | vs recompute (p50) | returning turns/s |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for row in result["modes"]:
        ratio = result["speedup_p50"].get(row["mode"])
        lines.append(f"| {row['mode']} | {row['n']} | {row['p50_ms'] or 0:.1f} | {row['p95_ms'] or 0:.1f} | "
                     f"{'' if ratio is None else f'{ratio:.1f}x'} | {row['returning_turns_per_s']:.2f} |")
    lines += ["", (f"Page cache dropped before each disk restore: {result['page_cache_dropped']}. "
              f"Same first token in every mode: {result['same_output']}."), "",
              "| history tokens | recompute ms | host restore ms | auto ms | auto restored tokens |",
              "| ---: | ---: | ---: | ---: | ---: |"]
    for r in result["crossover"]:
        lines.append(f"| {r['history']} | {r['recompute_ms']:.1f} | {r['host_ms']:.1f} | {r['auto_ms']:.1f} | "
                     f"{r['auto_restored_tokens']} |")
    first = result["crossover"][0]["history"] if result["crossover"] else None
    if result["crossover_history"] is None:
        lines += ["", "Recompute won at every length measured."]
    elif result["crossover_history"] == first:
        lines += ["", f"The host restore was faster at every length measured, down to {first} history tokens."]
    else:
        lines += ["", (f"Recompute wins below {result['crossover_history']} history tokens (the first length where "
                  "the host restore is faster).")]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--history", type=int, default=1024, help="tokens of each conversation's history")
    ap.add_argument("--pool-histories", type=float, default=2.5, help="device pool size, in histories")
    ap.add_argument("--sweep", default="16,32,64,128,256,512,1024", help="history lengths for the crossover")
    ap.add_argument("--sweep-reps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", default=None, help="write OUT.json instead of filing the run in bench/results")
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    global DEVICE
    DEVICE = args.device
    args.pool_blocks = max(int(args.pool_histories * (args.history + 40) / BLOCK), 8)
    chosen = precision.choose(resolve_model_path(SMOLLM2_MODEL), DEVICE)
    vocab = 49152
    hist, turns = conversations(args.conversations, args.history, vocab, args.seed)
    order = list(range(args.conversations))
    random.Random(args.seed + 1).shuffle(order)
    modes = []
    with tempfile.TemporaryDirectory(prefix="kv-disk-", dir=str(Path.home())) as disk_dir:
        for mode in ("recompute", "host", "disk"):
            row = run_mode(mode, args, hist, turns, order, disk_dir)
            modes.append(row)
            print(f"{mode:<9} n={row['n']:<3} p50 {row['p50_ms'] or 0:8.1f} ms  p95 {row['p95_ms'] or 0:8.1f} ms  "
                  f"{row['returning_turns_per_s']:.2f} returning turns/s  (device hits {row['device_hits']})",
                  flush=True)
    base = modes[0]["p50_ms"]
    speedup = {m["mode"]: base / m["p50_ms"] for m in modes if m["p50_ms"]}
    sweep = crossover(args, vocab)
    wins = [r["history"] for r in sweep if r["host_ms"] < r["recompute_ms"]]
    result = {"model": SMOLLM2_MODEL, "precision": f"{chosen.weights}/{chosen.dtype}", "threads": torch.get_num_threads(),
              "conversations": args.conversations, "history": args.history, "pool_blocks": args.pool_blocks,
              "modes": [{k: v for k, v in m.items() if k != "first_tokens"} for m in modes],
              "speedup_p50": speedup,
              "same_output": all(m["first_tokens"] == modes[0]["first_tokens"] for m in modes),
              "page_cache_dropped": modes[2].get("page_cache_dropped"),
              "crossover": sweep, "crossover_history": min(wins) if wins else None,
              "targets": {"host_20x": speedup.get("host", 0) >= 20, "disk_5x": speedup.get("disk", 0) >= 5}}
    md = markdown(result)
    print(md)
    print(f"saved {store.save('kv_tiering', result, markdown=md, label=args.label, out=args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
