"""Decode bursts (LLMEngine.step(burst_s=...), EngineConfig.decode_burst_ms): decode-only iterations run back to
back inside one step() call and their tokens come out together. Greedy batches take one native call for the
whole burst (DecodeStep.greedy: embedding, layers, head and argmax in C); anything else runs regular iterations.
Either way the tokens, finish reasons, counters and the KV pool must come out exactly as from one iteration per
step() call."""
from __future__ import annotations

import threading

import pytest
import torch

from hosted.config import EngineConfig
from hosted.engine import BurstInterrupt, LLMEngine, SamplingParams
from kernels import cpu_lowp
from tests.hosted.test_engine_decode_step import _small_llama
from tests.kernels.native_setup import native_on, needs_compiler  # noqa: F401 (native_on: autouse fixture)

pytestmark = needs_compiler

PROMPTS = [[5, 6, 7, 8, 9], [3], [(i * 37) % 300 + 10 for i in range(45)], list(range(40, 61))]
PRECISIONS = {"fp32": {"dtype": "float32"}, "bf16": {"dtype": "bfloat16"},
              "int8": {"dtype": "float32", "quantization": "int8"}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _small_llama(tmp_path_factory.mktemp("decode_burst"), tied=True)


def _engine(model_dir: str, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 128)
    return LLMEngine(EngineConfig(model_dir=model_dir, max_num_batched_tokens=256, enable_prefix_caching=False,
                                  **kw))


def _count_native_bursts(engine: LLMEngine) -> list[int]:
    """A counter of the engine's native greedy calls (ModelRunner.decode_greedy)."""
    calls, real = [0], engine.runner.decode_greedy

    def counting(*args):
        calls[0] += 1
        return real(*args)

    engine.runner.decode_greedy = counting
    return calls


def _run(engine: LLMEngine, params: list[SamplingParams], burst_s: float, interrupt=None, prompts=PROMPTS):
    """Every request to its end; (tokens, finish reasons, logprob counts, step() calls, the largest number of
    tokens one request got from one call)."""
    ids = [f"r{engine.stats().num_steps}-{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params):
        engine.add_request(rid, prompt, p)
    tokens = {rid: [] for rid in ids}
    reasons, logprobs = {}, dict.fromkeys(ids, 0)
    calls = widest = 0
    while engine.has_unfinished():
        calls += 1
        for out in engine.step(burst_s=burst_s, interrupt=interrupt):
            tokens[out.request_id] += out.new_token_ids
            widest = max(widest, len(out.new_token_ids))
            logprobs[out.request_id] += len(out.logprobs or [])
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    return ([tokens[r] for r in ids], [reasons[r] for r in ids], [logprobs[r] for r in ids], calls, widest)


def _mixed_greedy(reference_tokens: list[list[int]]) -> list[SamplingParams]:
    """Greedy requests that end every way a request can: by length, by a stop token the model really makes
    mid-burst (taken from a run without one), by EOS ignored, by its stop token early."""
    return [SamplingParams(max_tokens=23, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[reference_tokens[1][9]]),
            SamplingParams(max_tokens=17, temperature=0.0),
            SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[reference_tokens[3][2], 7])]


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_greedy_bursts_equal_one_iteration_per_step(precision, model_dir):
    if precision == "int8" and not cpu_lowp.features() & cpu_lowp.FEATURE_VNNI:
        pytest.skip("no native int8 kernels on this CPU (the engine uses the torch reference)")
    engine = _engine(model_dir, **PRECISIONS[precision])
    assert engine.runner.can_decode_greedy
    plain = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * len(PROMPTS)
    reference = _run(engine, plain, 0.0)[0]
    params = _mixed_greedy(reference)
    expected, expected_reasons, _, calls_one, _ = _run(engine, params, 0.0)
    native = _count_native_bursts(engine)
    got, reasons, _, calls, widest = _run(engine, params, 60.0)
    assert native[0] > 0
    assert got == expected and reasons == expected_reasons
    assert reasons == ["length", "stop", "length", "stop"]
    assert widest > 1 and calls < calls_one  # the bursts did run: several tokens per call


def test_a_greedy_burst_counts_steps_and_tokens_as_single_iterations(model_dir):
    engine = _engine(model_dir)
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)] * 2
    _run(engine, params, 0.0, prompts=PROMPTS[:2])
    one = engine.stats()
    _run(engine, params, 60.0, prompts=PROMPTS[:2])
    two = engine.stats()
    assert two.num_generated_tokens - one.num_generated_tokens == one.num_generated_tokens == 60
    assert two.num_steps - one.num_steps == one.num_steps
    assert two.num_computed_tokens - one.num_computed_tokens == one.num_computed_tokens
    assert two.busy_seconds > one.busy_seconds


def test_sampled_and_logprob_requests_burst_through_regular_iterations(model_dir):
    """Seeded sampling and logprobs need the Python sampler: their bursts are iterations back to back, with each
    request's tokens and logprobs merged in order."""
    engine = _engine(model_dir)
    params = [SamplingParams(max_tokens=25, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=25, temperature=0.0, logprobs=True, top_logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=25, temperature=0.0, presence_penalty=0.5, ignore_eos=True),
              SamplingParams(max_tokens=25, temperature=0.7, top_k=20, seed=3, ignore_eos=True)]
    expected = _run(engine, params, 0.0)
    native = _count_native_bursts(engine)
    got = _run(engine, params, 60.0)
    assert native[0] == 0
    assert got[0] == expected[0] and got[1] == expected[1]
    assert got[2] == expected[2] == [0, 25, 0, 0]
    assert got[4] > 1 and got[3] < expected[3]


def test_a_raised_interrupt_ends_each_burst_after_its_first_iteration(model_dir):
    engine = _engine(model_dir)
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * 2
    expected = _run(engine, params, 0.0, prompts=PROMPTS[:2])
    interrupt = BurstInterrupt()
    interrupt.set()
    got = _run(engine, params, 60.0, interrupt=interrupt, prompts=PROMPTS[:2])
    assert got[0] == expected[0] and got[4] == 1 and got[3] == expected[3]


def test_an_interrupt_ends_a_native_burst_after_its_step_in_progress(model_dir):
    """Raised from another thread while one native call runs many steps: the call returns early."""
    engine = _engine(model_dir)
    step = engine.runner.model.decode_step
    interrupt = BurstInterrupt()
    table = torch.arange(0, 12, dtype=torch.int32)[None]
    stops, budget = torch.full((1, 1), -1, dtype=torch.int32), torch.tensor([180], dtype=torch.int32)
    full = step.greedy(torch.tensor([42]), torch.tensor([0]), table, stops, budget, 180)
    assert full.shape == (1, 180)
    interrupt.set()  # already raised: the call stops after its first step
    assert step.greedy(torch.tensor([42]), torch.tensor([0]), table, stops, budget, 180,
                       interrupt.flag).tolist() == [full[0, :1].tolist()]
    timer = threading.Timer(0.002, interrupt.set)
    interrupt.clear()
    timer.start()
    got = step.greedy(torch.tensor([42]), torch.tensor([0]), table, stops, budget, 180, interrupt.flag)
    timer.join()
    # Where the call stopped depends on the machine's speed; what it made must be the uninterrupted call's start.
    assert got[0].tolist() == full[0, :got.shape[1]].tolist()


def test_a_burst_takes_only_the_blocks_that_are_free(model_dir):
    """A pool too small for every sequence's whole burst: the native burst shrinks to what fits, regular
    iterations (which may preempt) take over when nothing does, and every block comes back."""
    engine = _engine(model_dir, num_kv_blocks=10, block_size=4)
    prompts = [list(range(10, 16)), list(range(30, 35))]
    params = [SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)] * 2
    expected = _run(engine, params, 0.0, prompts=prompts)
    got = _run(engine, params, 60.0, prompts=prompts)
    assert got[0] == expected[0] and [len(t) for t in got[0]] == [14, 14]
    assert engine.block_manager.num_free_blocks == 10


def test_a_request_that_fills_the_context_ends_its_burst_with_length(model_dir):
    engine = _engine(model_dir, max_model_len=40)
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)]
    prompt = [list(range(20, 40))]
    expected = _run(engine, params, 0.0, prompts=prompt)
    got = _run(engine, params, 60.0, prompts=prompt)
    assert got[0] == expected[0] and len(got[0][0]) == 20 and got[1] == ["length"]


def test_greedy_native_call_equals_stepping_the_logits(model_dir):
    """DecodeStep.greedy against the same native step's logits, argmax'd and fed back by hand (on blocks 0-2 of
    an idle engine's pool)."""
    engine = _engine(model_dir)
    step = engine.runner.model.decode_step
    embed = engine.runner.model.embed_tokens.weight
    table = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    tokens, positions = torch.tensor([42]), torch.tensor([0])
    stops, budget = torch.full((1, 1), -1, dtype=torch.int32), torch.tensor([9], dtype=torch.int32)
    got = step.greedy(tokens, positions, table, stops, budget, 6)
    assert got.shape == (1, 6)
    expected, token = [], 42
    for pos in range(6):
        logits = step.logits(embed[token:token + 1].float(), torch.tensor([pos]), torch.tensor([pos]), table,
                             torch.tensor([pos + 1], dtype=torch.int32))
        token = int(logits.argmax())
        expected.append(token)
    assert got[0].tolist() == expected
    # A stop id ends the call after the step that makes it; a budget after that many tokens.
    stopped = step.greedy(tokens, positions, table, torch.tensor([[expected[2]]], dtype=torch.int32), budget, 6)
    assert stopped[0].tolist() == expected[:expected.index(expected[2]) + 1]
    assert step.greedy(tokens, positions, table, stops, torch.tensor([2], dtype=torch.int32), 6)[0].tolist() == \
        expected[:2]


def test_greedy_native_call_rejects_bad_inputs(model_dir):
    engine = _engine(model_dir)
    step = engine.runner.model.decode_step
    table = torch.zeros(1, 2, dtype=torch.int32)
    stops, budget = torch.full((1, 1), -1, dtype=torch.int32), torch.tensor([4], dtype=torch.int32)
    with pytest.raises(ValueError, match="outside the embedding table"):
        step.greedy(torch.tensor([10_000]), torch.tensor([0]), table, stops, budget, 2)
    with pytest.raises(ValueError, match="needs more blocks"):
        step.greedy(torch.tensor([1]), torch.tensor([30]), table, stops, budget, 4)
    with pytest.raises(ValueError, match="greedy inputs"):
        step.greedy(torch.tensor([1]), torch.tensor([0]), table.long(), stops, budget, 2)
    # Steps 0-1 would write block 0; step 2 needs a block outside the pool: the call fails before any write.
    cache = engine.runner.kv_cache
    before = cache.clone()
    with pytest.raises(ValueError, match="outside the pool"):
        step.greedy(torch.tensor([1]), torch.tensor([14]), torch.tensor([[0, 10_000]], dtype=torch.int32), stops,
                    budget, 4)
    assert torch.equal(cache, before)


def test_decode_burst_ms_is_validated():
    with pytest.raises(ValueError, match="decode_burst_ms"):
        EngineConfig(model_dir="x", decode_burst_ms=-1).validate()
    with pytest.raises(ValueError, match="decode_burst_ms"):
        EngineConfig(model_dir="x", decode_burst_ms="20").validate()
