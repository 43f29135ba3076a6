"""gateway/reports/figures.py, decision.py and the six views of migration 0003, checked against SQL written here.

On SQLite and PostgreSQL: a small seeded ledger (gateway/testing/ledger_seed.py, 3,000 requests over 3 days)
and each figure against an independent query (different bucket expressions, raw rows summed in Python);
`--team` allocation; UTC days and hours when the PostgreSQL session is in New York; `Window.parse`;
`decide` worked by hand on a tiny ledger; and the edge cases (empty ledger, one day, only API traffic,
only in-house traffic, an engine without uptime rows, an API backend without a price).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
import sqlalchemy as sa

from gateway import db
from gateway.ledger.models import EngineUptimeRow, RequestRow
from gateway.policy import parse_policy
from gateway.reports.decision import DecisionInputs, decide
from gateway.reports.figures import EngineRow, Ledger, ReportError, Window, _as_utc
from gateway.testing import ledger_seed
from tests.conftest import fresh_pg_database

ROWS, DAYS = 3000, 3
T0 = ledger_seed.DEFAULT_START
NEW_YORK = "America/New_York"


def approx(x):
    return pytest.approx(x, rel=1e-9, abs=1e-9)


def _num(v):
    return float(v) if isinstance(v, Decimal) else v


def query(url: str, sql: str, params: dict | None = None, tz: str | None = None) -> list[tuple]:
    engine = sa.create_engine(db.sync_url(url))
    try:
        with engine.connect() as conn:
            if tz and engine.dialect.name == "postgresql":
                conn.exec_driver_sql(f"SET TIME ZONE '{tz}'")
            return [tuple(_num(v) for v in row) for row in conn.execute(sa.text(sql), params or {})]
    finally:
        engine.dispose()


def is_pg(url: str) -> bool:
    return not db.is_sqlite(url)


def day_of(url: str, column: str = "created_at") -> str:
    """A UTC day, written differently from figures.py / the views (date(), a cast to date)."""
    if is_pg(url):
        return f"CAST(CAST({column} AT TIME ZONE 'UTC' AS DATE) AS TEXT)"
    return f"date({column})"


def hour_of(url: str, column: str = "created_at") -> str:
    if is_pg(url):
        return f"to_char(date_trunc('hour', {column} AT TIME ZONE 'UTC'), 'YYYY-MM-DD HH24')"
    return f"strftime('%Y-%m-%d %H', {column})"


def keyed(rows, n_key: int) -> dict:
    return {tuple(r[:n_key]): tuple(r[n_key:]) for r in rows}


def assert_same(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for k, values in expected.items():
        assert len(got[k]) == len(values), k
        for g, e in zip(got[k], values, strict=True):
            if isinstance(e, float) or isinstance(g, float):
                assert g == approx(e), k
            else:
                assert g == e, k


# ------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def seeded(request, tmp_path_factory) -> Iterator[str]:
    """A 3,000-request, 3-day seeded ledger, shared by this module's read-only tests."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('figures') / 'ledger.db'}"
        ledger_seed.seed(url, rows=ROWS, days=DAYS, seed=7)
        yield url
        return
    with fresh_pg_database() as url:
        ledger_seed.seed(url, rows=ROWS, days=DAYS, seed=7)
        yield url


@pytest.fixture
def ledger(seeded: str) -> Iterator[Ledger]:
    with Ledger.open(seeded) as lg:
        yield lg


# ------------------------------------------------------------------------------------------- the seeder


def test_seeder_is_deterministic_and_complete(seeded: str) -> None:
    req, up = ledger_seed.generate(ROWS, DAYS, seed=7)
    again, _ = ledger_seed.generate(ROWS, DAYS, seed=7)
    assert req["cost_usd"].all() == again["cost_usd"].all()
    assert req["request_id"].all() == again["request_id"].all()
    ((n, teams, routes, backends),) = query(
        seeded, "SELECT COUNT(*), COUNT(DISTINCT team), COUNT(DISTINCT route), COUNT(DISTINCT backend) FROM requests")
    assert (n, teams) == (ROWS, 6) and routes >= 4 and backends == 5
    reasons = {r for (r,) in query(seeded, "SELECT DISTINCT route_reason FROM requests WHERE route = 'auto'")}
    assert {"difficulty", "fallback", "spillover"} <= reasons
    statuses = {s for (s,) in query(seeded, "SELECT DISTINCT status FROM requests")}
    assert statuses == {"ok", "error", "client_closed", "rejected"}
    kinds = dict(query(seeded, "SELECT backend, MAX(device_kind) FROM requests WHERE cost_basis = 'gpu_amortized' "
                               "GROUP BY backend"))
    assert kinds == {"local-gpu": "gpu", "local-cpu": "cpu"}
    notes = {r for (r,) in query(seeded, "SELECT DISTINCT cost_note FROM requests WHERE cost_note IS NOT NULL")}
    assert "unpriced_model" in notes
    # one uptime row per engine per minute, busy within up time and at least the minute's attributed seconds
    ((u, bad),) = query(seeded, "SELECT COUNT(*), SUM(CASE WHEN busy_seconds > seconds OR busy_seconds < 0 "
                                "THEN 1 ELSE 0 END) FROM engine_uptime")
    assert (u, bad) == (2 * DAYS * 1440, 0)
    minute = ("to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI')" if is_pg(seeded)
              else "substr(created_at, 1, 16)")
    busy = {(b, m): s for b, m, s in query(seeded, f"SELECT backend, {minute}, busy_seconds FROM engine_uptime")}
    for b, m, attributed in query(seeded, f"SELECT backend, {minute}, SUM(gpu_seconds) FROM requests "
                                          "WHERE cost_basis = 'gpu_amortized' GROUP BY backend, " + minute):
        assert busy[(b, m)] >= attributed - 1e-6
    assert len(up["backend"]) == u


def test_no_served_row_at_zero_cost_lacks_a_note(seeded: str, ledger: Ledger) -> None:
    assert ledger.summary(Window()).zero_cost_unexplained == 0
    ((n,),) = query(seeded, "SELECT COUNT(*) FROM requests WHERE status = 'ok' AND backend IS NOT NULL "
                            "AND cost_usd = 0 AND cost_note IS NULL")
    assert n == 0
    ((zero,),) = query(seeded, "SELECT COUNT(*) FROM requests WHERE status = 'ok' AND cost_usd = 0")
    assert zero > 0  # the unpriced and no-token rows: they exist, and each carries its note


# ------------------------------------------------------------------------------------------- figures.py


def test_summary(seeded: str, ledger: Ledger) -> None:
    s = ledger.summary(Window())
    ((n, first, last, p, c, o, spend),) = query(seeded, """
        SELECT COUNT(*), MIN(created_at), MAX(created_at), SUM(prompt_tokens), SUM(cached_prompt_tokens),
               SUM(completion_tokens), SUM(cost_usd) FROM requests""")
    ((api,),) = query(seeded, "SELECT SUM(cost_usd) FROM requests WHERE cost_basis = 'api_price'")
    ((inh, cf),) = query(seeded, "SELECT SUM(cost_usd), SUM(counterfactual_cost_usd) FROM requests "
                                 "WHERE cost_basis = 'gpu_amortized'")
    assert (s.requests, s.prompt_tokens, s.cached_prompt_tokens, s.completion_tokens) == (n, p, c, o)
    assert s.spend_usd == approx(spend) and s.api_spend_usd == approx(api)
    assert s.in_house_charged_usd == approx(inh) and s.counterfactual_usd == approx(cf)
    assert s.first == _as_utc(first) and s.last == _as_utc(last)
    # one window for traffic and paid engine time: the uptime minutes cover the whole seeded span
    assert s.window_start <= s.first and s.window_end >= s.last
    assert s.days == approx((s.window_end - s.window_start).total_seconds() / 86400) and 2.9 < s.days <= 3.0
    assert s.notes == dict(query(seeded, "SELECT cost_note, COUNT(*) FROM requests WHERE cost_note IS NOT NULL "
                                         "GROUP BY cost_note"))


def test_summary_window_until_is_inclusive(seeded: str, ledger: Ledger) -> None:
    day2 = (T0 + timedelta(days=1)).strftime("%Y-%m-%d")
    s = ledger.summary(Window.parse(day2, day2))
    ((n, spend),) = query(seeded, f"SELECT COUNT(*), SUM(cost_usd) FROM requests WHERE {day_of(seeded)} = :d",
                          {"d": day2})
    assert s.requests == n and s.spend_usd == approx(spend) and 0 < n < ROWS
    team = ledger.summary(Window.parse(day2, day2, "labs"))
    ((tn,),) = query(seeded, f"SELECT COUNT(*) FROM requests WHERE {day_of(seeded)} = :d AND team = 'labs'",
                     {"d": day2})
    assert team.requests == tn


def test_traffic_daily(seeded: str, ledger: Ledger) -> None:
    got = {(r.day, r.route, r.backend, r.cost_basis): (r.requests, r.prompt_tokens, r.cached_prompt_tokens,
                                                       r.completion_tokens, r.spend_usd, r.counterfactual_usd)
           for r in ledger.traffic_daily(Window())}
    d = day_of(seeded)
    expected = keyed(query(seeded, f"""
        SELECT {d}, route, backend, cost_basis, COUNT(*), SUM(prompt_tokens), SUM(cached_prompt_tokens),
               SUM(completion_tokens), SUM(cost_usd), SUM(CASE WHEN counterfactual_cost_usd IS NULL THEN 0.0
                                                               ELSE counterfactual_cost_usd END)
        FROM requests GROUP BY {d}, route, backend, cost_basis"""), 4)
    assert_same(got, expected)
    assert {k[0] for k in got} == {(T0 + timedelta(days=i)).strftime("%Y-%m-%d") for i in range(DAYS)}


def test_api_backends(seeded: str, ledger: Ledger) -> None:
    got = {r.backend: (r.served_model, r.requests, r.prompt_tokens, r.cached_prompt_tokens, r.completion_tokens,
                       r.spend_usd, r.cache_savings_usd, r.unpriced_requests, r.price_table_version)
           for r in ledger.api_backends(Window())}
    rows = query(seeded, """
        SELECT backend, served_model, prompt_tokens, cached_prompt_tokens, completion_tokens, cost_usd,
               cache_savings_usd, cost_note, price_table_version
        FROM requests WHERE cost_basis = 'api_price'""")
    expected: dict = {}
    for b, m, p, c, o, cost, sav, note, ptv in rows:
        e = expected.setdefault(b, [None, 0, 0, 0, 0, 0.0, 0.0, 0, None])
        e[0] = max(e[0] or "", m or "") or None
        e[1] += 1
        e[2] += p
        e[3] += c
        e[4] += o
        e[5] += cost
        e[6] += sav or 0.0
        e[7] += note == "unpriced_model"
        e[8] = max(e[8] or "", ptv or "") or None
    assert_same(got, {b: tuple(v) for b, v in expected.items()})
    assert set(got) == {"openai-mini", "claude-sonnet", "experimental"}
    assert got["experimental"][5] == 0 and got["experimental"][7] == got["experimental"][1]
    assert got["claude-sonnet"][6] > 0  # cached tokens at the cached rate saved money


def _uptime_by_backend(url: str, team_share: dict[str, float] | None = None) -> dict[str, list[float]]:
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    for b, s, busy, rate in query(url, "SELECT backend, seconds, busy_seconds, device_hour_usd FROM engine_uptime"):
        share = 1.0 if team_share is None else team_share.get(b, 0.0)
        e = out[b]
        e[0] += s * share
        e[1] += busy * share
        e[2] += s / 3600 * rate * share
        e[3] += busy / 3600 * rate * share
    return out


def test_engines(seeded: str, ledger: Ledger) -> None:
    engines = {e.backend: e for e in ledger.engines(Window())}
    assert set(engines) == {"local-gpu", "local-cpu"}
    up = _uptime_by_backend(seeded)
    served = keyed(query(seeded, """
        SELECT backend, COUNT(*), SUM(prompt_tokens), SUM(cached_prompt_tokens), SUM(completion_tokens),
               SUM(gpu_seconds), SUM(cost_usd), SUM(counterfactual_cost_usd)
        FROM requests WHERE cost_basis = 'gpu_amortized' GROUP BY backend"""), 1)
    for name, e in engines.items():
        (n, p, c, o, gpu_s, charged, cf) = served[(name,)]
        u_s, busy_s, paid, busy_usd = up[name]
        assert e.has_uptime and e.team_share == 1.0
        assert (e.requests, e.prompt_tokens, e.cached_prompt_tokens, e.completion_tokens) == (n, p, c, o)
        assert e.attributed_seconds == approx(gpu_s) and e.charged_usd == approx(charged)
        assert e.counterfactual_usd == approx(cf)
        assert (e.up_seconds, e.busy_seconds) == (approx(u_s), approx(busy_s))
        assert (e.paid_usd, e.busy_usd) == (approx(paid), approx(busy_usd))
        assert e.idle_usd == approx(paid - busy_usd) and e.idle_usd > 0
        assert e.utilisation == approx(busy_s / u_s)
        assert e.tokens_per_s == approx((p + o) / busy_s)
        assert e.usd_per_mtok_measured == approx(paid / (p + o) * 1e6)
        hour_usd, devices, kind = ledger_seed.ENGINES[name]
        assert (e.device_hour_usd, e.devices, e.device_kind) == (hour_usd, devices, kind)
        assert e.tokens_per_device_s == approx((p + o) / busy_s / devices)
        assert e.usd_per_mtok_at(0.5) == approx(hour_usd / ((p + o) / busy_s * 3600 * 0.5) * 1e6)
        assert e.usd_per_mtok_at(0.0) is None


@pytest.mark.parametrize("team", ["labs", "ops"])
def test_engines_team_allocation(seeded: str, ledger: Ledger, team: str) -> None:
    """A team gets the engine's paid and busy time in proportion to its share of attributed device seconds."""
    share = dict(query(seeded, """
        SELECT backend, SUM(CASE WHEN team = :t THEN gpu_seconds ELSE 0.0 END) / SUM(gpu_seconds)
        FROM requests WHERE cost_basis = 'gpu_amortized' GROUP BY backend""", {"t": team}))
    up = _uptime_by_backend(seeded, share)
    engines = {e.backend: e for e in ledger.engines(Window(team=team))}
    whole = {e.backend: e for e in ledger.engines(Window())}
    assert set(engines) == set(whole)
    for name, e in engines.items():
        ((n, attributed, charged),) = query(seeded, """
            SELECT COUNT(*), SUM(gpu_seconds), SUM(cost_usd) FROM requests
            WHERE cost_basis = 'gpu_amortized' AND backend = :b AND team = :t""", {"b": name, "t": team})
        assert e.team_share == approx(share[name]) and 0 < e.team_share < 1
        assert e.requests == n and e.attributed_seconds == approx(attributed) and e.charged_usd == approx(charged)
        assert (e.up_seconds, e.busy_seconds, e.paid_usd, e.busy_usd) == tuple(approx(v) for v in up[name])
        assert e.utilisation == approx(whole[name].utilisation)  # a share of up and busy alike
    # every team's allocation adds up to the whole engine
    totals: dict[str, float] = defaultdict(float)
    for t in ledger_seed.TEAMS:
        for e in ledger.engines(Window(team=t)):
            totals[e.backend] += e.paid_usd
    assert {b: approx(v) for b, v in totals.items()} == {b: e.paid_usd for b, e in whole.items()}


def test_busy_by_hour_and_idle_daily(seeded: str, ledger: Ledger) -> None:
    h = hour_of(seeded)
    expected = keyed(query(seeded, f"SELECT {h}, backend, SUM(seconds), SUM(busy_seconds) FROM engine_uptime "
                                   f"GROUP BY {h}, backend"), 2)
    rows = ledger.busy_by_hour(Window())
    assert_same({(r.hour, r.backend): (r.up_seconds, r.busy_seconds) for r in rows}, expected)
    assert len(rows) == 2 * 24 * DAYS
    assert all(r.utilisation == approx(r.busy_seconds / r.up_seconds) for r in rows)
    d = day_of(seeded)
    expected = keyed(query(seeded, f"""
        SELECT {d}, backend, SUM(seconds) / 3600.0, SUM(busy_seconds) / 3600.0,
               SUM(seconds / 3600.0 * device_hour_usd), SUM(busy_seconds / 3600.0 * device_hour_usd),
               SUM((seconds - busy_seconds) / 3600.0 * device_hour_usd)
        FROM engine_uptime GROUP BY {d}, backend"""), 2)
    got = {(r["day"], r["backend"]): (r["paid_hours"], r["busy_hours"], r["paid_usd"], r["busy_usd"], r["idle_usd"])
           for r in ledger.idle_daily(Window())}
    assert_same(got, expected)
    assert len(got) == 2 * DAYS


def test_spend_daily(seeded: str, ledger: Ledger) -> None:
    d = day_of(seeded)
    expected = keyed(query(seeded, f"""
        SELECT {d}, backend, MIN(cost_basis), COUNT(*), SUM(prompt_tokens) + SUM(completion_tokens), SUM(cost_usd),
               SUM(CASE WHEN counterfactual_cost_usd IS NULL THEN 0.0 ELSE counterfactual_cost_usd END)
        FROM requests WHERE backend IS NOT NULL GROUP BY {d}, backend"""), 2)
    got = {(r["day"], r["backend"]): (r["cost_basis"], r["requests"], r["tokens"], r["spend_usd"],
                                      r["counterfactual_usd"]) for r in ledger.spend_daily(Window())}
    assert_same(got, expected)


@pytest.mark.parametrize("column", ["team", "route"])
def test_top(seeded: str, ledger: Ledger, column: str) -> None:
    rows = query(seeded, f"SELECT {column}, COUNT(*), SUM(prompt_tokens + completion_tokens), SUM(cost_usd) "
                         f"FROM requests WHERE {column} IS NOT NULL GROUP BY {column}")
    rows.sort(key=lambda r: (-r[3], r[0]))
    got = ledger.top(Window(), column, limit=3)
    assert [g["name"] for g in got] == [r[0] for r in rows[:3]]
    assert [(g["requests"], g["tokens"], g["spend_usd"]) for g in got] == [(r[1], r[2], approx(r[3]))
                                                                           for r in rows[:3]]
    with pytest.raises(ValueError):
        ledger.top(Window(), "backend")


def test_decisions(seeded: str, ledger: Ledger) -> None:
    expected = keyed(query(seeded, "SELECT route, route_reason, backend, COUNT(*) FROM requests "
                                   "WHERE route IS NOT NULL GROUP BY route, route_reason, backend"), 3)
    got = {(r["route"], r["reason"], r["backend"]): (r["requests"],) for r in ledger.decisions(Window())}
    assert_same(got, {(r, reason or "none", b or "none"): v for (r, reason, b), v in expected.items()})
    assert ("auto", "spillover", "claude-sonnet") in got and ("auto", "difficulty", "local-gpu") in got


def test_decision_from_the_seeded_ledger(seeded: str, ledger: Ledger) -> None:
    x = DecisionInputs.from_ledger(ledger, Window(), ledger_seed.policy())
    s = ledger.summary(Window())
    assert x.window_hours == approx(s.days * 24)
    assert x.reference is not None and x.reference.backend == "claude-sonnet"  # auto's counterfactual
    assert any("experimental" in n for n in x.notes)
    up = _uptime_by_backend(seeded)
    assert x.up_hours == approx(sum(v[0] for v in up.values()) / 3600)
    assert x.utilisation == approx(sum(v[1] for v in up.values()) / sum(v[0] for v in up.values()))
    assert x.device_hour_usd == approx(5.0 + 0.4) and x.devices == 3
    r = decide(x)
    assert r.all_api_usd > 0 and r.all_hosted_usd > 0 and r.cheaper in ("API", "hosting")
    assert 0 < r.break_even_utilisation and r.break_even_daily_tokens > 0 and r.idle_usd > 0


# ------------------------------------------------------------------------------------------- the views


def test_view_daily_spend(seeded: str) -> None:
    d = day_of(seeded)
    expected = keyed(query(seeded, f"""
        SELECT {d}, team, backend, cost_basis, COUNT(*), SUM(prompt_tokens), SUM(cached_prompt_tokens),
               SUM(completion_tokens), SUM(cost_usd)
        FROM requests GROUP BY {d}, team, backend, cost_basis"""), 4)
    got = keyed(query(seeded, "SELECT day, team, backend, cost_basis, requests, prompt_tokens, "
                              "cached_prompt_tokens, completion_tokens, spend_usd FROM daily_spend"), 4)
    assert_same(got, expected)


def test_view_engine_utilisation_hourly(seeded: str) -> None:
    h = hour_of(seeded)
    expected: dict = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0, 0, 0, 0, 0.0])
    for hour, b, s, busy, rate in query(seeded, f"SELECT {h}, backend, seconds, busy_seconds, device_hour_usd "
                                                "FROM engine_uptime"):
        e = expected[(hour, b)]
        e[0] += s
        e[1] += busy
        e[2] += s * rate / 3600
        e[3] += busy * rate / 3600
    for hour, b, n, p, o, g in query(seeded, f"""
            SELECT {h}, backend, COUNT(*), SUM(prompt_tokens), SUM(completion_tokens), SUM(gpu_seconds)
            FROM requests WHERE cost_basis = 'gpu_amortized' GROUP BY {h}, backend"""):
        e = expected[(hour, b)]
        e[4], e[5], e[6], e[7] = n, p, o, g
    want = {k: (e[0], e[1], e[1] / e[0] if e[0] else None, e[2], e[3], e[2] - e[3], e[4], e[5], e[6], e[7])
            for k, e in expected.items()}
    got = keyed(query(seeded, """
        SELECT hour, backend, up_seconds, busy_seconds, utilisation, paid_usd, busy_usd, idle_usd, requests,
               prompt_tokens, completion_tokens, attributed_seconds FROM engine_utilisation_hourly"""), 2)
    assert_same(got, want)
    assert len(got) == 2 * 24 * DAYS


def test_view_route_cost_per_1k_requests(seeded: str) -> None:
    rows = query(seeded, "SELECT route, cost_usd FROM requests WHERE route IS NOT NULL")
    agg: dict = defaultdict(lambda: [0, 0.0])
    for route, cost in rows:
        agg[route][0] += 1
        agg[route][1] += cost
    got = keyed(query(seeded, "SELECT route, requests, spend_usd, usd_per_1k_requests "
                              "FROM route_cost_per_1k_requests"), 1)
    assert_same(got, {(r,): (n, s, 1000 * s / n) for r, (n, s) in agg.items()})


def test_view_realised_savings_daily(seeded: str) -> None:
    d = day_of(seeded)
    expected = keyed(query(seeded, f"""
        SELECT {d}, backend, COUNT(*), SUM(cost_usd), SUM(counterfactual_cost_usd),
               SUM(counterfactual_cost_usd) - SUM(cost_usd)
        FROM requests WHERE cost_basis = 'gpu_amortized' AND counterfactual_cost_usd IS NOT NULL
        GROUP BY {d}, backend"""), 2)
    got = keyed(query(seeded, "SELECT day, backend, requests, cost_usd, api_alternative_usd, savings_usd "
                              "FROM realised_savings_daily"), 2)
    assert_same(got, expected)
    assert {b for _, b in got} == {"local-gpu", "local-cpu"}


def test_view_prefix_cache_savings_daily(seeded: str) -> None:
    d = day_of(seeded)
    expected = keyed(query(seeded, f"""
        SELECT {d}, backend, SUM(prompt_tokens), SUM(cached_prompt_tokens),
               SUM(CASE WHEN cache_savings_usd IS NULL THEN 0.0 ELSE cache_savings_usd END)
        FROM requests WHERE cached_prompt_tokens > 0 AND backend IS NOT NULL GROUP BY {d}, backend"""), 2)
    got = keyed(query(seeded, "SELECT day, backend, prompt_tokens, cached_prompt_tokens, savings_usd "
                              "FROM prefix_cache_savings_daily"), 2)
    assert_same(got, expected)
    assert any(v[2] > 0 for v in got.values())  # API rows: the cached rate saved money


def test_view_engine_idle_daily(seeded: str) -> None:
    d = day_of(seeded)
    expected = {}
    for day, b, s, busy, paid, busy_usd in query(seeded, f"""
            SELECT {d}, backend, SUM(seconds), SUM(busy_seconds), SUM(seconds * device_hour_usd / 3600.0),
                   SUM(busy_seconds * device_hour_usd / 3600.0) FROM engine_uptime GROUP BY {d}, backend"""):
        expected[(day, b)] = (s / 3600, busy / 3600, (s - busy) / 3600, paid, busy_usd, paid - busy_usd, busy / s)
    got = keyed(query(seeded, "SELECT day, backend, paid_hours, busy_hours, idle_hours, paid_usd, busy_usd, "
                              "idle_usd, utilisation FROM engine_idle_daily"), 2)
    assert_same(got, expected)


# ------------------------------------------------------------------------------------------- time zones


def test_utc_buckets_when_the_session_is_not_utc(seeded: str) -> None:
    """Days and hours are UTC whatever the PostgreSQL session's time zone (New York: UTC−5 in March)."""
    if not is_pg(seeded):
        pytest.skip("SQLite has no session time zone: its timestamps are stored as UTC text")
    stamps = [(_as_utc(t), b, cost) for t, b, cost in query(
        seeded, "SELECT created_at, backend, cost_usd FROM requests", tz=NEW_YORK)]
    assert any(t.hour < 5 for t, _, _ in stamps)  # rows whose New York day is the previous one
    by_day: dict = defaultdict(float)
    for t, _, cost in stamps:
        by_day[t.strftime("%Y-%m-%d")] += cost
    view: dict = defaultdict(float)
    for day, spend in query(seeded, "SELECT day, spend_usd FROM daily_spend", tz=NEW_YORK):
        view[day] += spend
    assert {k: approx(v) for k, v in by_day.items()} == dict(view)
    hours = {h for (h,) in query(seeded, "SELECT DISTINCT hour FROM engine_utilisation_hourly", tz=NEW_YORK)}
    assert hours == {(T0 + timedelta(hours=i)).strftime("%Y-%m-%d %H") for i in range(24 * DAYS)}
    days = {d for (d,) in query(seeded, "SELECT DISTINCT day FROM engine_idle_daily", tz=NEW_YORK)}
    assert days == {(T0 + timedelta(days=i)).strftime("%Y-%m-%d") for i in range(DAYS)}

    # figures.py through a session in New York: the same days, hours and window as in UTC
    engine = sa.create_engine(db.sync_url(seeded), connect_args={"options": f"-c timezone={NEW_YORK}"})
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SHOW TIME ZONE").scalar() == NEW_YORK
    ny, utc = Ledger(engine), Ledger.open(seeded)
    try:
        assert ny.traffic_daily(Window()) == utc.traffic_daily(Window())
        assert ny.busy_by_hour(Window()) == utc.busy_by_hour(Window())
        assert ny.idle_daily(Window()) == utc.idle_daily(Window())
        assert ny.spend_daily(Window()) == utc.spend_daily(Window())
        day2 = (T0 + timedelta(days=1)).strftime("%Y-%m-%d")
        w = Window.parse(day2, day2)
        n = sum(1 for t, _, _ in stamps if t.strftime("%Y-%m-%d") == day2)
        assert ny.summary(w).requests == utc.summary(w).requests == n
        assert ny.summary(Window()).first == utc.summary(Window()).first
    finally:
        ny.close()
        utc.close()


# ------------------------------------------------------------------------------------------- Window


def test_window_parse() -> None:
    w = Window.parse("2025-03-01", "2025-03-02", "labs")
    assert w.since == datetime(2025, 3, 1, tzinfo=UTC)
    assert w.until == datetime(2025, 3, 3, tzinfo=UTC)  # --until DATE includes that day
    assert w.team == "labs"
    assert Window.parse(until="2025-03-02T12:00").until == datetime(2025, 3, 2, 12, tzinfo=UTC)  # a time: as is
    assert Window.parse("2025-03-01T00:00:00-05:00").since == datetime(2025, 3, 1, 5, tzinfo=UTC)
    assert Window.parse(None, "") == Window()
    assert "team 'labs'" in w.describe() and "2025-03-03 00:00 UTC (exclusive)" in w.describe()
    assert Window().describe() == "from the first row, to the last row"


@pytest.mark.parametrize(("since", "until", "flag"), [("03/01/2025", None, "--since"), (None, "2025-02-30", "--until"),
                                                      ("yesterday", None, "--since")])
def test_window_parse_bad_date(since, until, flag) -> None:
    with pytest.raises(ReportError, match=flag):
        Window.parse(since, until)
    assert issubclass(ReportError, ValueError)


def test_ledger_open_unreachable_is_a_report_error(tmp_path: Path) -> None:
    (tmp_path / "never-migrated.db").touch()  # a missing file is its own error (test_report_workbook.py)
    with pytest.raises(ReportError, match="db upgrade"):
        Ledger.open(f"sqlite:///{tmp_path / 'never-migrated.db'}")


# ------------------------------------------------------------------------------------------- by hand

HAND_POLICY = """\
backends:
  eng:
    kind: engine
    model: m
    api_base: http://127.0.0.1:9
    gpu_hour_usd: 2.0
  api:
    kind: litellm
    model: openai/gpt-4o-mini
    input_usd_per_mtok: 1.0
    cached_input_usd_per_mtok: 0.5
    output_usd_per_mtok: 2.0
  mystery:
    kind: litellm
    model: acme/no-such-model-anywhere
routes:
  r:
    strategy: fixed
    backend: eng
    counterfactual: api
  a:
    strategy: fixed
    backend: api
  u:
    strategy: fixed
    backend: mystery
"""
UNPRICED_POLICY = """\
backends:
  eng:
    kind: engine
    model: m
    api_base: http://127.0.0.1:9
    gpu_hour_usd: 2.0
  mystery:
    kind: litellm
    model: acme/no-such-model-anywhere
routes:
  u:
    strategy: fixed
    backend: mystery
"""


def engine_row(i: int, at: datetime, **kw) -> dict:
    row = {"request_id": f"hand-{i}", "created_at": at, "team": "labs", "requested_model": "r", "route": "r",
           "backend": "eng", "served_model": "m", "status": "ok", "prompt_tokens": 0, "cached_prompt_tokens": 0,
           "completion_tokens": 0, "cost_usd": 0.0, "cost_basis": "gpu_amortized", "gpu_seconds": 0.0,
           "counterfactual_cost_usd": None, "device_hour_usd": 2.0, "device_kind": "gpu", "utilisation": None,
           "cost_note": None, "cache_savings_usd": None, "price_table_version": None, "route_reason": "fixed"}
    row.update(kw)
    return row


def api_row(i: int, at: datetime, backend: str = "api", **kw) -> dict:
    row = engine_row(i, at, route="a" if backend == "api" else "u", backend=backend, cost_basis="api_price",
                     gpu_seconds=None, device_hour_usd=None, device_kind=None, price_table_version="t1")
    row.update(kw)
    return row


def uptime_row(i: int, at: datetime, seconds: float, busy: float, backend: str = "eng") -> dict:
    return {"interval_id": f"{backend}|{i}", "created_at": at, "backend": backend, "seconds": seconds,
            "busy_seconds": busy, "device_hour_usd": 2.0, "devices": 1, "device_kind": "gpu"}


def insert(url: str, requests: list[dict] = (), uptime: list[dict] = ()) -> None:
    engine = sa.create_engine(db.sync_url(url))
    try:
        with engine.begin() as conn:
            if requests:
                conn.execute(RequestRow.__table__.insert(), list(requests))
            if uptime:
                conn.execute(EngineUptimeRow.__table__.insert(), list(uptime))
    finally:
        engine.dispose()


def inputs(url: str, policy_text: str = HAND_POLICY, window: Window | None = None) -> DecisionInputs:
    with Ledger.open(url) as lg:
        return DecisionInputs.from_ledger(lg, window or Window(), parse_policy(policy_text, "hand"))


def test_decide_worked_by_hand(migrated_db_url: str) -> None:
    """One engine ($2/h), one API ($1 / $0.50 cached / $2 per Mtok), one day of traffic:
    engine: 1,000,000 prompt + 200,000 completion tokens; API: 400,000 prompt (100,000 cached) + 100,000 completion;
    uptime: 2 h up, 240 s busy → 5,000 tokens per busy second, utilisation 1/30."""
    url = migrated_db_url
    insert(url, [engine_row(1, T0, prompt_tokens=1_000_000, completion_tokens=200_000, gpu_seconds=200.0,
                            cost_usd=0.1),
                 api_row(2, T0 + timedelta(days=1), prompt_tokens=400_000, cached_prompt_tokens=100_000,
                         completion_tokens=100_000, cost_usd=0.55, cache_savings_usd=0.05)],
           [uptime_row(1, T0, 3600.0, 150.0), uptime_row(2, T0 + timedelta(hours=1), 3600.0, 90.0)])
    x = inputs(url)
    assert x.window_hours == 24.0 and x.monthly_scale == approx(730 / 24)
    assert (x.prompt_tokens, x.cached_prompt_tokens, x.completion_tokens) == (1_400_000, 100_000, 300_000)
    assert x.reference.backend == "api" and x.device_hour_usd == 2.0 and x.devices == 1
    assert x.tokens_per_s == approx(1_200_000 / 240) and x.utilisation == approx(1 / 30)
    assert (x.up_hours, x.busy_hours) == (approx(2.0), approx(240 / 3600))
    m = 730 / 24
    r = decide(x)
    # all-API: 1.3 Mtok uncached × $1 + 0.1 Mtok cached × $0.50 + 0.3 Mtok out × $2 = $1.95 a day
    assert r.all_api_usd == approx(1.95 * m)
    # all-hosted: 1.7 Mtok / 5,000 tok/s = 340 s = 0.0944 busy hours a day, ÷ 1/30 utilisation × $2/h
    assert r.all_hosted_usd == approx(1_700_000 / 5000 / 3600 * 30 * 2.0 * m)
    # current mix: the API's own tokens (0.3 × $1 + 0.1 × $0.50 + 0.1 × $2 = $0.55) + 2 up hours × $2
    assert r.current_mix_usd == approx((0.55 + 4.0) * m)
    assert r.idle_usd == approx((2.0 - 240 / 3600) * 2.0 * m)
    # break-even utilisation: 0.0944 h × $2 / $1.95
    assert r.break_even_utilisation == approx((1_700_000 / 5000 / 3600) * 2.0 / 1.95)
    # break-even daily tokens: $2 × 24 h at the API's $1.95 per 1.7 Mtok
    assert r.break_even_daily_tokens == approx(48.0 / (1.95 / 1_700_000))
    assert r.capacity_daily_tokens == approx(5000 * 86400)
    assert r.cheaper == "API"
    assert (r.monthly_prompt_tokens, r.monthly_cached_tokens, r.monthly_completion_tokens) == (
        approx(1_400_000 * m), approx(100_000 * m), approx(300_000 * m))
    # at 50% utilisation hosting wins: 0.0944 h ÷ 0.5 × $2 = $0.378 a day < $1.95
    at_half = decide(x, utilisation=0.5)
    assert at_half.all_hosted_usd == approx(1_700_000 / 5000 / 3600 / 0.5 * 2.0 * m)
    assert at_half.cheaper == "hosting"


def test_empty_ledger(migrated_db_url: str) -> None:
    with Ledger.open(migrated_db_url) as lg:
        w = Window()
        s = lg.summary(w)
        assert (s.requests, s.first, s.last, s.days, s.spend_usd, s.zero_cost_unexplained) == (0, None, None, 0.0,
                                                                                               0.0, 0)
        assert lg.traffic_daily(w) == [] and lg.api_backends(w) == [] and lg.engines(w) == []
        assert lg.busy_by_hour(w) == [] and lg.idle_daily(w) == [] and lg.spend_daily(w) == []
        assert lg.top(w, "team") == [] and lg.decisions(w) == []
        assert lg.engines(Window(team="labs")) == []
    x = inputs(migrated_db_url)
    assert x.window_hours == 0 and x.monthly_scale == 0 and x.tokens_per_s is None and x.utilisation is None
    assert x.device_hour_usd == 2.0  # no engine in the ledger: the policy's price
    r = decide(x)
    assert r.all_hosted_usd is None and r.break_even_utilisation is None and r.break_even_daily_tokens is None
    assert r.capacity_daily_tokens is None and r.cheaper == "unknown" and r.current_mix_usd == 0
    for view in ("daily_spend", "engine_utilisation_hourly", "route_cost_per_1k_requests", "realised_savings_daily",
                 "prefix_cache_savings_daily", "engine_idle_daily"):
        assert query(migrated_db_url, f"SELECT * FROM {view}") == []


def test_one_day_ledger(migrated_db_url: str) -> None:
    ledger_seed.seed(migrated_db_url, rows=300, days=1, seed=3)
    with Ledger.open(migrated_db_url) as lg:
        s = lg.summary(Window())
        assert s.requests == 300 and 0 < s.days <= 1.0 and s.zero_cost_unexplained == 0
        assert {r.day for r in lg.traffic_daily(Window())} == {T0.strftime("%Y-%m-%d")}
        assert [(r["day"], r["backend"]) for r in lg.idle_daily(Window())] == [
            (T0.strftime("%Y-%m-%d"), "local-cpu"), (T0.strftime("%Y-%m-%d"), "local-gpu")]
        assert len(lg.busy_by_hour(Window())) == 48
        x = DecisionInputs.from_ledger(lg, Window(), ledger_seed.policy())
    r = decide(x)
    assert x.window_hours == approx(s.days * 24) and r.all_api_usd > 0 and r.all_hosted_usd > 0


def test_only_api_traffic(migrated_db_url: str) -> None:
    insert(migrated_db_url, [api_row(i, T0 + timedelta(hours=i), prompt_tokens=1000, completion_tokens=100,
                                     cost_usd=0.0012) for i in range(5)])
    with Ledger.open(migrated_db_url) as lg:
        assert lg.engines(Window()) == [] and lg.busy_by_hour(Window()) == []
        s = lg.summary(Window())
        assert s.in_house_charged_usd == 0 and s.counterfactual_usd == 0 and s.api_spend_usd == approx(0.006)
    x = inputs(migrated_db_url)
    assert x.tokens_per_s is None and x.utilisation is None and x.up_hours == 0
    assert any("no in-house engine" in n for n in x.notes)
    r = decide(x)
    assert r.all_api_usd == approx((5000 * 1.0 + 500 * 2.0) / 1e6 * 730 / 4)  # 4 h window
    assert r.all_hosted_usd is None and r.break_even_utilisation is None and r.cheaper == "unknown"
    assert r.current_mix_usd == approx(r.all_api_usd) and r.idle_usd == 0
    # the policy's engine at $2/h around the clock: $48 a day buys the API's price of this many tokens
    assert r.break_even_daily_tokens == approx(48.0 / (r.all_api_usd / (5500 * 730 / 4)))


def test_only_in_house_traffic(migrated_db_url: str) -> None:
    insert(migrated_db_url,
           [engine_row(i, T0 + timedelta(minutes=30 * i), prompt_tokens=2000, completion_tokens=500, gpu_seconds=1.0,
                       cost_usd=0.001, counterfactual_cost_usd=0.003) for i in range(3)],
           [uptime_row(i, T0 + timedelta(minutes=i), 60.0, 2.0) for i in range(60)])
    with Ledger.open(migrated_db_url) as lg:
        assert lg.api_backends(Window()) == []
        (e,) = lg.engines(Window())
        assert e.up_seconds == 3600 and e.busy_seconds == 120 and e.utilisation == approx(1 / 30)
        assert e.tokens_per_s == approx(7500 / 120) and e.idle_usd == approx(3480 / 3600 * 2.0)
        assert lg.summary(Window()).counterfactual_usd == approx(0.009)
    x = inputs(migrated_db_url)
    assert x.api == [] and x.reference.backend == "api"
    r = decide(x)
    m = 730 / 1.0  # 1 h window
    assert r.all_api_usd == approx((6000 * 1.0 + 1500 * 2.0) / 1e6 * m)
    assert r.current_mix_usd == approx(1.0 * 2.0 * m)  # no API traffic: only the engine's up hour
    assert r.all_hosted_usd == approx(7500 / (7500 / 120) / 3600 * 30 * 2.0 * m)
    assert r.cheaper in ("API", "hosting")


def test_engine_without_uptime_rows(migrated_db_url: str) -> None:
    insert(migrated_db_url, [engine_row(i, T0 + timedelta(hours=i), prompt_tokens=900, completion_tokens=100,
                                        gpu_seconds=0.5, cost_usd=0.0003) for i in range(3)])
    with Ledger.open(migrated_db_url) as lg:
        (e,) = lg.engines(Window())
        assert not e.has_uptime and e.up_seconds == 0 and e.utilisation is None
        assert e.usd_per_mtok_measured is None and e.idle_usd == 0
        assert e.device_hour_usd == 2.0 and e.device_kind == "gpu"  # from the request rows
        assert e.tokens_per_s == approx(3000 / 1.5)  # throughput from the rows' device seconds
        assert e.usd_per_mtok_at(0.5) == approx(2.0 / (2000 * 3600 * 0.5) * 1e6)
        (t,) = lg.engines(Window(team="labs"))
        assert t.team_share == 1.0 and not t.has_uptime
        assert lg.engines(Window(team="nobody")) == []
    x = inputs(migrated_db_url)
    assert x.utilisation is None and x.up_hours == 0 and any("no engine_uptime rows" in n for n in x.notes)
    r = decide(x)
    assert r.all_hosted_usd is None and r.cheaper == "unknown" and r.all_api_usd > 0
    assert r.break_even_utilisation == approx(3000 / 2000 / 3600 * 2.0 / (r.all_api_usd / (730 / 2)))


def test_engine_uptime_without_requests(migrated_db_url: str) -> None:
    """An engine that was up but served nothing: all idle, no throughput, no division by zero."""
    insert(migrated_db_url, [api_row(1, T0, prompt_tokens=100, completion_tokens=10, cost_usd=0.00012)],
           [uptime_row(i, T0 + timedelta(minutes=i), 60.0, 0.0) for i in range(10)])
    with Ledger.open(migrated_db_url) as lg:
        (e,) = lg.engines(Window())
        assert e.requests == 0 and e.utilisation == 0.0 and e.tokens_per_s is None
        assert e.usd_per_mtok_measured is None and e.usd_per_mtok_at(0.5) is None
        assert e.idle_usd == approx(600 / 3600 * 2.0)
        (t,) = lg.engines(Window(team="labs"))
        assert t.team_share == 0.0 and t.paid_usd == 0.0  # nothing attributed: no share of the engine
    r = decide(inputs(migrated_db_url))
    assert r.all_hosted_usd is None and r.cheaper == "unknown"


def test_api_backend_without_a_price(migrated_db_url: str) -> None:
    insert(migrated_db_url, [
        api_row(1, T0, backend="mystery", prompt_tokens=500, completion_tokens=50, cost_usd=0.0,
                cost_note="unpriced_model", served_model="no-such-model"),
        api_row(2, T0 + timedelta(hours=2), prompt_tokens=1000, completion_tokens=100, cost_usd=0.0012)])
    with Ledger.open(migrated_db_url) as lg:
        rows = {r.backend: r for r in lg.api_backends(Window())}
        assert rows["mystery"].unpriced_requests == 1 and rows["mystery"].spend_usd == 0
        assert rows["api"].unpriced_requests == 0
        s = lg.summary(Window())
        assert s.zero_cost_unexplained == 0 and s.notes == {"unpriced_model": 1}
    x = inputs(migrated_db_url)
    mystery = next(a for a in x.api if a.backend == "mystery")
    assert mystery.price is None and any("'mystery' has no price" in n for n in x.notes)
    r = decide(x)
    m = 730 / 2
    assert r.current_mix_usd == approx((1000 * 1.0 + 100 * 2.0) / 1e6 * m)  # the unpriced tokens count at $0
    # a policy whose only API is unpriced: nothing to compare with, and no exception
    y = inputs(migrated_db_url, UNPRICED_POLICY)
    assert y.reference is None and any("no priced API backend" in n for n in y.notes)
    ry = decide(y)
    assert ry.all_api_usd is None and ry.break_even_utilisation is None and ry.break_even_daily_tokens is None
    assert ry.cheaper == "unknown"


def test_engine_row_properties_without_data() -> None:
    e = EngineRow(backend="x", device_hour_usd=None, devices=0, device_kind=None, has_uptime=False, up_seconds=0.0,
                  busy_seconds=0.0, paid_usd=0.0, busy_usd=0.0, requests=0, prompt_tokens=0, cached_prompt_tokens=0,
                  completion_tokens=0, attributed_seconds=0.0, charged_usd=0.0, counterfactual_usd=0.0)
    assert e.utilisation is None and e.tokens_per_s is None and e.tokens_per_device_s is None
    assert e.usd_per_mtok_measured is None and e.usd_per_mtok_at(0.5) is None and e.idle_usd == 0


def test_realised_savings_leave_out_rows_without_an_api_alternative(migrated_db_url: str) -> None:
    # Two in-house rows: one on a route with an API alternative ($0.003 there, charged $0.001), one on a
    # route without one (charged $0.002). Savings are $0.002, not $0.003 - $0.003 = $0.
    insert(migrated_db_url, [
        engine_row(1, T0, prompt_tokens=10, cost_usd=0.001, counterfactual_cost_usd=0.003),
        engine_row(2, T0 + timedelta(minutes=1), route="engine-only", prompt_tokens=10, cost_usd=0.002),
    ])
    with Ledger.open(migrated_db_url) as lg:
        s = lg.summary(Window())
        assert s.in_house_charged_usd == approx(0.003) and s.counterfactual_usd == approx(0.003)
        assert s.counterfactual_charged_usd == approx(0.001) and s.realised_savings_usd == approx(0.002)
        (day,) = lg.spend_daily(Window())
        assert day["spend_usd"] == approx(0.003) and day["counterfactual_charged_usd"] == approx(0.001)
        assert day["counterfactual_usd"] - day["counterfactual_charged_usd"] == approx(0.002)
    engine = sa.create_engine(db.sync_url(migrated_db_url))
    try:
        with engine.connect() as conn:
            (view,) = conn.execute(sa.text("SELECT savings_usd FROM realised_savings_daily")).all()
    finally:
        engine.dispose()
    assert view[0] == approx(0.002)  # the view agrees


def test_a_minute_recorded_by_two_gateways_is_paid_once(migrated_db_url: str) -> None:
    # Two gateway replicas scrape the same engine: both write its minutes (different interval_ids).
    rows = [uptime_row(i, T0 + timedelta(minutes=i), 60.0, 6.0) for i in range(10)]
    rows += [dict(uptime_row(i, T0 + timedelta(minutes=i), 59.0, 6.5), interval_id=f"eng|{i}|gw2") for i in range(10)]
    insert(migrated_db_url, [engine_row(1, T0, prompt_tokens=10, gpu_seconds=1.0, cost_usd=0.001)], rows)
    with Ledger.open(migrated_db_url) as lg:
        (e,) = lg.engines(Window())
        assert e.up_seconds == approx(600.0) and e.busy_seconds == approx(65.0)  # the larger of each minute
        assert e.paid_usd == approx(600 * 2.0 / 3600)
        (hour,) = lg.busy_by_hour(Window())
        assert (hour.up_seconds, hour.busy_seconds) == (approx(600.0), approx(65.0))
        (day,) = lg.idle_daily(Window())
        assert day["paid_hours"] == approx(600 / 3600)
    engine = sa.create_engine(db.sync_url(migrated_db_url))
    try:
        with engine.connect() as conn:
            (idle,) = conn.execute(sa.text("SELECT paid_hours, busy_hours FROM engine_idle_daily")).all()
            (util,) = conn.execute(sa.text("SELECT up_seconds, busy_seconds FROM engine_utilisation_hourly")).all()
            recorders = conn.execute(sa.text("SELECT DISTINCT recorders FROM engine_minutes")).scalars().all()
    finally:
        engine.dispose()
    assert tuple(idle) == (approx(600 / 3600), approx(65 / 3600)) and tuple(util) == (approx(600.0), approx(65.0))
    assert recorders == [2]
