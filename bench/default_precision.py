"""The default precision of `switchyard engine serve` (issue 31, item 10): SmolLM2-135M-Instruct's GGUF (Q4_1) at
fp32, bf16, int8 and int4 g32 on this CPU -- batch-1 decode tok/s and perplexity -- and what `--quantization auto`
(hosted/precision.py) picks here, checked against the fastest precision within 1% perplexity of fp32.

The measurements are bench/cheaper/precision.py's precision section (same prompt, decode timing and perplexity text),
with the engines loaded once and the decode runs interleaved in rounds (every precision once per round, the order
rotated), so that a neighbour's load on a shared machine falls on all of them rather than on one; per precision the
median over rounds of each round's median run is reported.

    python -m bench.default_precision                     # files bench/results/default_precision/<machine>.{json,md}
    python -m bench.default_precision --rounds 2 --ppl-tokens 1024 --out /tmp/p
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from bench import store
from bench.cheaper.precision import (
    BLOCK,
    GROUP_SIZE,
    MODEL,
    PPL_MODULES,
    PRECISIONS,
    PROMPT_MODULES,
    decode_run,
    docstrings,
    int4_mapping,
    log,
    perplexity,
)
from bench.cheaper.spec import OPEN_ENDED, encode
from bench.machine_info import cpu_model

ROOT = Path(__file__).resolve().parent.parent

# "Sound": perplexity at most 1% above fp32's, and fp32's greedy chat answers kept as tests/hosted/test_quantization.py
# requires of a quantized engine (>= 75% of the tokens the same until the first flip).
PPL_BOUND = 0.01
CHAT_BOUND = 0.75
# Greedy answers compared with fp32's: the README's quick-start question and bench/cheaper/spec.py's open chat prompts.
QUICK_START = "What is the capital of France?"
CHAT_TOKENS = 32


def load(label: str, path: Path, args, longest: int):
    from hosted.engine import EngineConfig, LLMEngine

    dtype, quant = PRECISIONS[label]
    return LLMEngine(EngineConfig(model_dir=str(path), dtype=dtype, device="cpu", max_num_seqs=16,
                                  max_num_batched_tokens=max(args.window, 64) + 16,
                                  num_kv_blocks=16 * (-(-longest // BLOCK) + 4), block_size=BLOCK,
                                  enable_prefix_caching=False, max_model_len=longest + 16,
                                  quantization=quant, quantization_group_size=GROUP_SIZE))


def measure(args) -> dict:
    from hosted import precision
    from hosted.engine import SamplingParams
    from hosted.models import resolve_model_path
    from hosted.tokenizer import Tokenizer
    from kernels import cpu_lowp

    path = resolve_model_path(MODEL)
    tok = Tokenizer.from_gguf(path)
    ppl_ids = tok.encode(docstrings(PPL_MODULES), add_special_tokens=False)[:args.ppl_tokens]
    prompt = tok.encode(docstrings(PROMPT_MODULES), add_special_tokens=False)[:args.prompt_tokens]
    chats = encode(tok, [QUICK_START, *OPEN_ENDED])
    longest = max(len(prompt) + args.new_tokens + 8, args.window, max(map(len, chats)) + CHAT_TOKENS + 8)
    labels = [x for x in args.precisions.split(",") if x]
    res: dict = {"meta": {"model": MODEL, "cpu": cpu_model(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
                          "threads": torch.get_num_threads(), "native_features": cpu_lowp.features(),
                          "prompt_tokens": len(prompt), "new_tokens": args.new_tokens, "rounds": args.rounds,
                          "runs_per_round": args.runs, "ppl_tokens": len(ppl_ids), "window": args.window,
                          "ppl_bound": PPL_BOUND, "load_avg_at_start": list(os.getloadavg()),
                          "shared_machine": args.shared},
           "runs": {}}
    engines = {}
    for label in labels:
        t0 = time.perf_counter()
        engines[label] = load(label, path, args, longest)
        r = res["runs"][label] = {"precision": label, "dtype": PRECISIONS[label][0],
                                  "quantization": PRECISIONS[label][1], "load_seconds": time.perf_counter() - t0,
                                  "rounds_tok_s": []}
        if PRECISIONS[label][1] == "int4":
            r["int4_mapping"] = int4_mapping(engines[label], path)
        r["ppl"] = perplexity(engines[label], ppl_ids, args.window)
        r["chat_greedy"] = engines[label].generate(chats, SamplingParams(max_tokens=CHAT_TOKENS, temperature=0.0))
        decode_run(engines[label], prompt, min(args.new_tokens, 32), f"{label}-warm")
        log(f"{label}: loaded in {r['load_seconds']:.1f}s, perplexity {r['ppl']['perplexity']:.4f}")
    for i in range(args.rounds):
        order = labels[i % len(labels):] + labels[:i % len(labels)]
        for label in order:
            runs = [decode_run(engines[label], prompt, args.new_tokens, f"{label}-{i}-{j}") for j in range(args.runs)]
            res["runs"][label]["rounds_tok_s"].append(statistics.median(x["tok_s"] for x in runs))
            res["runs"][label].setdefault("greedy_tokens", runs[0]["tokens"])
        log(f"round {i + 1}/{args.rounds}: " + ", ".join(f"{x} {res['runs'][x]['rounds_tok_s'][-1]:.1f}"
                                                          for x in labels) + f" tok/s (load {os.getloadavg()[0]:.1f})")
    for label in labels:
        r = res["runs"][label]
        r["tok_s"] = statistics.median(r["rounds_tok_s"])
    fp32_chats = res["runs"].get("fp32", {}).get("chat_greedy")
    for r in res["runs"].values():
        r["quick_start_answer"] = tok.decode(r["chat_greedy"][0], skip_special_tokens=True)
        if fp32_chats:
            same = sum(next((i for i, (a, b) in enumerate(zip(w, g)) if a != b), min(len(w), len(g)))
                       for w, g in zip(fp32_chats, r["chat_greedy"]))
            r["chat_agreement"] = same / sum(len(w) for w in fp32_chats)
    res["decision"] = decide(res, precision.choose(path, "cpu").as_dict())
    res["meta"]["load_avg_at_end"] = list(os.getloadavg())
    return res


def decide(res: dict, auto: dict) -> dict:
    """Mark each precision sound or not; the fastest sound one, the fastest within the perplexity bound alone, and
    whether `auto` (hosted/precision.py's choice for this file here, as_dict) is the fastest sound one."""
    runs = res["runs"]
    base = runs.get("fp32", {}).get("ppl", {}).get("perplexity")
    for r in runs.values():
        r["ppl_delta"] = r["ppl"]["perplexity"] / base - 1 if base else None
        r["within_ppl"] = r["ppl_delta"] is not None and r["ppl_delta"] <= PPL_BOUND
        r["sound"] = r["within_ppl"] and r.get("chat_agreement", 0.0) >= CHAT_BOUND

    def fastest(key: str) -> str | None:
        picked = [r for r in runs.values() if r[key]]
        return max(picked, key=lambda r: r["tok_s"])["precision"] if picked else None

    label = {"int4-g32": "int4", "float32": "fp32", "int8": "int8", "bfloat16": "bf16"}.get(auto["weights"], auto["weights"])
    return {"fastest_sound": fastest("sound"), "fastest_within_ppl": fastest("within_ppl"), "auto": auto,
            "auto_label": label}


def table(res: dict) -> str:
    m, runs, d = res["meta"], res["runs"], res["decision"]
    fp32 = runs.get("fp32", {})
    lines = [f"# Default precision — SmolLM2-135M-Instruct (GGUF Q4_1), {m['cpu']}", "",
             (f"{m['cpu_count']} cores{' (shared with other jobs: figures vary run to run)' if m['shared_machine'] else ''}, "
              f"torch {m['torch']}, {m['threads']} threads; batch-1 decode of {m['new_tokens']} greedy tokens after a "
              f"{m['prompt_tokens']}-token prompt, {m['rounds']} interleaved rounds of {m['runs_per_round']} runs "
              f"(median of round medians); perplexity over {m['ppl_tokens']} tokens of stdlib docstrings in "
              f"{m['window']}-token windows; load average {m['load_avg_at_start'][0]:.1f} at start, "
              f"{m['load_avg_at_end'][0]:.1f} at end"), "",
             ("| precision | decode tok/s | per round | vs fp32 | perplexity | Δ ppl vs fp32 | greedy = fp32 "
             f"({m['new_tokens']} tokens) | chat tokens = fp32's until the first flip | sound | quick-start answer |"),
             "| --- | ---: | --- | ---: | ---: | ---: | --- | ---: | --- | --- |"]
    for label, r in runs.items():
        speed = f"{r['tok_s'] / fp32['tok_s']:.2f}×" if fp32 else ""
        delta = r["ppl_delta"]
        agree = "—"
        if fp32 and label != "fp32":
            pairs = list(zip(r["greedy_tokens"], fp32["greedy_tokens"]))
            first = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
            agree = "identical" if first is None else f"diverges at token {first}"
        name = label + (f" (g32, {r['int4_mapping'].split(' ')[0]})" if "int4_mapping" in r else "")
        chat = f"{100 * r['chat_agreement']:.0f}%" if "chat_agreement" in r else ""
        lines.append(f"| {name} | {r['tok_s']:.1f} | {', '.join(f'{x:.0f}' for x in r['rounds_tok_s'])} | {speed} | "
                     f"{r['ppl']['perplexity']:.3f} | {'' if delta is None else f'{100 * delta:+.2f}%'} | {agree} | "
                     f"{chat} | {'yes' if r['sound'] else 'no'} | {r.get('quick_start_answer', '')!r} |")
    auto = d["auto"]
    lines += ["", (f"Sound = perplexity within {PPL_BOUND:.0%} of fp32's and at least {CHAT_BOUND:.0%} of fp32's greedy "
                   f"chat tokens kept until the first flip (the quick-start question and bench/cheaper/spec.py's 8 open "
                   f"chat prompts, {CHAT_TOKENS} tokens each; the rule tests/hosted/test_quantization.py holds a "
                   f"quantized engine to)."), "",
              f"Fastest sound precision here: **{d['fastest_sound']}** (fastest within the perplexity bound alone: "
              f"{d['fastest_within_ppl']}). `--quantization auto` (the default) picks **{auto['weights']}** "
              f"({auto['reason']}): " + ("the same." if d["auto_label"] == d["fastest_sound"] else "NOT the measured one.")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write OUT.json and OUT.md (path without extension) instead of filing "
                                               "the run in bench/results/default_precision/<machine>")
    p.add_argument("--label", default="", help="a name for this run in the results history")
    p.add_argument("--precisions", default=",".join(PRECISIONS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--runs", type=int, default=3, help="decode runs per precision per round")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--ppl-tokens", type=int, default=2048)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--shared", action=argparse.BooleanOptionalAction, default=True,
                   help="say in the table that the machine was shared with other jobs")
    p.add_argument("--render", default=None, metavar="JSON",
                   help="only rewrite the markdown (and the decision) of an earlier run's JSON")
    args = p.parse_args(argv)
    if args.render:
        src = Path(args.render)
        res = json.loads(src.read_text())
        res["decision"] = decide(res, res["decision"]["auto"])
        src.write_text(json.dumps(res, indent=1))
        src.with_suffix(".md").write_text(table(res))
        print(table(res), flush=True)
        return 0
    unknown = set(args.precisions.split(",")) - set(PRECISIONS)
    if unknown:
        p.error(f"unknown precision(s): {', '.join(sorted(unknown))} (known: {', '.join(PRECISIONS)})")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    res = measure(args)
    res["meta"]["wall_seconds"] = time.perf_counter() - t0
    saved = store.save("default_precision", res, markdown=table(res), label=args.label, out=args.out)
    print(table(res), flush=True)
    print(f"saved {saved}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
