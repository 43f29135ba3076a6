"""Continuous batching, chunked prefill, prefix caching and preemption, all at once, must not change
any request's greedy output; and the per-request bookkeeping (cached tokens, device seconds) adds up."""
from __future__ import annotations

from hosted.engine import SamplingParams

SHARED = [(i * 7) % 250 + 20 for i in range(37)]  # a 37-token "system prompt" shared by most requests


def _prompts() -> list[list[int]]:
    prompts = []
    for r in range(9):
        suffix = [(r * 31 + j * 5) % 280 + 15 for j in range(3 + 4 * r)]
        prompts.append((SHARED if r % 3 else []) + suffix)
    return prompts


def _run(engine, prompts, params, stagger: int = 0) -> dict[str, list[int]]:
    """Add requests (every `stagger` steps one more, or all at once) and collect each one's tokens."""
    out: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished():
        if pending and (stagger == 0 or step % stagger == 0):
            batch = pending if stagger == 0 else pending[:1]
            for i, prompt in batch:
                engine.add_request(f"r{i}", prompt, params)
                out[f"r{i}"] = []
            pending = pending[len(batch):]
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        step += 1
    return out


def test_everything_at_once_equals_solo(tiny_model_dirs, make_engine):
    model = tiny_model_dirs["llama"]
    prompts = _prompts()
    params = SamplingParams(max_tokens=14, temperature=0.0)
    solo_engine = make_engine(model, enable_prefix_caching=False, num_kv_blocks=64)
    solo = [solo_engine.generate([p], params)[0] for p in prompts]

    engine = make_engine(model, block_size=8, num_kv_blocks=20, max_num_batched_tokens=24, max_num_seqs=5)
    got = _run(engine, prompts, params, stagger=2)
    stats = engine.stats()
    assert stats.num_preemptions > 0, "the pool was meant to be too small: no preemption happened"
    assert stats.prefix_hit_tokens > 0, "requests sharing a prefix got no prefix-cache hits"
    for i, want in enumerate(solo):
        assert got[f"r{i}"] == want, f"request {i} (prompt {len(prompts[i])} tokens) differs from its solo run"


def test_all_added_together_with_chunked_prefill(tiny_model_dirs, make_engine):
    model = tiny_model_dirs["qwen2"]
    prompts = _prompts()
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    solo_engine = make_engine(model, enable_prefix_caching=False)
    solo = [solo_engine.generate([p], params)[0] for p in prompts]
    engine = make_engine(model, block_size=4, num_kv_blocks=40, max_num_batched_tokens=16, max_num_seqs=4)
    got = _run(engine, prompts, params)
    assert [got[f"r{i}"] for i in range(len(prompts))] == solo
    assert engine.stats().num_preemptions > 0


def test_cached_tokens_reported_and_device_seconds_add_up(tiny_model_dirs, make_engine):
    engine = make_engine(tiny_model_dirs["llama"], block_size=8)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    first = SHARED + [100, 101]
    engine.add_request("a", first, params)
    finals = {}
    while engine.has_unfinished():
        for o in engine.step():
            finals[o.request_id] = o
    assert finals["a"].num_cached_tokens == 0
    # Same 37-token prefix: 4 full blocks of 8 are cached; the last prompt token is never a hit.
    engine.add_request("b", SHARED + [200], params)
    engine.add_request("c", list(SHARED[:32]), params)  # exactly 4 blocks: only 3 may be served from cache
    seen = []
    while engine.has_unfinished():
        for o in engine.step():
            seen.append(o.device_seconds if o.request_id == "b" else None)
            finals[o.request_id] = o
    assert finals["b"].num_cached_tokens == 32
    assert finals["c"].num_cached_tokens == 24
    assert finals["b"].num_prompt_tokens == len(SHARED) + 1
    b_times = [t for t in seen if t is not None]
    assert all(t > 0 for t in b_times) and b_times == sorted(b_times)
    stats = engine.stats()
    assert stats.prefix_queries_tokens == len(first) + len(SHARED) + 1 + 32
    assert stats.prefix_hit_tokens == 56
    total = sum(o.device_seconds for o in finals.values())
    assert abs(total - stats.busy_seconds) < 1e-9


def test_abort_frees_blocks_and_is_reported(tiny_model_dirs, make_engine):
    engine = make_engine(tiny_model_dirs["llama"], max_num_seqs=2)
    params = SamplingParams(max_tokens=30, temperature=0.0)
    for rid in ("run", "other", "queued"):
        engine.add_request(rid, list(range(10, 50)), params)
    for _ in range(3):
        engine.step()
    free_before = engine.stats().kv_blocks_free
    engine.abort_request("run")
    engine.abort_request("queued")  # still waiting (max_num_seqs=2)
    engine.abort_request("no-such-request")  # ignored
    assert engine.stats().kv_blocks_free > free_before
    outs = engine.step()
    aborted = {o.request_id: o for o in outs if o.finish_reason == "abort"}
    assert set(aborted) == {"run", "queued"} and all(o.finished and not o.new_token_ids for o in aborted.values())
    while engine.has_unfinished():
        for o in engine.step():
            assert o.request_id == "other"
    assert engine.stats().num_running == 0


def test_stop_token_ids_stop(tiny_model_dirs, make_engine):
    engine = make_engine(tiny_model_dirs["mistral"])
    prompt = [30, 31, 32, 33]
    free_run = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0]
    stop = free_run[3]
    first = free_run.index(stop)
    engine.add_request("s", prompt, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop]))
    got, last = [], None
    while engine.has_unfinished():
        for o in engine.step():
            got += o.new_token_ids
            last = o
    assert got == free_run[:first + 1] and last.finish_reason == "stop"
    engine.add_request("l", prompt, SamplingParams(max_tokens=5, temperature=0.0))
    while engine.has_unfinished():
        for o in engine.step():
            last = o
    assert last.finish_reason == "length"


def test_step_time_is_split_by_tokens_processed(tiny_model_dirs, make_engine):
    engine = make_engine(tiny_model_dirs["llama"])
    params = SamplingParams(max_tokens=3, temperature=0.0)
    engine.add_request("dec", [5, 6, 7], params)
    engine.step()  # "dec" prefilled (3 tokens) and sampled its first token
    before = engine._seqs["dec"].device_seconds
    busy_before = engine.stats().busy_seconds
    engine.add_request("pre", list(range(20, 29)), params)
    engine.step()  # one step: 1 decode token for "dec" + 9 prefill tokens for "pre"
    step_time = engine.stats().busy_seconds - busy_before
    dec_share = engine._seqs["dec"].device_seconds - before
    pre_share = engine._seqs["pre"].device_seconds
    assert abs(dec_share - step_time / 10) < 1e-12 and abs(pre_share - step_time * 9 / 10) < 1e-12
    while engine.has_unfinished():
        engine.step()
