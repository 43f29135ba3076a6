"""Speculative decoding through the whole engine (bundled demo model): greedy output with n-gram and draft-model
speculation equals greedy output without it, solo, batched and under preemption; seeded sampling is unchanged
too; rejected drafts leave no block behind and never reach the prefix cache; max_tokens, stop tokens,
logprobs, penalties and aborts behave as without speculation."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from hosted.block_manager import chain_hash
from hosted.engine import EngineConfig, LLMEngine, SamplingParams
from hosted.models import DEMO_MODEL_DIR
from hosted.tokenizer import Tokenizer

# Input-grounded: the continuation copies the prompt, so n-gram proposals are often right.
CODE = ("def parse_args(argv):\n    parser = argparse.ArgumentParser()\n    parser.add_argument('--name')\n"
        "    return parser.parse_args(argv)\n\n")
TEXTS = [CODE * 2 + "def parse_args(argv):\n", "The os module provides a portable way of using",
         "Return the list of files in the directory", CODE + "class Config:\n    \"\"\"Settings.\"\"\"\n"]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(DEMO_MODEL_DIR)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def subset_draft(tmp_path_factory) -> str:
    """The demo model's first two layers (same embeddings and head): a cheap draft with partial acceptance."""
    out = tmp_path_factory.mktemp("draft2")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copy(f"{DEMO_MODEL_DIR}/{name}", out / name)
    config = json.loads(Path(DEMO_MODEL_DIR, "config.json").read_text())
    config["num_hidden_layers"] = 2
    (out / "config.json").write_text(json.dumps(config))
    weights = load_file(f"{DEMO_MODEL_DIR}/model.safetensors")
    keep = {k: v for k, v in weights.items() if not k.startswith("model.layers.") or k.split(".")[2] in ("0", "1")}
    save_file(keep, str(out / "model.safetensors"))
    return str(out)


@pytest.fixture(scope="module")
def plain_engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=DEMO_MODEL_DIR, num_kv_blocks=128))


def _engine(**kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 128)
    kw.setdefault("spec_adaptive", False)  # verify every draft offered: exercise the rejection paths
    return LLMEngine(EngineConfig(model_dir=DEMO_MODEL_DIR, **kw))


def _drain(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]], stagger: int = 0):
    """Run requests (one more every `stagger` steps, or all at once); each one's StepOutputs."""
    pending = list(requests.items())
    outs: dict[str, list] = {rid: [] for rid in requests}
    step = 0
    while pending or engine.has_unfinished():
        if pending and (stagger == 0 or step % stagger == 0):
            batch = pending if stagger == 0 else pending[:1]
            for rid, (prompt, params) in batch:
                engine.add_request(rid, prompt, params)
            pending = pending[len(batch):]
        for o in engine.step():
            outs[o.request_id].append(o)
        step += 1
    _assert_drained(engine)
    return outs


def _tokens(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def _assert_drained(engine: LLMEngine) -> None:
    assert not engine.has_unfinished()
    engine.block_manager.check_all_free()
    if engine.spec is not None and engine.spec.draft is not None:
        engine.spec.draft.block_manager.check_all_free()


def _greedy(n: int = 40) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _plain(plain_engine, prompts, params) -> list[list[int]]:
    outs = _drain(plain_engine, {f"p{i}": (p, params) for i, p in enumerate(prompts)})
    return [_tokens(outs[f"p{i}"]) for i in range(len(prompts))]


@pytest.mark.parametrize("kind", ["ngram", "draft-self", "draft-subset"])
def test_greedy_equals_plain_solo_and_batched(kind, prompts, plain_engine, subset_draft):
    want = _plain(plain_engine, prompts, _greedy())
    kw = {"ngram": {"speculative": "ngram"}, "draft-self": {"draft_model_dir": DEMO_MODEL_DIR},
          "draft-subset": {"draft_model_dir": subset_draft}}[kind]
    engine = _engine(**kw)
    for i, p in enumerate(prompts):  # solo
        assert _tokens(_drain(engine, {"a": (p, _greedy())})["a"]) == want[i], f"prompt {i} alone"
    # Batched, arriving one every 3 steps: sequences of different lengths, speculating or still prefilling.
    outs = _drain(engine, {f"r{i}": (p, _greedy()) for i, p in enumerate(prompts)}, stagger=3)
    assert [_tokens(outs[f"r{i}"]) for i in range(len(prompts))] == want
    s = engine.stats()
    assert s.spec_proposed_tokens > 0 and s.spec_accepted_tokens > 0
    if kind == "draft-self":
        assert s.spec_accepted_tokens == s.spec_proposed_tokens  # the target as its own draft: all accepted
    else:
        assert s.spec_accepted_tokens < s.spec_proposed_tokens  # some rejections were rolled back
    assert s.num_steps < s.num_generated_tokens + len(prompts) * 3  # fewer steps than tokens: it speculated


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_preemption_in_a_tiny_pool(kind, prompts, plain_engine, subset_draft):
    params = _greedy(48)
    want = _plain(plain_engine, prompts, params)
    kw = {"speculative": "ngram"} if kind == "ngram" else {"draft_model_dir": subset_draft}
    engine = _engine(num_kv_blocks=20, block_size=8, max_num_seqs=4, max_num_batched_tokens=40, **kw)
    outs = _drain(engine, {f"r{i}": (p, params) for i, p in enumerate(prompts)})
    assert [_tokens(outs[f"r{i}"]) for i in range(len(prompts))] == want
    s = engine.stats()
    assert s.num_preemptions > 0, "the pool was meant to be too small"
    assert s.spec_accepted_tokens > 0


def test_prefix_cache_never_holds_rejected_tokens(prompts, plain_engine, subset_draft):
    engine = _engine(draft_model_dir=subset_draft, block_size=4)
    prompt = prompts[0]
    out = _tokens(_drain(engine, {"a": (prompt, _greedy(60))})["a"])
    s = engine.stats()
    assert s.spec_accepted_tokens < s.spec_proposed_tokens  # rejections happened
    full = prompt + out
    bs = engine.block_manager.block_size
    expected, parent = set(), 0
    for i in range(len(full) // bs):
        parent = chain_hash(parent, full[i * bs:(i + 1) * bs])
        expected.add(parent)
    cached = {b.hash for b in engine.block_manager.blocks if b.hash != -1}
    assert cached and cached <= expected
    # And a follow-up turn served from that cache continues exactly as without speculation.
    follow = full[:len(full) - 3]
    want = _plain(plain_engine, [follow], _greedy(12))[0]
    outs = _drain(engine, {"b": (follow, _greedy(12))})["b"]
    assert outs[-1].num_cached_tokens > 0 and _tokens(outs) == want


def test_max_tokens_stop_tokens_and_eos(prompts, plain_engine):
    engine = _engine(speculative="ngram", num_speculative_tokens=6)
    grounded = prompts[0]
    free = _plain(plain_engine, [grounded], _greedy(40))[0]
    for n in (1, 2, 5, 7):
        got = _tokens(_drain(engine, {"a": (grounded, _greedy(n))})["a"])
        assert got == free[:n]
    stop = free[9]  # a token the greedy output reaches: output ends there, with it
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[stop])
    outs = _drain(engine, {"a": (grounded, params)})["a"]
    assert _tokens(outs) == free[:free.index(stop) + 1] and outs[-1].finish_reason == "stop"
    with_eos = SamplingParams(max_tokens=120, temperature=0.0)  # the demo model does emit EOS
    for i, p in enumerate(prompts):
        want = _plain(plain_engine, [p], with_eos)[0]
        outs = _drain(engine, {"a": (p, with_eos)})["a"]
        assert _tokens(outs) == want, f"prompt {i}"
        assert outs[-1].finish_reason == ("stop" if want[-1] in engine.eos_token_ids else "length")


def test_logprobs_of_accepted_tokens_come_from_the_target(prompts, plain_engine):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3)
    want = _drain(plain_engine, {"a": (prompts[0], params)})["a"]
    engine = _engine(speculative="ngram")
    got = _drain(engine, {"a": (prompts[0], params)})["a"]
    assert any(len(o.new_token_ids) > 1 for o in got)
    want_lp = [lp for o in want for lp in o.logprobs]
    got_lp = [lp for o in got for lp in o.logprobs]
    assert [lp.token_id for lp in got_lp] == [lp.token_id for lp in want_lp]
    for a, b in zip(got_lp, want_lp):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4)


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_seeded_sampling_and_penalties_unchanged(kind, prompts, plain_engine, subset_draft):
    """A seeded request draws its noise row by row as the plain sampler does, and point-mass drafts are accepted
    exactly when they equal that draw: its tokens are the same with and without speculation. Penalties count
    the drafts ahead of each verified row."""
    kw = {"speculative": "ngram"} if kind == "ngram" else {"draft_model_dir": subset_draft}
    engine = _engine(**kw)
    cases = {
        "seeded": SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
        "topk": SamplingParams(max_tokens=30, temperature=1.2, top_k=20, seed=3, ignore_eos=True),
        "penalised": SamplingParams(max_tokens=30, temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3,
                                    ignore_eos=True),
        "penalised-seeded": SamplingParams(max_tokens=30, temperature=0.7, frequency_penalty=-0.4, seed=11,
                                           ignore_eos=True),
    }
    for name, params in cases.items():
        want = _plain(plain_engine, [prompts[0]], params)[0]
        assert _tokens(_drain(engine, {"a": (prompts[0], params)})["a"]) == want, name
    assert engine.stats().spec_accepted_tokens > 0


def test_unseeded_sampling_with_a_sampling_draft_runs_clean(prompts, subset_draft):
    engine = _engine(draft_model_dir=subset_draft)
    params = SamplingParams(max_tokens=30, temperature=0.9, ignore_eos=True)
    outs = _drain(engine, {f"r{i}": (p, params) for i, p in enumerate(prompts)})
    assert all(len(_tokens(o)) == 30 for o in outs.values())
    assert engine.stats().spec_proposed_tokens > 0


def test_abort_mid_speculation_frees_target_and_draft_blocks(prompts, subset_draft):
    engine = _engine(draft_model_dir=subset_draft)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, _greedy(60))
    for _ in range(6):
        engine.step()
    assert engine.stats().spec_proposed_tokens > 0
    for i in range(len(prompts)):
        engine.abort_request(f"r{i}")
    outs = engine.step()
    assert {o.request_id for o in outs} == {f"r{i}" for i in range(len(prompts))}
    assert all(o.finish_reason == "abort" for o in outs)
    _assert_drained(engine)


def test_mixed_speculating_and_plain_rows_in_one_batch(prompts, plain_engine):
    """max_tokens=1 requests never speculate; they share steps with ones that do."""
    engine = _engine(speculative="ngram")
    reqs = {f"r{i}": (p, _greedy(1 if i % 2 else 30)) for i, p in enumerate(prompts * 2)}
    outs = _drain(engine, reqs)
    for rid, (p, params) in reqs.items():
        assert _tokens(outs[rid]) == _plain(plain_engine, [p], params)[0], rid


def test_adaptive_k_keeps_output_and_turns_off_for_a_draft_as_costly_as_the_target(prompts, plain_engine):
    want = _plain(plain_engine, prompts[:2], _greedy(60))
    engine = _engine(draft_model_dir=DEMO_MODEL_DIR, spec_adaptive=True)
    outs = _drain(engine, {"a": (prompts[0], _greedy(60)), "b": (prompts[1], _greedy(60))})
    assert [_tokens(outs["a"]), _tokens(outs["b"])] == want
    # k drafts from a draft as big as the target cost k target steps: the planner stops after measuring that.
    spec = engine.spec
    before = spec.num_proposed
    outs = _drain(engine, {"c": (prompts[0], _greedy(40))})
    assert spec.num_proposed - before <= 40 // 4, "speculation stayed on with a draft as costly as the target"


def test_config_validation():
    for bad, msg in [({"speculative": "eagle"}, "speculative"), ({"speculative": "draft"}, "draft_model_dir"),
                     ({"speculative": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                     ({"speculative": "ngram", "spec_ngram_min": 3, "spec_ngram_max": 2}, "n-gram")]:
        with pytest.raises(ValueError, match=msg):
            EngineConfig(model_dir=DEMO_MODEL_DIR, **bad).validate()
    assert EngineConfig(model_dir=DEMO_MODEL_DIR, draft_model_dir="x").spec_method == "draft"
    assert EngineConfig(model_dir=DEMO_MODEL_DIR).spec_method is None


def test_draft_with_another_vocabulary_is_refused(tiny_model_dirs):
    with pytest.raises(ValueError, match="vocabulary"):
        LLMEngine(EngineConfig(model_dir=DEMO_MODEL_DIR, draft_model_dir=tiny_model_dirs["llama"], num_kv_blocks=16))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_target_and_draft_share_the_native_kernels_and_stay_lossless(scheme, prompts, subset_draft):
    """With --quantization the draft is quantized like the target and both read through the packed native
    GEMMs (VNNI strips, int8 head); verification of k drafts in one forward then gives exactly the greedy
    tokens of plain decoding with the same kernels (each output is one fixed-order sum, whatever the rows)."""
    from kernels import cpu_lowp

    if not cpu_lowp.features() & cpu_lowp.FEATURE_VNNI:
        pytest.skip("this CPU or build has no AVX512-VNNI kernels")
    quant = {"quantization": scheme, "quantization_group_size": 32}
    plain = LLMEngine(EngineConfig(model_dir=DEMO_MODEL_DIR, num_kv_blocks=128, **quant))
    want = _plain(plain, prompts, _greedy(24))
    engine = _engine(draft_model_dir=subset_draft, **quant)
    target_layer = engine.runner.model.layers[0].mlp.down_proj
    draft_layer = engine.spec.draft.runner.model.layers[0].mlp.down_proj
    for layer in (target_layer, draft_layer):
        assert isinstance(layer.packed, cpu_lowp.Int8Strips if scheme == "int8" else cpu_lowp.Int4Strips)
    outs = _drain(engine, {f"r{i}": (p, _greedy(24)) for i, p in enumerate(prompts)}, stagger=2)
    assert [_tokens(outs[f"r{i}"]) for i in range(len(prompts))] == want
    assert engine.stats().spec_accepted_tokens > 0
