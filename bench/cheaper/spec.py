"""Cheaper model, speculative decoding section (issues 10 and 35), part of bench.cheaper (bench/cheaper/run.py):
`python -m bench.cheaper --section spec` (or bench/cheaper_model.py's spec section).

SmolLM2-135M-Instruct, greedy, --spec-tokens (128) tokens per request, on held-out open chat prompts (HELD_OUT_CHAT:
not among hosted.distill.prompts' training chats, checked at start; `--spec-workloads open-ended,grounded` adds the
grounded ones). Side by side in one run, per precision (--spec-precisions: the engine's default precision for the
GGUF, as `engine serve` chooses it, and fp32) and batch size (--spec-batches 1,8,32):
  none (no speculation), ngram (prompt lookup), draft (the 4-layer distilled draft), eagle chain (the feature-level
  draft, --spec-eagle DIR, default the committed hosted/models/smollm2-eagle/ when present), eagle tree (when the
  engine has a tree flag), default (what `engine serve` resolves --speculative auto to).
Every speculating configuration runs adaptive, as served. Batch 1 runs the prompts one at a time; batch B runs B
at once (prompts cycled) and reports throughput.

Per configuration: decode tok/s (output tokens of the steps that carry no prompt tokens over those steps' time:
the prefill is the same for all), speed-up over none, mean accepted drafts per verification and acceptance by
position, c_draft and c_verify (proposing time and the rest of a step that verified drafts, each over none's
median decode step at the same batch), the measured bound E[tokens per sequence per verifying step] / (c_draft +
c_verify), and greedy output identical to none's (count; for each divergence the top-2 logit gap of none's
engine at the first differing position: a near-tie when under NEAR_TIE). Rounds interleave the configurations and
the median round is reported. --spec-quick: batches 1 and 8, 32 tokens, 2 prompts at batch 1, one round, the
default precision only (proves the section runs; minutes on 2 cores).
"""
from __future__ import annotations

import dataclasses
import inspect
import statistics
import time
from pathlib import Path
from typing import Any

from hosted.models import SMOLLM2_DRAFT_DIR as DISTILLED  # relative to the repository root

NEAR_TIE = 0.1  # nats: a divergence where none's top two tokens are this close is a rounding tie

OPEN_ENDED = ("What should I pack for a weekend hiking trip?", "Why is the sky blue?",
              "Write a short story about a robot who learns to paint.", "How do airplanes stay in the air?",
              "Give me an idea for a quick vegetarian dinner.", "What are good habits for someone learning to code?",
              "Write a limerick about a cat who loves boxes.", "Explain what a budget is and why it helps.")
_CODE_FUNCS = ("textwrap.indent", "heapq.nlargest", "calendar.isleap", "shlex.join",
               "difflib.get_close_matches", "statistics.median", "calendar.monthrange", "textwrap.shorten")
_DOC_MODULES = ("calendar", "difflib", "shlex", "sched", "configparser", "getopt", "graphlib", "textwrap")


# More held-out chat (issue 35): OPEN_ENDED (which bench/default_precision.py also uses) and eight more.
HELD_OUT_CHAT = OPEN_ENDED + (
    "Plan a three-day trip to a city by the sea.", "Why do cats purr?",
    "Write a short poem about the first snow of winter.", "How does a refrigerator keep food cold?",
    "Suggest a name for a friendly neighbourhood bakery and explain it.", "What makes a good friend?",
    "Describe your ideal Sunday morning.", "How can I stay focused while working from home?")


def check_held_out(prompts: tuple[str, ...]) -> None:
    """None of the prompts is one of hosted.distill's open-ended training chats (the draft never saw them)."""
    from hosted.distill import prompts as training

    taught = {t.format(topic=topic) for topic in training._TOPICS for t in training._OPEN}
    seen = [p for p in prompts if p in taught]
    if seen:
        raise ValueError(f"benchmark prompts in the distillation set: {seen}")


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
    """Run the prompts to completion, timing every step; decode-only steps apart, and among them the steps that
    verified drafts (their proposing time apart)."""
    from hosted.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"b{time.perf_counter_ns()}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, list(p), params)
    before = engine.stats()
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    decode_s = 0.0
    decode_tokens = decode_steps = 0
    verify = {"steps": 0, "seconds": 0.0, "propose_seconds": 0.0, "tokens": 0, "decodes": 0}
    seen: dict[str, int] = {}  # request -> draft tokens verified so far
    step_times: list[float] = []
    sched = engine.scheduler
    while engine.has_unfinished():
        prompt_step = bool(sched.waiting) or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running)
        decodes = len(sched.running)
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        new = sum(len(o.new_token_ids) for o in outs)
        verified = 0
        for o in outs:
            out[o.request_id].extend(o.new_token_ids)
            if o.spec_proposed > seen.get(o.request_id, 0):
                verified += 1
                seen[o.request_id] = o.spec_proposed
        if prompt_step or not new:
            continue
        decode_s += dt
        decode_tokens += new
        decode_steps += 1
        step_times.append(dt)
        if verified:
            verify["steps"] += 1
            verify["seconds"] += dt
            verify["propose_seconds"] += engine.spec.propose_seconds
            verify["tokens"] += new
            verify["decodes"] += decodes
    after = engine.stats()
    return {"outputs": [out[r] for r in ids], "decode_tok_s": decode_tokens / decode_s if decode_s else 0.0,
            "decode_steps": decode_steps, "decode_tokens": decode_tokens, "decode_seconds": decode_s,
            "median_step_s": statistics.median(step_times) if step_times else None, "verify": verify,
            "proposed": after.spec_proposed_tokens - before.spec_proposed_tokens,
            "accepted": after.spec_accepted_tokens - before.spec_accepted_tokens}


def costs(runs: list[dict[str, Any]], plain_step_s: float) -> dict[str, float] | None:
    """c_draft, c_verify over none's decode step and the bound, from the steps that verified drafts."""
    steps = sum(r["verify"]["steps"] for r in runs)
    if not steps or not plain_step_s:
        return None
    seconds = sum(r["verify"]["seconds"] for r in runs)
    propose = sum(r["verify"]["propose_seconds"] for r in runs)
    per_seq = sum(r["verify"]["tokens"] for r in runs) / max(sum(r["verify"]["decodes"] for r in runs), 1)
    c_draft = propose / steps / plain_step_s
    c_verify = (seconds - propose) / steps / plain_step_s
    return {"verifying_steps": steps, "tokens_per_seq_step": per_seq, "c_draft": c_draft, "c_verify": c_verify,
            "bound": per_seq / (c_draft + c_verify)}


def divergences(reference, prompts: list[list[int]], ref_outs: list[list[int]], outs: list[list[int]]) -> list[dict]:
    """Each output that differs from none's: where, and none's top-2 logprob gap there (a tie if small)."""
    from hosted.sampling_params import SamplingParams

    found = []
    for i, (prompt, want, got) in enumerate(zip(prompts, ref_outs, outs)):
        if want == got:
            continue
        pos = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        rid = f"tie{time.perf_counter_ns()}-{i}"
        reference.add_request(rid, list(prompt) + want[:pos],
                              SamplingParams(max_tokens=1, temperature=0.0, logprobs=True, top_logprobs=2))
        top = []
        while reference.has_unfinished():
            for o in reference.step():
                if o.request_id == rid and o.logprobs:
                    top = o.logprobs[0].top
        gap = top[0][1] - top[1][1] if len(top) >= 2 else None
        found.append({"prompt": i, "position": pos, "top2_gap": gap,
                      "near_tie": gap is not None and gap <= NEAR_TIE})
    return found


def configurations(args, root: Path, model: str) -> dict[str, dict[str, Any]]:
    """Engine keyword arguments per configuration name (plus 'none')."""
    from hosted.config import EngineConfig
    from hosted.spec.default import SMOLLM2_EAGLE_DIR, eagle_draft_present, resolve

    eagle = getattr(args, "spec_eagle", None) or (str(SMOLLM2_EAGLE_DIR) if eagle_draft_present() else None)
    configs: dict[str, dict[str, Any]] = {"none": {}, "ngram": {"speculative": "ngram"},
                                          "draft (4-layer)": {"draft_model_dir": str(root / DISTILLED)}}
    if eagle:
        configs["eagle chain"] = {"speculative": "eagle", "draft_model_dir": eagle}
        tree = [f.name for f in dataclasses.fields(EngineConfig) if f.name in ("spec_tree", "spec_tree_shape")]
        if tree:  # the tree flag (issue 35 #2), when the engine has one
            configs["eagle tree"] = {"speculative": "eagle", "draft_model_dir": eagle, tree[0]: "auto"}
    d = resolve(model, None, None)
    configs[f"default ({d.method or 'off'})"] = {"speculative": d.method or "off", "draft_model_dir": d.draft_dir,
                                                 "spec_ngram_alongside": d.ngram_alongside}
    wanted = getattr(args, "spec_configs", None)
    if wanted:  # a subset (none always runs: every speed-up is over it)
        configs = {n: kw for n, kw in configs.items() if n == "none" or any(w in n for w in wanted.split(","))}
    return configs


def precisions(args, model: str) -> dict[str, dict[str, Any]]:
    from hosted import precision

    out = {}
    for name in args.spec_precisions.split(","):
        if name == "default":
            p = precision.choose(model, "cpu")
            out[f"default ({p.weights})"] = {"dtype": p.dtype, "quantization": p.quantization,
                                             "quantization_group_size": p.group_size or 128}
        elif name == "fp32":
            out["fp32"] = {"dtype": "float32", "quantization": "none"}
        else:
            raise ValueError(f"--spec-precisions: unknown {name!r} (default, fp32)")
    return out


def run(args, root: Path, tok, log) -> dict[str, Any]:
    from hosted.engine import EngineConfig, LLMEngine
    from hosted.spec.decoder import acceptance_by_position

    quick = getattr(args, "spec_quick", False)
    tokens = 32 if quick else args.spec_tokens
    batches = [b for b in args.spec_batches if b <= 8] if quick else args.spec_batches
    rounds = 1 if quick else args.spec_rounds
    if quick:
        args.spec_precisions = args.spec_precisions.split(",")[0]
    check_held_out(HELD_OUT_CHAT)
    workloads = {"open-ended": encode(tok, list(HELD_OUT_CHAT)), "grounded": encode(tok, grounded_chats())}
    workloads = {w: v for w, v in workloads.items() if w in (args.spec_workloads or "open-ended").split(",")}
    configs = configurations(args, root, args.model)
    rows = []
    for pname, pkw in precisions(args, args.model).items():
        pkw = {k: (None if v == "none" else v) for k, v in pkw.items()}
        engines = {name: LLMEngine(EngineConfig(model_dir=args.model, max_num_seqs=64, num_speculative_tokens=args.spec_k,
                                                num_kv_blocks=2048, **pkw, **kw)) for name, kw in configs.items()}
        log(f"spec {pname}: {', '.join(engines)}; K={args.spec_k}, {tokens} tokens")
        for batch in batches:
            for workload, base in workloads.items():
                if batch == 1:  # one prompt at a time
                    groups = [[p] for p in base[:2 if quick else 8]]
                else:
                    groups = [(base * -(-batch // len(base)))[:batch]]
                for engine in engines.values():  # warm-up; the adaptive planners' first measurements
                    timed_generate(engine, groups[0], min(tokens, 32))
                    if engine.spec is not None:
                        engine.spec.verifications.clear()
                runs: dict[str, list[dict]] = {name: [] for name in engines}
                for _ in range(rounds):
                    for name, engine in engines.items():
                        parts = [timed_generate(engine, g, tokens) for g in groups]
                        runs[name].append(_merge(parts))
                plain = runs["none"]
                plain_tps = statistics.median(r["decode_tok_s"] for r in plain)
                plain_step = statistics.median(r["median_step_s"] for r in plain)
                prompts = [p for g in groups for p in g]
                for name, rs in runs.items():
                    tps = statistics.median(r["decode_tok_s"] for r in rs)
                    mid = sorted(rs, key=lambda r: r["decode_tok_s"])[len(rs) // 2]
                    row = {"precision": pname, "batch": batch, "workload": workload, "config": name,
                           "decode_tok_s": tps, "speedup": tps / plain_tps, "runs_tok_s": [r["decode_tok_s"] for r in rs],
                           "requests": len(prompts)}
                    spec = engines[name].spec
                    if spec is not None:
                        row["costs"] = costs(rs, plain_step)
                        proposed, accepted = sum(r["proposed"] for r in rs), sum(r["accepted"] for r in rs)
                        row["acceptance"] = accepted / proposed if proposed else None
                        n = sum(spec.verifications.values())
                        row["verifications"] = n
                        if n:
                            row["acceptance_by_position"] = acceptance_by_position(spec.verifications)
                            row["mean_accepted"] = sum(a * c for (_, a), c in spec.verifications.items()) / n
                        div = divergences(engines["none"], prompts, plain[0]["outputs"], mid["outputs"])
                        row["same_output"] = len(prompts) - len(div)
                        row["divergences"] = div
                    rows.append(row)
                    log("spec " + _line(row))
        del engines
    return {"k": args.spec_k, "tokens": tokens, "rounds": rounds, "quick": quick, "rows": rows,
            "prompts": list(HELD_OUT_CHAT), "configs": {n: {k: v for k, v in kw.items() if v is not None}
                                                        for n, kw in configs.items()}}


def _merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One record for prompts run one after another (batch 1): sums, and tok/s over the summed time."""
    seconds = sum(p["decode_seconds"] for p in parts)
    tokens = sum(p["decode_tokens"] for p in parts)
    verify = {k: sum(p["verify"][k] for p in parts) for k in parts[0]["verify"]}
    return {"outputs": [o for p in parts for o in p["outputs"]], "decode_tok_s": tokens / seconds if seconds else 0.0,
            "decode_seconds": seconds, "decode_tokens": tokens, "decode_steps": sum(p["decode_steps"] for p in parts),
            "median_step_s": statistics.median(p["median_step_s"] for p in parts if p["median_step_s"]),
            "verify": verify, "proposed": sum(p["proposed"] for p in parts),
            "accepted": sum(p["accepted"] for p in parts)}


def _line(r: dict[str, Any]) -> str:
    c = r.get("costs") or {}
    text = (f"{r['precision']:<16} B={r['batch']:<2} {r['workload']:<10} {r['config']:<18} {r['decode_tok_s']:7.1f} "
            f"tok/s x{r['speedup']:.2f}")
    if r.get("mean_accepted") is not None:
        text += f" accepted/verify {r['mean_accepted']:.2f} by position {[round(a, 2) for a in r['acceptance_by_position']]}"
    if c:
        text += f" c_draft {c['c_draft']:.2f} c_verify {c['c_verify']:.2f} bound x{c['bound']:.2f}"
    if "same_output" in r:
        ties = sum(d["near_tie"] for d in r["divergences"])
        text += f" same {r['same_output']}/{r['requests']}" + (f" ({ties} near-ties)" if r["divergences"] else "")
    return text


def table(res: dict[str, Any]) -> str:
    if "rows" in res and res["rows"] and "precision" not in res["rows"][0]:
        return _table_before_issue_35(res)
    lines = [(f"## Speculative decoding (greedy, {res['tokens']} tokens per request, K = {res['k']}, median of "
              f"{res['rounds']} rounds{', QUICK' if res.get('quick') else ''})"), "",
             ("| precision | batch | workload | configuration | decode tok/s | speed-up | accepted / verification | "
              "acceptance by position | c_draft | c_verify | bound | same output (near-ties) |"),
             "| --- | ---: | --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- |"]
    for r in res["rows"]:
        c = r.get("costs") or {}
        acc = "" if r.get("mean_accepted") is None else f"{r['mean_accepted']:.2f}"
        pos = " / ".join(f"{a:.2f}" for a in r.get("acceptance_by_position", []))
        same = ""
        if "same_output" in r:
            ties = sum(d["near_tie"] for d in r["divergences"])
            same = f"{r['same_output']}/{r['requests']}" + (f" ({ties})" if r["divergences"] else "")
        cells = [f"{c['c_draft']:.3f}", f"{c['c_verify']:.2f}", f"{c['bound']:.2f}×"] if c else ["", "", ""]
        lines.append(f"| {r['precision']} | {r['batch']} | {r['workload']} | {r['config']} | {r['decode_tok_s']:.1f} | "
                     f"{r['speedup']:.2f}× | {acc} | {pos} | {' | '.join(cells)} | {same} |")
    return "\n".join(lines) + "\n"


def _table_before_issue_35(res: dict[str, Any]) -> str:
    """Runs filed before issue 35 (no precision column; fixed-K bounds)."""
    k = res["k"]
    lines = [(f"## Speculative decoding (greedy, {res['tokens']} tokens per request, K = {k}, median of "
              f"{res['rounds']} rounds)"), "",
             "| batch | workload | configuration | decode tok/s | speed-up | acceptance | same output |",
             "| ---: | --- | --- | ---: | ---: | ---: | --- |"]
    for r in res["rows"]:
        acc = "" if r.get("acceptance") is None else f"{r['acceptance']:.3f}"
        lines.append(f"| {r['batch']} | {r['workload']} | {r['config']} | {r['decode_tok_s']:.1f} | "
                     f"{r['speedup']:.2f}× | {acc} | {'yes' if r.get('same_output') else 'NO'} |")
    return "\n".join(lines) + "\n"
