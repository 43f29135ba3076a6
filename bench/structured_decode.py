"""The per-token cost of constrained decoding (hosted/structured.py) on SmolLM2: decode tokens/s at batch 1 and
batch 32, the same prompts unconstrained and constrained by a JSON schema, with the grammar masks filled on a
worker thread during the forward ("overlap", the engine's default) and inline after it.

    python -m bench.structured_decode            # ~2 min on 2 CPU cores; files bench/results/structured_decode/<machine>.json

The schema forces a long answer (an array of at least 40 short strings), so constrained sequences run to
max_tokens exactly as unconstrained ones (ignore_eos) do: every configuration generates the same number of
tokens. Only decode steps are timed (after every prompt's prefill). Rounds interleave the configurations; the median round is reported (shared, noisy machines).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import torch

from bench import store
from hosted.async_llm_engine import AsyncLLMEngine
from hosted.engine import EngineConfig, LLMEngine
from hosted.models import SMOLLM2_MODEL
from hosted.request_plan import plan_chat
from hosted.tokenizer import Tokenizer
from openai_wire.engine_requests import EngineChatRequest
from openai_wire.request_errors import parse

ROOT = Path(__file__).resolve().parent.parent

SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "minItems": 40,
                                                     "items": {"type": "string", "maxLength": 12}}},
          "required": ["items"]}
QUESTIONS = ["List some fruits.", "List some animals.", "List some colours.", "List some cities.",
             "List some tools.", "List some rivers.", "List some names.", "List some foods."]


_ids = iter(range(10**9))


def run(engine: LLMEngine, prompts, params) -> tuple[float, int]:
    """Decode seconds and tokens: the clock starts once every prompt is prefilled (its first token out)."""
    ids = [f"b{next(_ids)}" for _ in prompts]
    for rid, prompt, p in zip(ids, prompts, params):
        engine.add_request(rid, prompt, p)
    started: set[str] = set()
    while len(started) < len(ids):
        started |= {o.request_id for o in engine.step() if o.new_token_ids}
    t0 = time.perf_counter()
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    return time.perf_counter() - t0, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="write this JSON file instead of filing the run in "
                                                "bench/results/structured_decode/<machine>.json")
    ap.add_argument("--label", default="", help="a name for this run in the results history")
    args = ap.parse_args()
    torch.manual_seed(0)
    engine = LLMEngine(EngineConfig(model_dir=SMOLLM2_MODEL, max_num_seqs=32, kv_cache_gb=0.5,
                                    enable_prefix_caching=False))
    tok = Tokenizer.from_dir(SMOLLM2_MODEL)
    aeng = AsyncLLMEngine(engine)

    def job(question: str, constrained: bool):
        body = {"model": "m", "messages": [{"role": "user", "content": question + " Answer in JSON."}],
                "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
        if constrained:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "list", "schema": SCHEMA}}
        return plan_chat(parse(EngineChatRequest, body), tok, aeng).jobs[0]

    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        qs = [QUESTIONS[i % len(QUESTIONS)] for i in range(batch)]
        free = [job(q, False) for q in qs]
        cons = [job(q, True) for q in qs]
        prompts = [j.ids for j in free]
        configs = {"unconstrained": ([j.params for j in free], True),
                   "constrained (overlap)": ([j.params for j in cons], True),
                   "constrained (inline)": ([j.params for j in cons], False)}
        # Fresh params per run: dataclasses.replace keeps the grammar, each sequence gets its own matcher.
        run(engine, prompts[:1], [dataclasses.replace(free[0].params, max_tokens=4)])  # warm-up
        times: dict[str, list[float]] = {k: [] for k in configs}
        tokens: dict[str, int] = {}
        for _ in range(args.rounds):
            for name, (params, overlap) in configs.items():
                engine.masks.overlap = overlap
                seconds, n = run(engine, prompts, [dataclasses.replace(p) for p in params])
                times[name].append(seconds)
                tokens[name] = n
        engine.masks.overlap = True
        base = statistics.median(times["unconstrained"]) / tokens["unconstrained"]
        for name in configs:
            per_tok = statistics.median(times[name]) / tokens[name]
            rows.append({"batch": batch, "config": name, "tokens": tokens[name],
                         "seconds": round(statistics.median(times[name]), 4),
                         "tok_per_s": round(1 / per_tok, 2),
                         "ms_per_token_over_unconstrained": round((per_tok - base) * 1e3, 4),
                         "overhead_pct": round(100 * (per_tok / base - 1), 2)})
    print(f"{'batch':>5}  {'config':<24}{'tokens':>7}{'tok/s':>9}{'+ms/token':>11}{'overhead':>10}")
    for r in rows:
        print(f"{r['batch']:>5}  {r['config']:<24}{r['tokens']:>7}{r['tok_per_s']:>9.1f}"
              f"{r['ms_per_token_over_unconstrained']:>11.3f}{r['overhead_pct']:>9.1f}%")
    meta = {"model": SMOLLM2_MODEL, "max_tokens": args.max_tokens, "rounds": args.rounds,
            "torch_threads": torch.get_num_threads(), "loadavg_at_start": Path("/proc/loadavg").read_text().split()[:3]}
    print(f"wrote {store.save('structured_decode', {'meta': meta, 'rows': rows}, label=args.label, out=args.out)}")


if __name__ == "__main__":
    main()
