"""The dashboard on a first day (issue 31, finding 8), and its decision figures against `switchyard report`.

A first day is a handful of rows in twenty minutes: one UTC hour of engine uptime, one day of spend, amounts
under a cent. Before the fix the page drew nothing for utilisation by hour (one point per engine, drawn as a
line), its daily charts' time axes read `23:59:59.9996` (a one-day bar on a date axis spans a millisecond),
sub-cent spend read `$0.00`, a negative `$-0.00`, and 0.044 busy hours `0.0`; and it priced the buy-versus-host
decision with the live policy while `switchyard report` prices each row by the policy version that served it.

Each test reads what Chromium drew (trace modes, SVG marks, tick labels, plotly's own hover labels, tiles) on the
real gateway (`switchyard serve`), against values worked out here from the seeded rows or from the report's CSV.
"""
from __future__ import annotations

import csv
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from gateway import db
from gateway.ledger.models import EngineUptimeRow, PolicyVersionRow, RequestRow
from gateway.ledger.policy_versions import version_of
from gateway.ledger.record import LedgerRecord, PolicyVersionRecord, UptimeRecord
from tests.e2e.conftest import run_cli

# `processes` is test_dashboard's module-scoped fixture (the gateways it started, stopped at the end)
from tests.e2e.test_dashboard import CHROMIUM, MASTER, _load, _serve, needs_chromium, processes, sql  # noqa: F401

MINUS = "\u2212"  # what the page (and plotly's axes) write before a negative number

POLICY = """\
# {comment}
backends:
  local:
    kind: engine
    model: local
    api_base: http://127.0.0.1:9/v1
    gpu_hour_usd: 2.50
  house-api:
    kind: litellm
    model: acme/house-model-1
    api_base: http://127.0.0.1:9/v1
    input_usd_per_mtok: {input}
    cached_input_usd_per_mtok: 1.00
    output_usd_per_mtok: {output}
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
FIRST_POLICY = POLICY.format(comment="the first day", input="2.00", output="8.00")
ENGINE_HOUR_USD = 2.50
DAY1 = datetime(2026, 5, 4, 9, 0, tzinfo=UTC)  # a Monday


def _insert(url: str, table: sa.Table, rows: list) -> None:
    engine = sa.create_engine(db.sync_url(url))
    try:
        with engine.begin() as conn:
            conn.execute(table.insert(), [r.to_row() for r in rows])
    finally:
        engine.dispose()


def _engine_row(i: int, at: datetime, version: str, *, utilisation: float, gpu_seconds: float = 0.1,
                prompt: int = 37, completion: int = 8, api: tuple[float, float] = (2.00, 8.00)) -> LedgerRecord:
    """An in-house row priced the gateway's way: device seconds at $/h, amortised at the moment's busy share."""
    list_usd = gpu_seconds * ENGINE_HOUR_USD / 3600
    return LedgerRecord(
        request_id=f"eng-{i}", created_at=at, team="search", api_key_id="key_seed", requested_model="chat",
        route="chat", backend="local", served_model="local", prompt_tokens=prompt, completion_tokens=completion,
        cost_usd=list_usd / utilisation, input_cost_usd=list_usd / utilisation, cost_basis="gpu_amortized",
        gpu_seconds=gpu_seconds, utilisation=utilisation, device_hour_usd=ENGINE_HOUR_USD, device_kind="gpu",
        busy_cost_usd=list_usd, counterfactual_cost_usd=(prompt * api[0] + completion * api[1]) / 1e6,
        route_reason="fixed", policy_version=version)


def _api_row(i: int, at: datetime, version: str, *, prompt: int = 100, completion: int = 20,
             prices: tuple[float, float] = (2.00, 8.00)) -> LedgerRecord:
    input_usd, output_usd = prompt * prices[0] / 1e6, completion * prices[1] / 1e6
    return LedgerRecord(
        request_id=f"api-{i}", created_at=at, team="support", api_key_id="key_seed", requested_model="house",
        route="house", backend="house-api", served_model="house-model-1", prompt_tokens=prompt,
        completion_tokens=completion, input_cost_usd=input_usd, output_cost_usd=output_usd,
        cost_usd=input_usd + output_usd, cost_basis="api_price", route_reason="fixed", policy_version=version)


def _uptime(at: datetime, seconds: float, busy: float) -> UptimeRecord:
    return UptimeRecord(f"local|{at.isoformat()}|gw", at, "local", seconds, busy, ENGINE_HOUR_USD)


def seed_first_day(url: str) -> None:
    """Twenty minutes of a first morning: the engine up each minute and busy 8 s of it (0.044 of 0.33 device-
    hours), four tiny engine requests that cost more than their API alternative, three sub-cent API ones. The
    rows record the live policy's version (the gateway stores its text when it starts)."""
    version = version_of(FIRST_POLICY)
    _insert(url, EngineUptimeRow.__table__, [_uptime(DAY1 + timedelta(minutes=k), 60.0, 8.0) for k in range(20)])
    _insert(url, RequestRow.__table__,
            [_engine_row(k, DAY1 + timedelta(minutes=2 + 5 * k), version, utilisation=8 / 60) for k in range(4)]
            + [_api_row(k, DAY1 + timedelta(minutes=4 + 6 * k), version) for k in range(3)])


@pytest.fixture(scope="module")
def first_day(tmp_path_factory, processes):  # noqa: F811 - the module-scoped fixture of test_dashboard
    return _serve(tmp_path_factory.mktemp("first-day"), processes, seed_first_day, FIRST_POLICY)


# --------------------------------------------------------------------------------------------- formatting


def money(v: float) -> str:
    """What a reader should see: cents from a cent up, three significant figures under one, a real minus."""
    sign = MINUS if v < 0 else ""
    a = abs(v)
    return f"{sign}${a:,.2f}" if a >= 0.01 or a == 0 else f"{sign}${float(f'{a:.3g}'):.{_decimals(a)}f}"


def _decimals(a: float) -> int:
    text = f"{float(f'{a:.3g}'):.10f}".rstrip("0")
    return max(2, len(text.split(".")[1]))


def test_the_money_oracle_is_what_the_brief_asks():
    assert [money(v) for v in (0.0042, 0.00293, -0.3, -0.00128, 1234.5, 0.0, 0.05)] == [
        "$0.0042", "$0.00293", f"{MINUS}$0.30", f"{MINUS}$0.00128", "$1,234.50", "$0.00", "$0.05"]


SECONDS = re.compile(r"\d:\d\d:\d\d|\.\d{3}")  # 23:59:59.9996 or any tick finer than a minute


# --------------------------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def drawn(first_day, tmp_path_factory):
    """The first day's page as Chromium drew it (one load for the tests below), with hover labels."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing: run `make system-tools`")
    page = _load(first_day.root, hover=True, screenshot=tmp_path_factory.mktemp("shot") / "first-day.png")
    assert page.console_errors == [] and page.remote == []
    assert all(text.startswith("data|") for text in page.texts.values()), page.texts
    return page


def _sums(url: str) -> tuple[float, float, float]:
    """The day's spend, its API part, and the in-house rows' API alternative minus their charge."""
    (total, api, saved), = sql(url, """
        SELECT SUM(cost_usd), SUM(CASE WHEN cost_basis = 'api_price' THEN cost_usd ELSE 0 END),
               SUM(CASE WHEN cost_basis = 'gpu_amortized' THEN counterfactual_cost_usd - cost_usd ELSE 0 END)
        FROM requests""")
    assert total < 0.01 and saved < 0  # what the fixture is for
    return total, api, saved


def test_a_lone_hour_of_utilisation_is_drawn_as_a_point(drawn):
    (engine,) = [t for t in drawn.charts["utilisation"] if t["dash"] != "dash"]
    assert engine["x"] == ["2026-05-04 09:00"] and engine["y"] == [pytest.approx(8 / 60)]
    assert "markers" in engine["mode"]
    assert drawn.marks["utilisation"] >= 1  # an SVG point plotly drew, not an empty line
    (break_even,) = [t for t in drawn.charts["utilisation"] if t["dash"] == "dash"]
    assert break_even["x"][0] < engine["x"][0] < break_even["x"][1]  # a line with a length, around the point
    (cumulative,) = [t for t in drawn.charts["savings"] if t["type"] == "scatter"]  # one day of savings: a point
    assert len(cumulative["x"]) == 1 and "markers" in cumulative["mode"]


def test_time_axes_read_days_and_hours_not_milliseconds(drawn):
    for name in ("spend", "idle", "savings"):
        labels = drawn.ticks[name]["x"]
        assert labels and all(re.fullmatch(r"May 4(\n2026)?", t) for t in labels), (name, labels)
    hours = drawn.ticks["utilisation"]["x"]
    assert any(t.startswith("09:00") for t in hours), hours
    assert all(re.match(r"\d\d:\d\d(\n|$)", t) and not SECONDS.search(t) for t in hours), hours


def test_tiles_keep_sub_cent_money_and_a_real_minus(drawn, first_day):
    total, api, saved = _sums(first_day.url)
    assert drawn.tiles["spend"].splitlines()[1] == money(total) == f"${total:.3g}"  # "$0.00316", not "$0.00"
    assert f"API {money(api)} · in-house charged {money(total - api)}" in drawn.tiles["spend"]
    assert drawn.tiles["savings"].splitlines()[1] == money(saved) == f"{MINUS}${-saved:.3g}"  # not "$-0.00"


def test_tiles_keep_two_figures_of_hours_under_one(drawn):
    # 160 busy of 1,200 paid seconds: 0.044 of 0.33 hours (not "0.0 busy of 0.3"), 13.3%.
    assert "13.3%\n0.044 busy of 0.33 paid device-hours" in drawn.tiles["utilisation"], drawn.tiles


def test_money_axes_are_distinct_and_signed_before_the_dollar(drawn):
    for name in ("spend", "idle", "teams", "routes"):
        axis = drawn.ticks[name]["y" if name in ("spend", "idle") else "x"]
        assert len(set(axis)) == len(axis) > 1, (name, axis)
        assert all(t.startswith(("$", MINUS + "$")) for t in axis), (name, axis)
    assert any(t.startswith(MINUS + "$") for t in drawn.ticks["savings"]["y"]), drawn.ticks["savings"]
    assert not any("$-" in t or "$" + MINUS in t for axes in drawn.ticks.values() for a in axes.values() for t in a)


def test_hover_labels_keep_sub_cent_money_and_a_real_minus(drawn, first_day):
    total, api, saved = _sums(first_day.url)
    by_backend = dict(sql(first_day.url, "SELECT backend, SUM(cost_usd) FROM requests GROUP BY backend"))
    assert len(drawn.hovers["spend"]) == 2
    for label in drawn.hovers["spend"]:
        backend = next(b for b in by_backend if b in label)
        assert f"{backend}: {money(by_backend[backend])}" in label, label
    bars = [h for h, t in zip(drawn.hovers["savings"], drawn.charts["savings"], strict=True) if t["type"] == "bar"]
    assert bars == [f"Mon May 4, 2026local: {money(saved)} saved"]
    pies = " ".join(drawn.hovers["share"])
    assert f"API: {money(api)} (" in pies and f"in-house: {money(total - api)} (" in pies, pies
    teams = dict(sql(first_day.url, "SELECT team, SUM(cost_usd) FROM requests GROUP BY team"))
    assert any(f": {money(v)}" in drawn.hovers["teams"][0] for v in teams.values()), drawn.hovers["teams"]


def test_a_first_day_says_its_window_in_minutes(drawn):
    assert "ledger 2026-05-04 09:00 to 09:20 UTC" in drawn.window, drawn.window  # requests and uptime together
    assert any(n.startswith("SHORT WINDOW: the ledger covers 20 minutes") for n in drawn.notes), drawn.notes


# --------------------------------------------------------------------------------------------- a policy change

POLICY_V1 = POLICY.format(comment="v1", input="2.00", output="8.00")
POLICY_V2 = POLICY.format(comment="v2: the API's output price doubled", input="2.00", output="16.00")
LIVE_POLICY = POLICY.format(comment="live: a what-if nobody served with", input="5.00", output="40.00")
DAY2 = DAY1 + timedelta(days=1)


def seed_policy_change(url: str) -> None:
    """Two mornings, the first served by POLICY_V1 and the second by POLICY_V2 (both texts stored, as the
    gateway stores each version it loads); the gateway then runs LIVE_POLICY, which served no row."""
    rows, uptime, texts = [], [], []
    for day, text, output in ((DAY1, POLICY_V1, 8.00), (DAY2, POLICY_V2, 16.00)):
        version = version_of(text)
        texts.append(PolicyVersionRecord(version, day, text, f"policy-{day:%d}.yaml"))
        for k in range(36):  # three hours, every five minutes
            at = day + timedelta(minutes=5 * k)
            uptime.append(_uptime(at, 300.0, 5.0))  # the 4 s charged, and a second more
            rows.append(_engine_row(len(rows), at + timedelta(seconds=40), version, utilisation=5 / 300, gpu_seconds=4.0,
                                    prompt=900, completion=150, api=(2.00, output)))
            rows.append(_api_row(len(rows), at + timedelta(seconds=100), version, prompt=2000, completion=400,
                                 prices=(2.00, output)))
    _insert(url, EngineUptimeRow.__table__, uptime)
    _insert(url, RequestRow.__table__, rows)
    _insert(url, PolicyVersionRow.__table__, texts)


@pytest.fixture(scope="module")
def changed(tmp_path_factory, processes):  # noqa: F811 - the module-scoped fixture of test_dashboard
    return _serve(tmp_path_factory.mktemp("changed"), processes, seed_policy_change, LIVE_POLICY)


def _decision_csv(directory: Path) -> dict[str, float | str]:
    out: dict[str, float | str] = {}
    with (directory / "decision.csv").open(newline="", encoding="utf-8") as f:
        for row in list(csv.reader(f))[1:]:
            if len(row) >= 2 and row[0]:
                try:
                    out[row[0]] = float(row[1])
                except ValueError:
                    out[row[0]] = row[1]
    return out


@needs_chromium
def test_the_dashboard_and_the_report_agree_after_a_policy_change(changed, tmp_path):
    report = run_cli("report", "spreadsheet", "--format", "csv", "--out", str(tmp_path / "report"),
                     "--database-url", changed.url, "--no-progress")
    assert report.returncode == 0, report.stderr
    d = _decision_csv(tmp_path / "report")
    auth = {"Authorization": f"Bearer {MASTER}"}
    summary = httpx.get(f"{changed.root}/dashboard/api/summary", headers=auth).json()
    utilisation = httpx.get(f"{changed.root}/dashboard/api/utilisation", headers=auth).json()

    # The report's figures, by hand: all-API at the newest served version's reference prices ($2 in, $16 out).
    (prompt, completion), = sql(changed.url, "SELECT SUM(prompt_tokens), SUM(completion_tokens) FROM requests")
    scale = 730 / d["window hours"]
    assert d["all-API USD/month"] == pytest.approx(scale * (prompt * 2.00 + completion * 16.00) / 1e6, rel=1e-9)
    assert d["reference API"] == summary["reference_api"] == "house-api"

    monthly = summary["monthly"]
    assert monthly["all_api_usd"] == pytest.approx(d["all-API USD/month"], rel=1e-9)
    assert monthly["all_hosted_usd"] == pytest.approx(d["all-hosted USD/month"], rel=1e-9)
    assert monthly["current_mix_usd"] == pytest.approx(d["current mix USD/month"], rel=1e-9)
    assert monthly["idle_usd"] == pytest.approx(d["cost of idle USD/month"], rel=1e-9)
    assert summary["break_even_utilisation"] == pytest.approx(d["break-even utilisation"], rel=1e-9)
    assert utilisation["break_even_utilisation"] == pytest.approx(d["break-even utilisation"], rel=1e-9)
    assert summary["utilisation"] == pytest.approx(d["measured utilisation"], rel=1e-9)

    # The page says the same, in the report's own words.
    printed = report.stdout.splitlines()
    page = _load(changed.root)
    assert page.console_errors == []
    assert f"all-API {money(d['all-API USD/month'])}" in page.tiles["break-even"]
    assert f"all-hosted {money(d['all-hosted USD/month'])}" in page.tiles["break-even"]
    assert f"monthly: all-API {money(d['all-API USD/month'])}" in "\n".join(printed)
    label = "prices: each row by the policy version that served it (2 versions in the window)"
    assert label in printed and label in page.notes
    assert any(n.startswith(f"policy version {version_of(POLICY_V2)}: 72 rows") for n in page.notes), page.notes
