"""bench/cheaper/spec.py's arithmetic and table (the measured run itself is the benchmark, not a test)."""
from __future__ import annotations

import pytest

from bench.cheaper import spec


def _run(steps: int, seconds: float, propose: float, tokens: int, decodes: int) -> dict:
    return {"verify": {"steps": steps, "seconds": seconds, "propose_seconds": propose, "tokens": tokens,
                       "decodes": decodes}}


def test_costs_are_over_the_plain_decode_step_and_the_bound_is_tokens_over_their_sum():
    # Two rounds: 10 verifying steps of batch 1, 2.5 tokens each, 9 ms each of which 1 ms proposing; plain 4 ms.
    runs = [_run(4, 36e-3, 4e-3, 10, 4), _run(6, 54e-3, 6e-3, 15, 6)]
    c = spec.costs(runs, 4e-3)
    assert c["c_draft"] == pytest.approx(0.25) and c["c_verify"] == pytest.approx(2.0)
    assert c["tokens_per_seq_step"] == pytest.approx(2.5) and c["bound"] == pytest.approx(2.5 / 2.25)
    assert spec.costs([_run(0, 0.0, 0.0, 0, 0)], 4e-3) is None  # nothing verified: no costs to report


def test_held_out_prompts_are_checked_against_the_training_chats():
    spec.check_held_out(spec.HELD_OUT_CHAT)
    with pytest.raises(ValueError, match="distillation set"):
        spec.check_held_out(("Write a haiku about coffee.",))


def test_table_names_divergences_and_near_ties_and_reads_older_runs():
    row = {"precision": "fp32", "batch": 1, "workload": "open-ended", "config": "ngram", "decode_tok_s": 100.0,
           "speedup": 1.1, "requests": 8, "mean_accepted": 1.5, "acceptance_by_position": [0.6, 0.4],
           "costs": {"c_draft": 0.01, "c_verify": 1.2, "bound": 2.0}, "same_output": 6,
           "divergences": [{"near_tie": True}, {"near_tie": False}]}
    text = spec.table({"tokens": 128, "k": 4, "rounds": 3, "rows": [row]})
    assert "| fp32 | 1 | open-ended | ngram | 100.0 | 1.10× | 1.50 | 0.60 / 0.40 | 0.010 | 1.20 | 2.00× | 6/8 (1) |" in text
    old = spec.table({"tokens": 64, "k": 4, "rounds": 3, "rows": [
        {"batch": 1, "workload": "open-ended", "config": "plain", "decode_tok_s": 90.0, "speedup": 1.0,
         "acceptance": None, "same_output": True}]})
    assert "| 1 | open-ended | plain | 90.0 | 1.00× |  | yes |" in old


def test_a_divergence_is_located_and_measured_on_the_reference_engine():
    from hosted.engine import EngineConfig, LLMEngine
    from hosted.models import DEMO_MODEL_DIR
    from hosted.sampling_params import SamplingParams
    from hosted.tokenizer import Tokenizer

    engine = LLMEngine(EngineConfig(model_dir=DEMO_MODEL_DIR, num_kv_blocks=64))
    prompt = Tokenizer.from_dir(DEMO_MODEL_DIR).encode("Return the list of files in the directory")
    ref = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    other = ref[:3] + [(ref[3] + 1) % 100] + ref[4:]
    assert spec.divergences(engine, [prompt, prompt], [ref, ref], [ref, ref]) == []
    [d] = spec.divergences(engine, [prompt, prompt], [ref, ref], [ref, other])
    assert (d["prompt"], d["position"]) == (1, 3)
    # The gap is the reference's top-2 logprob difference at that position, computed on its own.
    engine.add_request("x", prompt + ref[:3], SamplingParams(max_tokens=1, temperature=0.0, logprobs=True,
                                                             top_logprobs=2))
    top = next(o.logprobs[0].top for o in engine.step() if o.logprobs)
    assert d["top2_gap"] == pytest.approx(top[0][1] - top[1][1]) and d["top2_gap"] >= 0
    assert d["near_tie"] == (d["top2_gap"] <= spec.NEAR_TIE)
