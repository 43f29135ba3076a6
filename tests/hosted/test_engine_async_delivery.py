"""When AsyncLLMEngine hands a step's outputs to the event loop: once the next step's inputs are built, right
before its forward (whose native code runs without the GIL, so the loop's work on the tokens overlaps it instead
of contending with the step's Python); at once when no forward follows. Nothing is lost or reordered."""
from __future__ import annotations

import asyncio

from hosted.async_llm_engine import AsyncLLMEngine, collect
from hosted.engine import SamplingParams

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_step_runs_before_forward_once_per_forward(tiny_model_dirs, make_engine):
    engine = make_engine(tiny_model_dirs["llama"])
    calls = []
    assert engine.step(before_forward=lambda: calls.append(1)) == [] and calls == []  # nothing scheduled
    engine.add_request("r", [5, 6, 7], PARAMS)
    steps = 0
    while engine.has_unfinished():
        engine.step(before_forward=lambda: calls.append(1))
        steps += 1
    assert len(calls) == steps == PARAMS.max_tokens


def test_outputs_reach_the_loop_when_the_next_forward_starts(tiny_model_dirs, make_engine):
    llm = make_engine(tiny_model_dirs["llama"], decode_burst_ms=0)  # one step per hand-over
    engine = AsyncLLMEngine(llm)
    log: list[str] = []
    runner = llm.runner
    prepare, send = runner.prepare, engine._send_pending

    def logged_prepare(batch):
        log.append("prepare")
        return prepare(batch)

    def logged_send():
        if engine._pending:
            log.append("send")
        send()

    forward = runner.model.forward

    def logged_forward(*args):
        log.append("forward")
        return forward(*args)

    runner.prepare = logged_prepare
    object.__setattr__(runner.model, "forward", logged_forward)  # nn.Module.__call__ calls self.forward
    engine._send_pending = logged_send

    async def run():
        try:
            return await collect(engine.generate("r", [5, 6, 7, 8], PARAMS))
        finally:
            await engine.shutdown()

    outputs = asyncio.run(run())
    log = list(log)
    tokens = [t for out in outputs for t in out.new_token_ids]
    runner.prepare = prepare
    object.__delattr__(runner.model, "forward")
    assert tokens == llm.generate([[5, 6, 7, 8]], PARAMS)[0]  # every token, in order
    assert outputs[-1].finished
    # one prepare, forward and send per step; each send but the last sits between the next step's inputs and
    # its forward (handing them over right after the step would put it before the next prepare)
    assert log.count("prepare") == log.count("forward") == log.count("send") == PARAMS.max_tokens
    sends = [i for i, entry in enumerate(log) if entry == "send"]
    assert all(log[i - 1] == "prepare" and log[i + 1] == "forward" for i in sends[:-1])
    assert log[-1] == "send"  # the finishing step's outputs: no forward follows, so at once


def test_bursts_hand_over_every_token_in_order_and_a_new_request_ends_them(tiny_model_dirs, make_engine):
    """With decode bursts (up to a second here) a step's outputs carry several tokens; a request submitted while
    another one bursts is admitted after the step in progress, not when the burst would have ended."""
    llm = make_engine(tiny_model_dirs["llama"], decode_burst_ms=1000)
    engine = AsyncLLMEngine(llm)
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    expected_long = llm.generate([[5, 6, 7, 8]], long)[0]
    expected_short = llm.generate([[9, 10, 11]], PARAMS)[0]

    async def run():
        long_outputs, short_outputs = [], []
        short: asyncio.Future | None = None
        left_when_short_began = None  # the long request's tokens not yet received then
        try:
            async for out in engine.generate("long", [5, 6, 7, 8], long):
                if short is not None and left_when_short_began is None and short.done():
                    left_when_short_began = long.max_tokens - sum(len(o.new_token_ids) for o in long_outputs)
                long_outputs.append(out)
                if len(long_outputs) == 1:  # the prefill's token: the long request bursts from here on
                    short = asyncio.ensure_future(collect(engine.generate("short", [9, 10, 11], PARAMS)))
            assert short is not None
            short_outputs = await short
        finally:
            await engine.shutdown()
        return long_outputs, short_outputs, left_when_short_began

    long_outputs, short_outputs, left = asyncio.run(run())
    assert [t for out in long_outputs for t in out.new_token_ids] == expected_long
    assert [t for out in short_outputs for t in out.new_token_ids] == expected_short
    assert max(len(out.new_token_ids) for out in long_outputs) > 1  # it did burst
    assert left is not None and left > 100  # the short one was done long before the long one
