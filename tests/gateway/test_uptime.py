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
    for t in range(131):
        r.observe("eng", 0.25 * t, mono=1000.0 + t, wall=float(t))
    r.flush()
    assert [row.seconds for row in rows] == [pytest.approx(59.0), pytest.approx(60.0), pytest.approx(11.0)]
    assert [row.busy_seconds for row in rows] == [pytest.approx(0.25 * 59), pytest.approx(15.0),
                                                  pytest.approx(0.25 * 11)]
    assert rows[0].created_at.isoformat() == "1970-01-01T00:00:00+00:00"
    assert rows[1].interval_id == "eng|1970-01-01T00:01:00+00:00|gw1"
    assert {(row.backend, row.device_hour_usd, row.devices, row.device_kind) for row in rows} == {
        ("eng", 2.5, 1, "gpu")}


def test_failed_scrapes_count_as_up_a_restart_does_not_and_busy_never_exceeds_up() -> None:
    rows: list[UptimeRecord] = []
    r = recorder(rows)
    r.observe("eng", 10.0, mono=0.0, wall=0.0)
    r.observe("eng", 11.0, mono=2.0, wall=2.0)  # 2 s up, 1 s busy
    # scrapes time out for 20 s (a busy engine answers slowly); the counter carried on: the same process
    r.observe("eng", 25.0, mono=22.0, wall=22.0)  # 20 s up, 14 s busy
    r.observe("eng", 0.5, mono=42.0, wall=42.0)  # restarted, no start time: at most max_gap_s is up; 0.5 busy
    r.observe("eng", 0.7, mono=43.0, wall=43.0)  # 1 s up, 0.2 busy
    r.observe("eng", 99.0, mono=44.0, wall=44.0)  # busy can never exceed up: 1 s, 1 s
    r.observe("eng", 0.25, started_at=47.0, mono=50.0, wall=50.0)  # restarted at 47: 3 s up, 0.25 busy
    r.flush()
    assert len(rows) == 1
    assert rows[0].seconds == pytest.approx(2 + 20 + 5 + 1 + 1 + 3)
    assert rows[0].busy_seconds == pytest.approx(1 + 14 + 0.5 + 0.2 + 1 + 0.25)


def test_a_new_process_counts_from_its_start_bounded() -> None:
    rows: list[UptimeRecord] = []
    r = recorder(rows)
    r.observe("eng", 4.0, started_at=10.0, mono=5.0, wall=30.0)  # started 20 s ago, 4 s busy since
    r.observe("other", 1.0, mono=0.0, wall=0.0)
    r2_rows: list[UptimeRecord] = []
    r2 = recorder(r2_rows)
    r2.observe("eng", 50.0, started_at=0.0, mono=5.0, wall=3000.0)  # ran long before us: 300 s at most
    r.flush()
    r2.flush()
    assert [(row.seconds, row.busy_seconds) for row in rows] == [(20.0, 4.0)]
    assert [(row.seconds, row.busy_seconds) for row in r2_rows] == [(300.0, 50.0)]


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


def test_a_policy_reload_keeps_the_device_kind_the_engine_reported() -> None:
    # The policy's price guesses "gpu"; the engine says "cpu". A reload between the last scrape and the
    # shutdown flush re-guessed the kind, so the interval was written as "gpu" (a flaky chargeback test).
    rows: list[UptimeRecord] = []
    r = recorder(rows)
    r.set_kind("eng", "cpu")
    r.observe("eng", 0.0, mono=0.0, wall=0.0)
    r.observe("eng", 1.0, mono=2.0, wall=2.0)
    r.set_prices({"eng": DevicePrice(3.0, 1, "gpu")})  # a hot reload with a new price
    r.flush()
    assert [(row.device_kind, row.device_hour_usd) for row in rows] == [("cpu", 3.0)]
