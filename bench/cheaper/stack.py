"""Cheaper model, the compounding stack (issue 10), part of bench.cheaper (bench/cheaper/run.py).

One workload -- --stack-requests chat requests sharing a long system prompt, each with its own question,
--stack-tokens greedy tokens each -- served five ways, each adding one technique to the one before:
  1. one request at a time           (fp32, no prefix cache; the next request starts when the last ends)
  2. + continuous batching           (every request submitted at once)
  3. + prefix cache                  (the shared system prompt's KV blocks computed once, reused)
  4. + int8 weights                  (decoder linears int8 per output channel)
  5. + speculative decoding          (the distilled draft, K from measured goodput)
  6. stage 3 + speculative decoding   (fp32: without the int8 of stage 4, which is slower on this CPU)
Output tok/s is every output token over the wall time of the whole workload (prefill included: that is what
the prefix cache saves). $/Mtok prices this machine at the policy's gpu_hour_usd (policies/default.yaml,
backend smollm2) as if it were the device, fully utilised: usd_per_hour / 3600 / tok_s * 1e6. Every stage
starts with one untimed request that carries the system prompt (a serving engine's steady state: the shared
prefix is hot) and all of them are checked to give the same greedy tokens as stage 1 (int8 may differ: it
re-rounds the weights).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

SYSTEM = ("You are the support assistant of Northwind Outfitters, an online shop for outdoor gear. Follow these "
          "rules in every answer. Be friendly and brief: two or three sentences unless the customer asks for "
          "more. Never invent order numbers, prices or delivery dates; if you do not know, say so and offer to "
          "connect the customer with a human agent. Orders ship within two working days; returns are free within "
          "thirty days if the item is unused and in its original packaging; refunds reach the original payment "
          "method within five working days of the return arriving. We sell tents, sleeping bags, backpacks, "
          "hiking boots, rain jackets, stoves, water filters and headlamps. We do not sell food, fuel or "
          "firearms. Sizes for boots follow EU numbering; a size chart is on every product page. Warranty: two "
          "years on every item, five years on tents and backpacks; the warranty does not cover wear and tear or "
          "damage from misuse. Discount codes cannot be combined and do not apply to gift cards. Customers can "
          "change an order until it ships by replying to their confirmation e-mail. For safety questions about "
          "stoves or water filters, point to the manual and advise caution. Answer in the customer's language.")
QUESTIONS = ("Can I return boots I wore once outside?", "How long does shipping take?",
             "Do you sell camping stove fuel?", "What warranty does a tent have?", "How do I pick a boot size?",
             "Can I combine two discount codes?", "My refund has not arrived, what should I do?",
             "Which sleeping bag is best for winter?", "Can I change the address on my order?",
             "Is the water filter safe for river water?", "Do you ship to Norway?",
             "What does the warranty not cover?", "Can I use a discount code on a gift card?",
             "What is your cheapest headlamp?", "How do I clean a rain jacket?", "Do backpacks have a warranty?")


def policy_gpu_hour_usd(root: Path) -> float:
    import yaml

    policy = yaml.safe_load((root / "policies" / "default.yaml").read_text())
    return float(policy["backends"]["smollm2"]["gpu_hour_usd"])


def _prompts(tok, n: int) -> list[list[int]]:
    return [tok.encode(tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                               add_generation_prompt=True), add_special_tokens=False)
            for i in range(n)]


def _serve(engine, prompts: list[list[int]], tokens: int, one_at_a_time: bool) -> tuple[list[list[int]], float]:
    from hosted.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    if one_at_a_time:
        outs = [engine.generate([p], params)[0] for p in prompts]
    else:
        outs = engine.generate(prompts, params)
    return outs, time.perf_counter() - t0


def run(args, root: Path, tok, log) -> dict[str, Any]:
    from bench.cheaper.spec import DISTILLED
    from hosted.engine import EngineConfig, LLMEngine

    usd = policy_gpu_hour_usd(root)
    prompts = _prompts(tok, args.stack_requests)
    common = {"model_dir": args.model, "max_num_seqs": 64, "num_kv_blocks": 1024}
    stages = [("one request at a time", {"enable_prefix_caching": False}, True),
              ("+ continuous batching", {"enable_prefix_caching": False}, False),
              ("+ prefix cache", {}, False),
              ("+ int8 weights", {"quantization": "int8"}, False),
              ("+ speculative decoding (distilled draft)", {"quantization": "int8",
                                                            "draft_model_dir": str(root / DISTILLED)}, False),
              # int8 is slower than fp32 on this CPU (the precision section): the same stack without it.
              ("prefix cache + speculative decoding, fp32 (no int8)", {"draft_model_dir": str(root / DISTILLED)},
               False)]
    rows, reference = [], None
    for name, kw, sequential in stages:
        engine = LLMEngine(EngineConfig(**common, **kw))
        _serve(engine, prompts[:1], 8, True)  # warm-up; puts the system prompt in the prefix cache if enabled
        before = engine.stats()
        outs, seconds = _serve(engine, prompts, args.stack_tokens, sequential)
        after = engine.stats()
        tokens = sum(len(o) for o in outs)
        reference = reference or outs
        tok_s = tokens / seconds
        row = {"stage": name, "tok_s": tok_s, "seconds": seconds, "output_tokens": tokens,
               "usd_per_mtok": usd / 3600 / tok_s * 1e6,
               "prefix_hit_tokens": after.prefix_hit_tokens - before.prefix_hit_tokens,
               "prompt_tokens": sum(map(len, prompts)),
               "spec_acceptance": ((after.spec_accepted_tokens - before.spec_accepted_tokens)
                                   / max(after.spec_proposed_tokens - before.spec_proposed_tokens, 1))
               if "draft_model_dir" in kw else None,
               "same_as_stage_1": outs == reference}
        rows.append(row)
        log(f"stack {name:<42} {tok_s:7.1f} tok/s  ${row['usd_per_mtok']:.2f}/Mtok  "
            f"prefix hits {row['prefix_hit_tokens']}  same={row['same_as_stage_1']}")
        del engine
    return {"requests": args.stack_requests, "tokens": args.stack_tokens, "gpu_hour_usd": usd,
            "system_prompt_tokens": len(tok.encode(SYSTEM, add_special_tokens=False)), "rows": rows}


def table(res: dict[str, Any]) -> str:
    base = res["rows"][0]["tok_s"]
    lines = [(f"## The stack: {res['requests']} chat requests sharing a {res['system_prompt_tokens']}-token "
              f"system prompt, {res['tokens']} greedy tokens each; $/Mtok at gpu_hour_usd = "
              f"${res['gpu_hour_usd']:.2f}"), "",
             ("| stage | output tok/s | × stage 1 | $/Mtok | prefix-cache hits (tokens) | draft acceptance | "
              "same tokens as stage 1 |"),
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in res["rows"]:
        acc = "" if r["spec_acceptance"] is None else f"{r['spec_acceptance']:.3f}"
        lines.append(f"| {r['stage']} | {r['tok_s']:.1f} | {r['tok_s'] / base:.2f}× | {r['usd_per_mtok']:.2f} | "
                     f"{r['prefix_hit_tokens']:,} / {r['prompt_tokens']:,} | {acc} | "
                     f"{'yes' if r['same_as_stage_1'] else 'no'} |")
    return "\n".join(lines) + "\n"
