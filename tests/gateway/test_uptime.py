"""The uptime recorder: paid (up) and busy seconds per engine per interval, from the busy counter."""
from __future__ import annotations

import pytest

from gateway.ledger.record import UptimeRecord
from gateway.uptime import DevicePrice, UptimeRecorder


def recorder(rows: list[UptimeRecord], **kw) -> UptimeRecorder:
    r = UptimeRecorder(rows.append, interval_s=60.0, max_gap_s=5.0, instance="gw1", **kw)
    r.set_prices({"eng": DevicePrice(2.5, 1, "gpu")})
    return r


def test_up_and_busy_time_are_cut_into_intervals() -> None:
    rows: list[UptimeRecord] = []
    r = recorder(rows)
    # scrapes every second from wall 0 to 130: busy counter grows 0.25 s per second
    for t in range(0, 131):
        r.observe("eng", 0.25 * t, mono=1000.0 + t, wall=float(t))
    r.flush()
    assert [row.seconds for row in rows] == [pytest.approx(59.0), pytest.approx(60.0), pytest.approx(11.0)]
    assert [row.busy_seconds for row in rows] == [pytest.approx(0.25 * 59), pytest.approx(15.0),
                                                  pytest.approx(0.25 * 11)]
    assert rows[0].created_at.isoformat() == "1970-01-01T00:00:00+00:00"
    assert rows[1].interval_id == "eng|1970-01-01T00:01:00+00:00|gw1"
    assert {(row.backend, row.device_hour_usd, row.devices, row.device_kind) for row in rows} == {
        ("eng", 2.5, 1, "gpu")}


def test_a_silent_engine_is_not_counted_as_up_and_a_restart_resets_the_counter() -> None:
    rows: list[UptimeRecord] = []
    r = recorder(rows)
    r.observe("eng", 10.0, mono=0.0, wall=0.0)
    r.observe("eng", 11.0, mono=2.0, wall=2.0)  # 2 s up, 1 s busy
    r.lost("eng")  # scrapes failed...
    r.observe("eng", 12.0, mono=30.0, wall=30.0)  # ...first answer again: nothing counted
    r.observe("eng", 12.5, mono=32.0, wall=32.0)  # 2 s up, 0.5 busy
    r.observe("eng", 0.5, mono=33.0, wall=33.0)  # restarted: its counter began again: 1 s up, 0.5 busy
    r.observe("eng", 0.5, mono=53.0, wall=53.0)  # a 20 s gap without a failed scrape: capped at max_gap_s
    r.observe("eng", 99.0, mono=54.0, wall=54.0)  # busy can never exceed up
    r.flush()
    assert len(rows) == 1
    assert rows[0].seconds == pytest.approx(2 + 2 + 1 + 5 + 1)
    assert rows[0].busy_seconds == pytest.approx(1 + 0.5 + 0.5 + 0 + 1)


def test_only_priced_engines_are_recorded_and_removed_ones_are_written_out() -> None:
    rows: list[UptimeRecord] = []
    r = recorder(rows)
    r.observe("other", 1.0, mono=0.0, wall=0.0)  # not in the policy
    r.observe("eng", None, mono=0.0, wall=0.0)  # an engine without the busy counter
    r.observe("eng", 0.0, mono=1.0, wall=1.0)
    r.observe("eng", 1.0, mono=3.0, wall=3.0)
    r.set_prices({})  # the policy dropped it: its open interval is written
    assert [(row.backend, row.seconds, row.busy_seconds) for row in rows] == [("eng", 2.0, 1.0)]
    r.flush()
    assert len(rows) == 1
