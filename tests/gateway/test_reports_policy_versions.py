"""Issue 31 findings 2 and 6: reports price each row by the policy that served it, and scale traffic and engine
time over one window.

Real SQLite and PostgreSQL (migrated to head). The policy texts are stored by the gateway's own writer
(gateway/ledger/policy_versions.py), the report is `switchyard report spreadsheet --format csv` (its `run`), and
the expected figures are worked out here by hand from the rows and the prices written in the test's policies.
Before the fix the report priced with the packaged policies/default.yaml: the served API backend was
"unpriced", the reference API was default.yaml's, and a 17-minute window projected an always-on $2.50/h engine
at a quarter of its $1,825/month.
"""
from __future__ import annotations

import argparse
import asyncio
import csv
import io
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from gateway import db
from gateway.ledger.models import EngineUptimeRow, PolicyVersionRow, RequestRow
from gateway.ledger.policy_versions import PolicyVersionWriter, version_of
from gateway.ledger.record import LedgerRecord, UptimeRecord
from gateway.policy import load_policy
from gateway.reports import workbook

T0 = datetime(2026, 5, 4, 9, 0, tzinfo=UTC)

POLICY = """\
# {comment}
backends:
  house-api:
    kind: litellm
    model: acme/house-model-1
    api_base: http://127.0.0.1:9/v1
    input_usd_per_mtok: 2.00
    cached_input_usd_per_mtok: 1.00
    output_usd_per_mtok: {output}
  local:
    kind: engine
    model: local
    api_base: http://127.0.0.1:9/v1
    gpu_hour_usd: 2.50
routes:
  chat:
    strategy: fixed
    backend: local
    fallbacks: [house-api]
    counterfactual: house-api
  house:
    strategy: fixed
    backend: house-api
"""


def _policy_file(tmp_path: Path, name: str, output: float, comment: str = "v1") -> Path:
    path = tmp_path / name
    path.write_text(POLICY.format(output=f"{output:.2f}", comment=comment))
    return path


def _store(url: str, tmp_path: Path, *paths: Path) -> list[str]:
    """Each policy's text, written the way the gateway writes it when it loads one."""

    async def go() -> list[str]:
        writer = PolicyVersionWriter(db.async_url(url), tmp_path / "pv-spool.jsonl")
        await writer.start()
        versions = []
        for p in paths:
            policy = load_policy(p)
            assert await writer.record(policy)
            assert await writer.record(policy)  # once per version
            versions.append(policy.version)
        await writer.close()
        return versions

    return asyncio.run(go())


def _insert(url: str, records: list, table=RequestRow.__table__) -> None:
    engine = sa.create_engine(db.sync_url(url))
    try:
        with engine.begin() as conn:
            conn.execute(table.insert(), [r.to_row() for r in records])
    finally:
        engine.dispose()


def _api_row(i: int, at: datetime, version: str | None, prompt: int = 1_000_000, completion: int = 100_000):
    return LedgerRecord(request_id=f"api-{i}", created_at=at, requested_model="house", route="house",
                        backend="house-api", served_model="house-model-1", prompt_tokens=prompt,
                        completion_tokens=completion, cost_usd=1.0, cost_basis="api_price", policy_version=version)


def _report(url: str, out: Path, policy: Path | None = None) -> tuple[int, list[str], str]:
    args = argparse.Namespace(since=None, until=None, team=None, database_url=url,
                              policy=str(policy) if policy else None, out=str(out), format="csv", bench=None,
                              no_progress=True)
    o, e = io.StringIO(), io.StringIO()
    rc = workbook.run(args, out=o, err=e)
    return rc, o.getvalue().splitlines(), e.getvalue()


def _csv(path: Path) -> list[list[str]]:
    with path.open(newline="", encoding="utf-8") as f:
        return list(csv.reader(f))


def _decision(out: Path) -> dict[str, float | str]:
    values = {}
    for row in _csv(out / "decision.csv")[1:]:
        if len(row) >= 2 and row[0]:
            try:
                values[row[0]] = float(row[1])
            except ValueError:
                values[row[0]] = row[1]
    return values


def test_stored_text_is_the_exact_text_of_its_version(migrated_db_url, tmp_path):
    p1 = _policy_file(tmp_path, "a.yaml", 8.0)
    (v1,) = _store(migrated_db_url, tmp_path, p1)
    engine = sa.create_engine(db.sync_url(migrated_db_url))
    try:
        with engine.connect() as conn:
            rows = list(conn.execute(sa.select(PolicyVersionRow.__table__)))
    finally:
        engine.dispose()
    assert len(rows) == 1 and rows[0].version == v1 == version_of(rows[0].text)
    assert rows[0].text == p1.read_text() and rows[0].source == str(p1)


def test_report_prices_rows_by_the_policy_that_served_them(migrated_db_url, tmp_path):
    p1 = _policy_file(tmp_path, "served.yaml", 8.0)
    (v1,) = _store(migrated_db_url, tmp_path, p1)
    _insert(migrated_db_url, [_api_row(0, T0, v1), _api_row(1, T0 + timedelta(hours=2), v1)])
    p1.unlink()  # the report must not need the file: the ledger holds the text
    rc, printed, err = _report(migrated_db_url, tmp_path / "out")
    assert rc == 0, err
    prices = {r[0]: r for r in _csv(tmp_path / "out" / "prices.csv")[1:] if r}
    assert prices["house-api"][6].startswith("priced") and float(prices["house-api"][4]) == 8.0
    assert f"prices: the policy that served the rows (version {v1})" in printed
    d = _decision(tmp_path / "out")
    assert d["reference API"] == "house-api"  # the route's counterfactual in the policy that served
    scale = 730 / 2.0  # two hours of traffic
    expected = scale * (2 * 1_000_000 * 2.00 + 2 * 100_000 * 8.00) / 1e6
    assert d["all-API USD/month"] == pytest.approx(expected, rel=1e-9)
    assert d["current mix: API part USD/month"] == pytest.approx(expected, rel=1e-9)


def test_a_window_over_two_versions_prices_each_by_its_own(migrated_db_url, tmp_path):
    p1, p2 = _policy_file(tmp_path, "one.yaml", 8.0, "v1"), _policy_file(tmp_path, "two.yaml", 16.0, "v2")
    v1, v2 = _store(migrated_db_url, tmp_path, p1, p2)
    _insert(migrated_db_url, [_api_row(0, T0, v1), _api_row(1, T0 + timedelta(hours=1), v1),
                              _api_row(2, T0 + timedelta(hours=2), v2, prompt=500_000, completion=300_000)])
    rc, printed, err = _report(migrated_db_url, tmp_path / "out")
    assert rc == 0, err
    assert "prices: each row by the policy version that served it (2 versions in the window)" in printed
    assert any(line.strip().startswith(f"policy version {v1}: 2 rows") for line in printed)
    assert any(line.strip().startswith(f"policy version {v2}: 1 rows") for line in printed)
    api = {r[0]: r for r in _csv(tmp_path / "out" / "decision_api.csv")[1:] if r}
    assert float(api[f"house-api @ {v1}"][6]) == 8.0 and float(api[f"house-api @ {v2}"][6]) == 16.0
    by_v1 = (2_000_000 * 2.00 + 200_000 * 8.00) / 1e6
    by_v2 = (500_000 * 2.00 + 300_000 * 16.00) / 1e6
    assert float(api[f"house-api @ {v1}"][7]) == pytest.approx(by_v1)
    assert float(api[f"house-api @ {v2}"][7]) == pytest.approx(by_v2)
    d = _decision(tmp_path / "out")
    assert d["current mix: API part USD/month"] == pytest.approx(730 / 2.0 * (by_v1 + by_v2), rel=1e-9)
    notes = {r[0]: r[1] for r in _csv(tmp_path / "out" / "notes.csv")[1:] if len(r) > 1}
    assert notes["policy"] == "each row by the policy version that served it (2 versions in the window)"


def test_policy_flag_is_a_labelled_what_if(migrated_db_url, tmp_path):
    p1, p2 = _policy_file(tmp_path, "one.yaml", 8.0, "v1"), _policy_file(tmp_path, "two.yaml", 16.0, "v2")
    (v1,) = _store(migrated_db_url, tmp_path, p1)
    _insert(migrated_db_url, [_api_row(0, T0, v1), _api_row(1, T0 + timedelta(hours=2), v1)])
    rc, printed, err = _report(migrated_db_url, tmp_path / "out", policy=p2)
    assert rc == 0, err
    label = next(line for line in printed if line.startswith("prices: "))
    assert label.startswith(f"prices: WHAT-IF: every row priced with {p2}") and "not with the policies" in label
    assert any(f"served by policy version {v1}" in line for line in printed)
    notes = {r[0]: r[1] for r in _csv(tmp_path / "out" / "notes.csv")[1:] if len(r) > 1}
    assert notes["policy"].startswith("WHAT-IF")
    d = _decision(tmp_path / "out")
    assert d["all-API USD/month"] == pytest.approx(365 * (2 * 2.00 + 0.2 * 16.00), rel=1e-9)


def test_rows_without_a_stored_version_fall_back_labelled(migrated_db_url, tmp_path):
    fallback = _policy_file(tmp_path, "fallback.yaml", 8.0)
    _insert(migrated_db_url, [_api_row(0, T0, "p-before-0005"), _api_row(1, T0 + timedelta(hours=2), "p-before-0005")])
    rc, printed, err = _report(migrated_db_url, tmp_path / "out", policy=None)
    assert rc == 0, err
    assert any(line.startswith("prices: no stored policy for the window's rows: priced with ") for line in printed)
    # and with --policy it is the what-if label, naming the version the rows recorded
    rc, printed, err = _report(migrated_db_url, tmp_path / "out2", policy=fallback)
    assert rc == 0, err
    assert any("served by policy version p-before-0005" in line for line in printed)


def test_short_window_projects_engine_time_over_the_same_window(migrated_db_url, tmp_path, capsys):
    """An always-on $2.50/h engine over a 17-minute ledger costs 730 h x $2.50 = $1,825 a month."""
    p1 = _policy_file(tmp_path, "served.yaml", 8.0)
    (v1,) = _store(migrated_db_url, tmp_path, p1)
    _insert(migrated_db_url, [UptimeRecord(f"local|{k}|gw", T0 + timedelta(minutes=k), "local", 60.0, 2.0, 2.50)
                              for k in range(17)], EngineUptimeRow.__table__)
    rows = [LedgerRecord(request_id=f"e-{k}", created_at=T0 + timedelta(minutes=k, seconds=30),
                         requested_model="chat", route="chat", backend="local", prompt_tokens=37,
                         completion_tokens=8, cost_usd=0.001, cost_basis="gpu_amortized", gpu_seconds=1.5,
                         device_hour_usd=2.50, device_kind="gpu", policy_version=v1) for k in range(17)]
    _insert(migrated_db_url, rows)
    rc, printed, err = _report(migrated_db_url, tmp_path / "out")
    assert rc == 0, err
    d = _decision(tmp_path / "out")
    assert d["window hours"] == pytest.approx(17 / 60)
    assert d["current mix: engines part USD/month"] == pytest.approx(1825.0, rel=1e-9)
    assert d["cost of idle USD/month"] == pytest.approx(1825.0 * (60 - 2) / 60, rel=1e-9)
    assert printed[1].startswith("SHORT WINDOW: the ledger covers 17 minutes, less than a day")
    notes = {r[0]: r[1] for r in _csv(tmp_path / "out" / "notes.csv")[1:] if len(r) > 1}
    assert notes["window length"].startswith("SHORT WINDOW")
    # `report ladder` prices at this window's measured utilisation: it says the window is short too
    from gateway.cli_handlers import report_ladder

    ladder_args = argparse.Namespace(since=None, until=None, database_url=migrated_db_url, policy=str(p1),
                                     backend=None, utilisation=None, json=True, bench=str(tmp_path / "none.json"))
    report_ladder(ladder_args)
    assert "note: SHORT WINDOW: the ledger covers 17 minutes" in capsys.readouterr().err


def test_two_always_on_engines_cost_their_own_prices_a_month(migrated_db_url, tmp_path):
    """$2.50/h and $0.40/h engines up all window: $2.90 x 730 h = $2,117/month (not both hours at both prices)."""
    p1 = _policy_file(tmp_path, "served.yaml", 8.0)
    (v1,) = _store(migrated_db_url, tmp_path, p1)
    uptime = [UptimeRecord(f"{b}|{k}|gw", T0 + timedelta(minutes=k), b, 60.0, busy, price, 1, kind)
              for k in range(120) for b, busy, price, kind in (("local", 6.0, 2.50, "gpu"), ("small", 30.0, 0.40, "cpu"))]
    _insert(migrated_db_url, uptime, EngineUptimeRow.__table__)
    _insert(migrated_db_url, [LedgerRecord(request_id=f"e-{k}", created_at=T0 + timedelta(minutes=k, seconds=30),
                                           requested_model="chat", route="chat", backend="local", prompt_tokens=37,
                                           completion_tokens=8, cost_usd=0.001, cost_basis="gpu_amortized",
                                           gpu_seconds=1.5, device_hour_usd=2.50, device_kind="gpu",
                                           policy_version=v1) for k in range(120)])
    rc, _printed, err = _report(migrated_db_url, tmp_path / "out")
    assert rc == 0, err
    d = _decision(tmp_path / "out")
    assert d["current mix: engines part USD/month"] == pytest.approx(730 * 2.90, rel=1e-9)
    idle_per_hour = 2.50 * 54 / 60 + 0.40 * 30 / 60  # each engine's idle share at its own price
    assert d["cost of idle USD/month"] == pytest.approx(730 * idle_per_hour, rel=1e-9)
    assert d["$/hour of an engine up-hour"] == pytest.approx(2.90 / 2)


async def test_a_policy_loaded_while_the_database_is_down_is_spooled_then_stored(pg_url, tmp_path):
    """The text goes the ledger's way: with PostgreSQL cut, record() does not block and the row waits in the
    spool; the next writer (the next gateway start) replays it once the database answers."""
    from tests.gateway.test_ledger_outage import _proxy_to

    db.upgrade(pg_url)
    proxy = await _proxy_to(pg_url)
    await proxy.cut()
    p1 = _policy_file(tmp_path, "down.yaml", 8.0)
    spool = tmp_path / "pv-spool.jsonl"
    writer = PolicyVersionWriter(proxy.url_for(pg_url), spool, retry_initial_s=0.1, connect_timeout_s=2)
    await writer.start()
    started = asyncio.get_running_loop().time()
    assert await writer.record(load_policy(p1))
    assert asyncio.get_running_loop().time() - started < 1.0  # never waits on the database
    await writer.close(timeout_s=3)
    assert spool.exists() or writer.replay_path.exists()

    await proxy.restore()
    again = PolicyVersionWriter(proxy.url_for(pg_url), spool, retry_initial_s=0.1)
    await again.start()
    await again.close()
    engine = sa.create_engine(db.sync_url(pg_url))
    try:
        with engine.connect() as conn:
            stored = list(conn.execute(sa.text("SELECT version, text FROM policy_versions")))
    finally:
        engine.dispose()
    assert [(r[0], r[1]) for r in stored] == [(load_policy(p1).version, p1.read_text())]
