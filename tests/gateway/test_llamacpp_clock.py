"""A llama.cpp engine's busy time shared among the requests running together (gateway/backends/llamacpp_clock.py),
and what its answers' `timings` say (gateway/backends/llamacpp.py). The clock reads a hand-driven time."""
from __future__ import annotations

import pytest

from gateway.backends.llamacpp import engine_root, parse_metrics, timings_span_s
from gateway.backends.llamacpp_clock import SharedBusyClock


class Time:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def clock(slots: int | None = None) -> tuple[SharedBusyClock, Time]:
    t = Time()
    c = SharedBusyClock(now=t)
    if slots:
        c.set_slots(slots)
    return c, t


def test_a_request_alone_is_charged_its_whole_span() -> None:
    c, t = clock(slots=4)
    sent = c.start()
    t.t += 2.0
    assert c.share(sent, c.now(), 1.5) == pytest.approx(1.5)
    c.finish()
    assert c.busy_seconds() == pytest.approx(2.0)


def test_two_requests_running_together_split_the_time() -> None:
    c, t = clock(slots=4)
    a = c.start()
    b = c.start()
    t.t += 4.0
    # both ran the whole 4 s in one batch: each reports a 4 s span, the device worked 4 s in all
    da = c.share(a, c.now(), 4.0)
    c.finish()
    db = c.share(b, c.now(), 4.0)
    c.finish()
    assert da == pytest.approx(2.0) and db == pytest.approx(2.0)
    assert da + db == pytest.approx(c.busy_seconds())


def test_overlap_is_shared_only_while_it_lasts() -> None:
    c, t = clock(slots=2)
    a = c.start()
    t.t += 1.0
    b = c.start()
    t.t += 2.0
    da = c.share(a, c.now(), 3.0)  # 1 s alone, 2 s shared
    c.finish()
    t.t += 1.0
    db = c.share(b, c.now(), 3.0)  # 2 s shared, 1 s alone
    c.finish()
    assert da == pytest.approx(2.0) and db == pytest.approx(2.0)
    assert da + db == pytest.approx(c.busy_seconds()) == pytest.approx(4.0)


def test_requests_queued_beyond_the_slots_share_nothing() -> None:
    # one slot: b waits in llama-server's queue while a runs, then runs alone
    c, t = clock(slots=1)
    a = c.start()
    b = c.start()
    t.t += 1.0
    da = c.share(a, c.now(), 1.0)
    c.finish()
    t.t += 1.0
    db = c.share(b, c.now(), 1.0)
    c.finish()
    assert da == pytest.approx(1.0) and db == pytest.approx(1.0)


def test_unknown_slots_count_every_request_in_flight_as_running() -> None:
    c, t = clock()
    a = c.start()
    c.start()
    t.t += 1.0
    assert c.share(a, c.now(), 1.0) == pytest.approx(0.5)


def test_a_span_longer_than_the_request_was_in_flight_is_cut_at_its_sending() -> None:
    c, t = clock(slots=1)
    t.t += 10.0  # idle
    sent = c.start()
    t.t += 1.0
    assert c.share(sent, c.now(), 5.0) == pytest.approx(1.0)


def test_busy_fraction_over_the_window() -> None:
    c, t = clock(slots=1)
    t.t += 30.0
    c.start()
    t.t += 15.0
    c.finish()
    t.t += 15.0  # 60 s since the clock began, 15 busy
    assert c.busy_fraction(60.0) == pytest.approx(0.25)
    t.t += 45.0  # the window is the last 60 s: busy from 45 to 60 s of it... none of it now
    assert c.busy_fraction(60.0) == pytest.approx(0.0)
    assert c.busy_fraction(120.0) == pytest.approx(15 / 105)


def test_old_points_are_trimmed_and_the_counter_keeps_counting() -> None:
    c, t = clock(slots=1)
    c.horizon_s = 10.0
    for _ in range(100):
        c.start()
        t.t += 1.0
        c.finish()
        t.t += 1.0
    assert len(c._points) < 40
    assert c.busy_seconds() == pytest.approx(100.0)


def test_timings_span() -> None:
    assert timings_span_s({"prompt_ms": 12.5, "predicted_ms": 487.5, "cache_n": 3}) == pytest.approx(0.5)
    assert timings_span_s({"predicted_ms": 10}) == pytest.approx(0.01)
    assert timings_span_s({"prompt_n": 3}) is None
    assert timings_span_s({"prompt_ms": -1, "predicted_ms": 1}) is None
    assert timings_span_s({"prompt_ms": "x"}) is None
    assert timings_span_s(None) is None


def test_metrics_text_and_root() -> None:
    text = ("# HELP llamacpp:requests_processing Number of requests processing\n"
            "# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 2\n"
            "llamacpp:requests_deferred 5\nllamacpp:prompt_seconds_total 1.25\nother_metric 9\n")
    assert parse_metrics(text) == {"requests_processing": 2.0, "requests_deferred": 5.0, "prompt_seconds_total": 1.25}
    assert engine_root("http://127.0.0.1:8080/v1/") == "http://127.0.0.1:8080"


def test_uptime_after_a_failed_health_check_counts_the_gap_as_a_restart() -> None:
    # llama.cpp's busy counter is the gateway's own: it never goes back when llama-server restarts, so the
    # load monitor says new_process after a failed check; the gap then counts as up for max_gap_s at most, and
    # busy for what the counter grew, not its whole value.
    from gateway.ledger.record import UptimeRecord
    from gateway.uptime import DevicePrice, UptimeRecorder

    rows: list[UptimeRecord] = []
    r = UptimeRecorder(rows.append, interval_s=600.0, max_gap_s=5.0, instance="gw1")
    r.set_prices({"llama": DevicePrice(0.5, 1, "cpu")})
    r.observe("llama", 0.0, mono=0.0, wall=0.0)
    r.observe("llama", 1.0, mono=2.0, wall=2.0)  # 2 s up, 1 busy
    r.observe("llama", 3.0, mono=62.0, wall=62.0, new_process=True)  # down for a minute: 5 s up, 2 busy
    r.observe("llama", 3.5, mono=63.0, wall=63.0)  # 1 s up, 0.5 busy
    r.flush()
    assert sum(row.seconds for row in rows) == pytest.approx(8.0)
    assert sum(row.busy_seconds for row in rows) == pytest.approx(3.5)
    rows.clear()
    # without new_process the same gap is one process running through it (our engine's case)
    r.observe("llama", 4.0, mono=64.0, wall=64.0)
    r.observe("llama", 5.0, mono=124.0, wall=124.0)
    r.flush()
    assert sum(row.seconds for row in rows) == pytest.approx(61.0)
