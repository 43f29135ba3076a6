"""Cheaper model, speculative decoding section (issue 10), part of bench.cheaper (bench/cheaper/run.py).

SmolLM2-135M-Instruct, greedy, on held-out prompts (documentation of hosted.distill.prompts.HELD_OUT_MODULES,
which distillation never sees, and hand-written chat questions):
  * grounded:   summarise / extract from / add type hints to text or code given in the prompt
  * open-ended: chat questions
Configurations: no speculation; ngram (prompt lookup); draft = the untrained student (the teacher's layer
subset, same shape and head as the distilled one); draft = the distilled draft. Each speculating one runs with
K chosen per step by the goodput planner ("adaptive", what `engine serve` does) and with K drafts verified at
every step ("fixed K"). Rounds interleave the configurations; the median round is reported.

Speed = decode tok/s: output tokens of the steps that carry no prompt tokens over those steps' time (the
prefill is the same for every configuration and is not what speculation changes).
Bound (fixed-K runs): E[accepted + 1] / (K * c_draft + c_verify), with E[accepted + 1] the tokens a sequence
gains per verification, measured in the run (accepted drafts / verifications + 1: acceptance is front-loaded,
so the i.i.d. formula (1 - a^(K+1)) / (1 - a) from the per-draft rate a would understate it), c_draft =
proposal time per step / K and c_verify = the rest of the step, both over the plain engine's decode step at
the same batch. At batch B every term is per step of the whole batch. The gap between a fixed-K run and its
bound is what this model of costs leaves out (steps where fewer than K drafts are possible, prefill-free
steps of unequal cost).
"""
from __future__ import annotations

import inspect
import json
import statistics
import time
from pathlib import Path
from typing import Any

from hosted.models import SMOLLM2_DRAFT_DIR as DISTILLED  # relative to the repository root

OPEN_ENDED = ("What should I pack for a weekend hiking trip?", "Why is the sky blue?",
              "Write a short story about a robot who learns to paint.", "How do airplanes stay in the air?",
              "Give me an idea for a quick vegetarian dinner.", "What are good habits for someone learning to code?",
              "Write a limerick about a cat who loves boxes.", "Explain what a budget is and why it helps.")
_CODE_FUNCS = ("textwrap.indent", "heapq.nlargest", "calendar.isleap", "shlex.join",
               "difflib.get_close_matches", "statistics.median", "calendar.monthrange", "textwrap.shorten")
_DOC_MODULES = ("calendar", "difflib", "shlex", "sched", "configparser", "getopt", "graphlib", "textwrap")


def grounded_chats() -> list[str]:
    import importlib

    out = []
    for name in _CODE_FUNCS:
        module, _, attr = name.rpartition(".")
        src = inspect.getsource(getattr(importlib.import_module(module), attr))
        out.append(f"Add type hints to this Python function and return the whole function:\n\n```python\n{src}```")
    for i, module in enumerate(_DOC_MODULES):
        doc = (importlib.import_module(module).__doc__ or "").strip()[:900]
        task = ("Summarise this documentation in two sentences",
                "List every function or class this documentation names, one per line, quoting it exactly")[i % 2]
        out.append(f"{task}:\n\n{doc}")
    return out


def encode(tok, texts: list[str]) -> list[list[int]]:
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True),
                       add_special_tokens=False) for t in texts]


def timed_generate(engine, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Run the prompts to completion, timing every step; split decode-only steps from prompt-carrying ones."""
    from hosted.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"b{time.perf_counter_ns()}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, list(p), params)
    before = engine.stats()
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    decode_s = propose_s = 0.0
    decode_tokens = decode_steps = verifications = 0
    seen: dict[str, int] = {}  # request -> draft tokens verified so far
    step_times: list[float] = []
    sched = engine.scheduler
    while engine.has_unfinished():
        prompt_step = bool(sched.waiting) or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running)
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        new = sum(len(o.new_token_ids) for o in outs)
        for o in outs:
            out[o.request_id].extend(o.new_token_ids)
            if o.spec_proposed > seen.get(o.request_id, 0):
                verifications += 1
                seen[o.request_id] = o.spec_proposed
        if not prompt_step and new:
            decode_s += dt
            decode_tokens += new
            decode_steps += 1
            step_times.append(dt)
            if engine.spec is not None:
                propose_s += engine.spec.propose_seconds
    after = engine.stats()
    return {"outputs": [out[r] for r in ids], "decode_tok_s": decode_tokens / decode_s if decode_s else 0.0,
            "decode_steps": decode_steps, "decode_tokens": decode_tokens, "decode_seconds": decode_s,
            "propose_seconds": propose_s, "verifications": verifications, "median_step_s": statistics.median(step_times) if step_times else None,
            "proposed": after.spec_proposed_tokens - before.spec_proposed_tokens,
            "accepted": after.spec_accepted_tokens - before.spec_accepted_tokens}


def bound(row: dict[str, Any], plain_step_s: float, k: int, batch: int) -> dict[str, float] | None:
    """E[accepted+1] / (K c_draft + c_verify) from a fixed-K run's measured costs (module docstring)."""
    if not row["proposed"] or not row["decode_steps"] or not row["verifications"]:
        return None
    a = row["accepted"] / row["proposed"]
    expected = 1 + row["accepted"] / row["verifications"]
    per_step = row["decode_seconds"] / row["decode_steps"]
    propose = row["propose_seconds"] / row["decode_steps"]
    c_draft = propose / k / plain_step_s
    c_verify = (per_step - propose) / plain_step_s
    return {"acceptance": a, "expected_tokens": expected, "c_draft": c_draft, "c_verify": c_verify,
            "bound": expected / (k * c_draft + c_verify), "batch": batch}


def untrained_like(distilled: Path, model: str, out: Path) -> str:
    """The untrained draft of the distilled one's shape: its teacher layers and head tokens, before training."""
    from safetensors import safe_open

    from hosted.config import ModelConfig
    from hosted.distill.student import export_draft, new_student, student_shape

    shape_info = json.loads((distilled / "config.json").read_text())["switchyard_draft"]["shape"]
    with safe_open(str(distilled / "model.safetensors"), "pt") as f:
        head = f.get_tensor("lm_head.vocab_ids").tolist()
    tcfg = ModelConfig.from_dir(model)
    shape = student_shape(tcfg, shape_info["num_layers"], shape_info["hidden_size"], shape_info["head_vocab"])
    export_draft(new_student(shape, model, tcfg, head, seed=0), out, model, tcfg, "# untrained draft\n", {})
    return str(out)


def run(args, root: Path, tok, log) -> dict[str, Any]:
    from hosted.config import ModelConfig
    from hosted.engine import EngineConfig, LLMEngine

    model = args.model
    distilled = str(root / DISTILLED)
    dcfg = ModelConfig.from_dir(distilled)
    untrained_dir = untrained_like(root / DISTILLED, model, root / "data" / "bench" / "smollm2-draft-untrained")
    k = args.spec_k
    configs = {"plain": {}, "ngram adaptive": {"speculative": "ngram"},
               "ngram fixed K": {"speculative": "ngram", "spec_adaptive": False},
               "untrained draft adaptive": {"draft_model_dir": str(untrained_dir)},
               "untrained draft fixed K": {"draft_model_dir": str(untrained_dir), "spec_adaptive": False},
               "distilled draft adaptive": {"draft_model_dir": distilled},
               "distilled draft fixed K": {"draft_model_dir": distilled, "spec_adaptive": False}}
    eagle = getattr(args, "spec_eagle", None)
    if eagle:  # the feature-level draft (issue 35)
        configs["eagle adaptive"] = {"speculative": "eagle", "draft_model_dir": eagle}
        configs["eagle fixed K"] = {"speculative": "eagle", "draft_model_dir": eagle, "spec_adaptive": False}
    wanted = getattr(args, "spec_configs", None)
    if wanted:  # a subset (plain is always run: every speed-up is over it)
        configs = {n: kw for n, kw in configs.items() if n == "plain" or any(w in n for w in wanted.split(","))}
    engines = {name: LLMEngine(EngineConfig(model_dir=model, max_num_seqs=64, num_speculative_tokens=k,
                                            num_kv_blocks=1024, **kw)) for name, kw in configs.items()}
    log(f"spec: draft {dcfg.num_hidden_layers} layers, head {dcfg.head_vocab_size}; {len(engines)} engines, K={k}")
    workloads = {"grounded": encode(tok, grounded_chats()), "open-ended": encode(tok, list(OPEN_ENDED))}
    if getattr(args, "spec_workloads", None):
        workloads = {w: v for w, v in workloads.items() if w in args.spec_workloads.split(",")}
    rows = []
    for batch in args.spec_batches:
        for workload, base in workloads.items():
            prompts = (base * -(-batch // len(base)))[:batch]
            for engine in engines.values():  # warm-up; the adaptive planners' first measurements
                timed_generate(engine, prompts, min(args.spec_tokens, 32))
            rounds: dict[str, list[dict]] = {name: [] for name in engines}
            for engine in engines.values():
                if engine.spec is not None:
                    engine.spec.verifications.clear()  # acceptance by position over the measured rounds
            for _ in range(args.spec_rounds):
                for name, engine in engines.items():
                    rounds[name].append(timed_generate(engine, prompts, args.spec_tokens))
            plain = rounds["plain"]
            plain_tps = statistics.median(r["decode_tok_s"] for r in plain)
            plain_step = statistics.median(r["median_step_s"] for r in plain)
            for name, runs in rounds.items():
                mid = sorted(runs, key=lambda r: r["decode_tok_s"])[len(runs) // 2]
                proposed, accepted = sum(r["proposed"] for r in runs), sum(r["accepted"] for r in runs)
                tps = statistics.median(r["decode_tok_s"] for r in runs)  # the same statistic as plain's
                row = {"batch": batch, "workload": workload, "config": name, "decode_tok_s": tps,
                       "speedup": tps / plain_tps, "runs_tok_s": [r["decode_tok_s"] for r in runs],
                       "acceptance": accepted / proposed if proposed else None,
                       "drafts_per_token": proposed / max(sum(r["decode_tokens"] for r in runs), 1),
                       "same_output": all(r["outputs"] == plain[0]["outputs"] for r in runs),
                       "bound": bound(mid, plain_step, k, batch) if "fixed" in name else None}
                spec = engines[name].spec
                if spec is not None and spec.verifications:
                    from hosted.spec.decoder import acceptance_by_position

                    n = sum(spec.verifications.values())
                    row["acceptance_by_position"] = acceptance_by_position(spec.verifications)
                    row["mean_accepted"] = sum(a * c for (_, a), c in spec.verifications.items()) / n
                rows.append(row)
                b = row["bound"]
                acc = "-" if row["acceptance"] is None else f"{row['acceptance']:.3f}"
                limit = f" bound x{b['bound']:.2f} (c_draft {b['c_draft']:.3f}, c_verify {b['c_verify']:.2f})" if b else ""
                log(f"spec B={batch:<2} {workload:<10} {name:<25} {row['decode_tok_s']:7.1f} tok/s "
                    f"x{row['speedup']:.2f} accept={acc}{limit}{'' if row['same_output'] else ' OUTPUT DIFFERS'}")
                if row.get("acceptance_by_position"):
                    log(f"    by position {[round(a, 3) for a in row['acceptance_by_position']]}, mean accepted "
                        f"{row['mean_accepted']:.2f} per verification")
    del engines
    return {"k": k, "tokens": args.spec_tokens, "rounds": args.spec_rounds, "rows": rows,
            "draft": {"dir": DISTILLED, "layers": dcfg.num_hidden_layers, "head_vocab": dcfg.head_vocab_size}}


def table(res: dict[str, Any]) -> str:
    k = res["k"]
    lines = [(f"## Speculative decoding (greedy, {res['tokens']} tokens per request, K = {k}, median of "
              f"{res['rounds']} rounds)"), "",
             ("| batch | workload | configuration | decode tok/s | speed-up | acceptance | "
              "bound E[acc+1]/(K·c_draft+c_verify) | c_draft | c_verify | same output |"),
             "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in res["rows"]:
        b = r["bound"] or {}
        acc = "" if r["acceptance"] is None else f"{r['acceptance']:.3f}"
        limit = f"{b['bound']:.2f}×" if b else ""
        c_draft = f"{b['c_draft']:.3f}" if b else ""
        c_verify = f"{b['c_verify']:.2f}" if b else ""
        same = "yes" if r["same_output"] else "NO"
        lines.append(f"| {r['batch']} | {r['workload']} | {r['config']} | {r['decode_tok_s']:.1f} | "
                     f"{r['speedup']:.2f}× | {acc} | {limit} | {c_draft} | {c_verify} | {same} |")
    return "\n".join(lines) + "\n"
