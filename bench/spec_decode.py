"""Speculative decoding on the bundled demo model: greedy decode tokens/s without speculation and with n-gram
(prompt lookup) and draft-model proposals, on an input-grounded workload (the answer copies the prompt) and on
open-ended text, side by side in one run; acceptance rates and the steps taken.

    python -m bench.spec_decode          # ~2 min on 2 CPU cores; files bench/results/spec_decode/<machine>.json

Drafts: the demo model itself (acceptance ~100%, but every draft token costs a full target forward, so the
goodput planner should switch it off) and its first two layers (same embeddings and head, untrained as a
draft). Each configuration runs with K chosen per step from measured goodput ("adaptive") and with every
draft verified ("fixed K"). Rounds interleave the configurations and the median round is reported (shared,
noisy machines); the speed-up is against the plain engine's median in the same run. Batch B runs B copies of
the workload's prompts at once and reports output tokens/s over the whole batch.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from bench import store
from hosted.engine import EngineConfig, LLMEngine, SamplingParams
from hosted.models import DEMO_MODEL_DIR
from hosted.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent

CODE = '''def read_config(path):
    """Read a JSON configuration file and return it as a dict."""
    with open(path) as f:
        return json.load(f)
'''
OPEN_ENDED = ["The os module provides a portable way of using",
              "Explain what a context manager is used for in Python."]
GROUNDED_SEEDS = [CODE, "Return a new list containing all items from the iterable in ascending order."]


def grounded_prompts(engine: LLMEngine, tok: Tokenizer, n: int) -> list[list[int]]:
    """Input-grounded prompts the 26.7M demo model really copies from (it follows no instructions): a text, the
    model's own greedy continuation P of it, then the text again, so the answer repeats P from the prompt."""
    out = []
    for seed in GROUNDED_SEEDS:
        ids = tok.encode(seed)
        cont = engine.generate([ids], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0]
        out.append(ids + cont + tok.encode("\n\n") + ids)
    return out


def layer_subset(src: str, layers: int, out: Path) -> str:
    """A draft from the target's first `layers` layers (embeddings, final norm and head kept)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(src).iterdir():
        if f.suffix == ".json":
            shutil.copy(f, out / f.name)
    config = json.loads((Path(src) / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config))
    weights = load_file(str(Path(src) / "model.safetensors"))
    keep = {k: v for k, v in weights.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(keep, str(out / "model.safetensors"))
    return str(out)


def run_once(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict:
    before = engine.stats()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - t0
    after = engine.stats()
    tokens = sum(len(o) for o in outs)
    return {"tok_s": tokens / seconds, "tokens": tokens, "steps": after.num_steps - before.num_steps,
            "proposed": after.spec_proposed_tokens - before.spec_proposed_tokens,
            "accepted": after.spec_accepted_tokens - before.spec_accepted_tokens, "outputs": outs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write OUT.json instead of filing the run in "
                                               "bench/results/spec_decode/<machine>.json")
    ap.add_argument("--label", default="", help="a name for this run in the results history")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    ap.add_argument("--batches", default="1,8", help="batch sizes (copies of the workload's prompts)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--only", default=None, help="comma-separated substrings: run only matching configurations")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tok = Tokenizer.from_dir(DEMO_MODEL_DIR)
    tmp = Path(tempfile.mkdtemp(prefix="spec-bench-"))
    subset = layer_subset(DEMO_MODEL_DIR, 2, tmp / "demo-2-layers")
    configs = {
        "plain": {},
        "ngram adaptive": {"speculative": "ngram"},
        "ngram fixed K": {"speculative": "ngram", "spec_adaptive": False},
        "draft=self adaptive": {"draft_model_dir": DEMO_MODEL_DIR},
        "draft=self fixed K": {"draft_model_dir": DEMO_MODEL_DIR, "spec_adaptive": False},
        "draft=2 layers adaptive": {"draft_model_dir": subset},
        "draft=2 layers fixed K": {"draft_model_dir": subset, "spec_adaptive": False},
    }
    if args.only:
        configs = {n: kw for n, kw in configs.items()
                   if n == "plain" or any(part in n for part in args.only.split(","))}
    engines = {name: LLMEngine(EngineConfig(model_dir=DEMO_MODEL_DIR, num_kv_blocks=1024, max_num_seqs=64,
                                            num_speculative_tokens=args.k, **kw)) for name, kw in configs.items()}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    workloads = {"grounded": grounded_prompts(engines["plain"], tok, args.max_tokens),
                 "open-ended": [tok.encode(t) for t in OPEN_ENDED]}
    results = []
    for batch in (int(b) for b in args.batches.split(",")):
        for workload, base in workloads.items():
            prompts = (base * batch)[:batch]
            for engine in engines.values():  # warm-up, and the adaptive planners' first measurements
                engine.generate(prompts, params)
            rounds: dict[str, list[dict]] = {name: [] for name in engines}
            for _ in range(args.rounds):
                for name, engine in engines.items():
                    rounds[name].append(run_once(engine, prompts, params))
            plain_outs = rounds["plain"][0]["outputs"]
            plain_tps = statistics.median(r["tok_s"] for r in rounds["plain"])
            for name, runs in rounds.items():
                tps = statistics.median(r["tok_s"] for r in runs)
                proposed = sum(r["proposed"] for r in runs)
                accepted = sum(r["accepted"] for r in runs)
                row = {"batch": batch, "workload": workload, "config": name, "tok_s": round(tps, 1),
                       "speedup": round(tps / plain_tps, 3), "acceptance": round(accepted / proposed, 3) if proposed else None,
                       "proposed_per_token": round(proposed / sum(r["tokens"] for r in runs), 3),
                       "tokens_per_step": round(sum(r["tokens"] for r in runs) / sum(r["steps"] for r in runs), 2),
                       "same_output": all(r["outputs"] == plain_outs for r in runs)}
                results.append(row)
                print(f"B={batch:<3} {workload:<11} {name:<24} {row['tok_s']:>8.1f} tok/s  x{row['speedup']:<6.3f} "
                      f"accept={row['acceptance']!s:<6} drafts/token={row['proposed_per_token']:<6} "
                      f"tokens/step={row['tokens_per_step']:<5} same={row['same_output']}", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    saved = store.save("spec_decode", {"threads": torch.get_num_threads(), "k": args.k, "max_tokens": args.max_tokens,
                                       "results": results}, label=args.label, out=args.out)
    print(f"saved {saved}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
