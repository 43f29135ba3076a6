"""Every query in docs/sql-cookbook.md runs on SQLite and PostgreSQL and gives the right answer.

The `cost_ledger` queries run on a ledger seeded through the real LedgerWriter; expected answers are computed
in Python from the same records. The queries over the buy-versus-host views (migration 0003) run on a ledger
from gateway/testing/ledger_seed.py (engine_uptime rows included); their expected answers are computed in
Python from that ledger's raw `requests` and `engine_uptime` rows.
"""
from __future__ import annotations

import math
import random
import re
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from sqlalchemy import create_engine

from gateway.db import sync_url
from gateway.ledger.record import LedgerRecord
from gateway.ledger.writer import LedgerWriter
from gateway.testing import ledger_seed

COOKBOOK = Path(__file__).resolve().parents[2] / "docs" / "sql-cookbook.md"
T0 = datetime(2025, 3, 1, tzinfo=UTC)
TEAMS = ("labs", "search", "support")
BACKENDS = {"local": "gpu_amortized", "mini": "api_price", "big": "api_price"}
VIEWS = ("engine_minutes", "daily_spend", "engine_utilisation_hourly", "route_cost_per_1k_requests", "realised_savings_daily",
         "prefix_cache_savings_daily", "engine_idle_daily")


def uses_views(sql: str) -> bool:
    return any(re.search(rf"\b{v}\b", sql) for v in VIEWS)


def cookbook_queries() -> dict[str, str]:
    """Heading -> the one ```sql block under it."""
    queries: dict[str, str] = {}
    for section in re.split(r"^## ", COOKBOOK.read_text(), flags=re.MULTILINE)[1:]:
        heading, _, body = section.partition("\n")
        blocks = re.findall(r"```sql\n(.*?)```", body, flags=re.DOTALL)
        if blocks:
            assert len(blocks) == 1, f"section {heading!r} has {len(blocks)} sql blocks"
            assert heading not in queries, f"duplicate heading {heading!r}"
            explanation = body.strip().split("\n")[0]
            assert explanation and not explanation.startswith("```"), f"{heading!r} needs a one-line explanation"
            queries[heading.strip()] = blocks[0].strip()
    return queries


def seed_records(n: int = 600) -> list[LedgerRecord]:
    rng = random.Random(20250301)
    records = []
    for i in range(n):
        team = TEAMS[i % 3]
        created = T0 + timedelta(seconds=rng.randrange(3 * 86400))
        status = rng.choices(["ok", "error", "client_closed", "rejected"], [80, 10, 5, 5])[0]
        routed = status != "rejected"
        backend = rng.choice(list(BACKENDS)) if routed else None
        prompt = rng.randrange(20, 2000)
        cached = rng.randrange(0, prompt // 2) if backend == "local" else rng.choice([0, prompt // 4])
        completion = rng.randrange(1, 600) if status in ("ok", "client_closed") else 0
        cost = 0.0 if not routed else round(prompt * 1e-6 + completion * 4e-6, 9)
        in_house = backend == "local"
        auto = routed and i % 4 == 0
        records.append(LedgerRecord(
            request_id=f"ck-{i:05d}", created_at=created, api_key_id=f"key_{team}_{i % 2}", team=team,
            requested_model="gpt-4o-mini", route="auto" if auto else "gpt-4o-mini", backend=backend,
            served_model=backend, prompt_tokens=prompt if routed else 0,
            cached_prompt_tokens=cached if routed else 0, completion_tokens=completion,
            cost_usd=cost / 3 if in_house else cost, cost_basis=BACKENDS.get(backend or ""),
            gpu_seconds=0.01 * completion if in_house else None,
            device_hour_usd=2.5 if in_house else None,
            # half the engine rows from before migration 0005 (no busy_cost_usd): the cookbook works it out
            busy_cost_usd=0.01 * completion * 2.5 / 3600 if in_house and i % 2 else None,
            counterfactual_cost_usd=cost if in_house else None,
            latency_ms=round(rng.lognormvariate(5, 0.6), 3) if routed else 1.0,
            status=status, error_type="upstream_5xx" if status == "error" else None,
            policy_version="p-one" if created < T0 + timedelta(days=1) else "p-two",
            difficulty=round(rng.random(), 6) if auto else None, threshold=0.6 if auto else None,
        ))
    return records


def _day(r: LedgerRecord) -> str:
    return r.created_at.strftime("%Y-%m-%d")


def _num(v):
    return float(v) if isinstance(v, Decimal) else v  # PostgreSQL returns NUMERIC for 1.0 * …


def run(url: str, sql: str) -> list[tuple]:
    engine = create_engine(sync_url(url))
    try:
        with engine.connect() as conn:
            if engine.dialect.name == "postgresql":
                conn.exec_driver_sql("SET TIME ZONE 'UTC'")
            return [tuple(_num(v) for v in row) for row in conn.exec_driver_sql(sql)]
    finally:
        engine.dispose()


def nearest_rank(values: list[float], pct: int) -> float:
    ordered = sorted(values)
    return ordered[math.ceil(len(ordered) * pct / 100) - 1]


@pytest.fixture
async def seeded(migrated_db_url: str, tmp_path: Path) -> tuple[str, list[LedgerRecord]]:
    records = seed_records()
    writer = LedgerWriter(migrated_db_url, tmp_path / "spool.jsonl")
    await writer.start()
    for r in records:
        writer.submit(r)
    await writer.close()
    assert writer.stats.written == len(records)
    return migrated_db_url, records


def test_cookbook_has_enough_portable_queries() -> None:
    queries = cookbook_queries()
    assert len(queries) >= 8
    assert sum(uses_views(sql) for sql in queries.values()) >= 8
    for view in VIEWS:
        assert any(re.search(rf"\b{view}\b", sql) for sql in queries.values()), f"no query reads {view}"
    for heading, sql in queries.items():
        assert "cost_ledger" in sql or uses_views(sql), heading
        # keep them portable: no dialect-only functions or casts
        for banned in ("::", "percentile_cont", "date_trunc", "strftime(", "julianday", "interval", "ilike"):
            assert banned not in sql.lower(), f"{heading!r} uses non-portable {banned!r}"


def test_every_query_runs_and_answers_correctly(seeded: tuple[str, list[LedgerRecord]]) -> None:
    url, records = seeded
    queries = cookbook_queries()
    results = {heading: run(url, sql) for heading, sql in queries.items() if not uses_views(sql)}
    for heading, rows in results.items():
        assert rows, f"{heading!r} returned no rows"
    ok = [r for r in records if r.status == "ok"]
    approx = lambda x: pytest.approx(x, rel=1e-9, abs=1e-12)

    # spend by team per day
    expected: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    for r in records:
        expected[(_day(r), r.team)][0] += 1
        expected[(_day(r), r.team)][1] += r.cost_usd
    got = {(d, t): (n, s) for d, t, n, s in results["Spend by team per day"]}
    assert got.keys() == expected.keys() and len(got) == 9
    for k, (n, s) in expected.items():
        assert got[k][0] == n and got[k][1] == approx(s)

    # spend by backend
    by_backend: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for r in records:
        if r.backend:
            by_backend[r.backend][0] += 1
            by_backend[r.backend][1] += r.cost_usd
    rows = results["Spend by backend in a date range"]
    assert {b: (n, s) for b, _, n, _, _, s in rows} == {b: (n, approx(s)) for b, (n, s) in by_backend.items()}
    assert [row[5] for row in rows] == sorted((row[5] for row in rows), reverse=True)
    assert {b: basis for b, basis, *_ in rows} == BACKENDS

    # p95 latency (nearest rank) against Python on the same distribution
    rows = results["p95 latency by backend"]
    for backend, n, p95 in rows:
        lat = [r.latency_ms for r in ok if r.backend == backend]
        assert n == len(lat) and p95 == approx(nearest_rank(lat, 95))
    assert len(rows) == 3

    # in-house share
    ((n, req_share, tok_share),) = results["In-house share of requests and tokens"]
    local = [r for r in ok if r.cost_basis == "gpu_amortized"]
    assert n == len(ok) and req_share == approx(len(local) / len(ok))
    tokens = lambda rs: sum(r.prompt_tokens + r.completion_tokens for r in rs)
    assert tok_share == approx(tokens(local) / tokens(ok))

    # savings vs all-API
    ((n, cost, api, savings),) = results["Savings versus sending everything to the API"]
    inh = [r for r in records if r.cost_basis == "gpu_amortized"]
    assert n == len(inh) and cost == approx(sum(r.cost_usd for r in inh))
    assert savings == approx(sum(r.counterfactual_cost_usd - r.cost_usd for r in inh))
    assert savings > 0 and api == approx(cost + savings)

    # cache hit share
    for backend, prompt, cached, share in results["Prompt-cache hit share by backend"]:
        rs = [r for r in records if r.backend == backend]
        assert prompt == sum(r.prompt_tokens for r in rs) and cached == sum(r.cached_prompt_tokens for r in rs)
        assert share == approx(cached / prompt)

    # error rate
    for backend, n, err, closed in results["Error rate by backend"]:
        rs = [r for r in records if r.backend == backend]
        assert n == len(rs)
        assert err == approx(sum(r.status == "error" for r in rs) / len(rs))
        assert closed == approx(sum(r.status == "client_closed" for r in rs) / len(rs))

    # top keys
    spend: dict[str, float] = defaultdict(float)
    for r in records:
        spend[r.api_key_id] += r.cost_usd
    rows = results["Top keys by spend"]
    assert [k for k, *_ in rows] == sorted(spend, key=lambda k: -spend[k])
    assert all(s == approx(spend[k]) and t == k.split("_")[1] for k, t, _, s in rows)

    # cost per 1k completion tokens
    for backend, completion, per_1k in results["Cost per 1k completion tokens by backend"]:
        rs = [r for r in ok if r.backend == backend]
        assert completion == sum(r.completion_tokens for r in rs)
        assert per_1k == approx(1000 * sum(r.cost_usd for r in rs) / completion)
    local_1k, = [p for b, _, p in results["Cost per 1k completion tokens by backend"] if b == "local"]
    assert local_1k == min(p for *_, p in results["Cost per 1k completion tokens by backend"])

    # policy versions
    rows = results["Requests by policy version"]
    assert [(v, n) for v, n, *_ in rows] == [
        ("p-one", sum(r.policy_version == "p-one" for r in records)),
        ("p-two", sum(r.policy_version == "p-two" for r in records)),
    ]

    # router decisions
    ((route, n, avg, above),) = results["Router decisions by route"]
    auto = [r for r in records if r.route == "auto"]
    assert route == "auto" and n == len(auto)
    assert avg == approx(sum(r.difficulty for r in auto) / n)
    assert above == approx(sum(r.difficulty >= 0.6 for r in auto) / n)

    # running spend: the last cumulative value per team is the team's total
    last: dict[str, float] = {}
    for team, _day_, _spend, cumulative in results["Running spend per team"]:
        last[team] = cumulative
    for team in TEAMS:
        assert last[team] == approx(sum(r.cost_usd for r in records if r.team == team))

    # stable chargeback: device seconds at the list rate, beside the amortised cost
    charge: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for r in records:
        if r.cost_basis == "gpu_amortized" and r.gpu_seconds is not None:
            c = charge[(r.team, r.backend)]
            c[0] += 1
            c[1] += r.gpu_seconds * 2.5 / 3600
            c[2] += r.cost_usd
    got = {(t, b): (n, lr, am) for t, b, n, _s, lr, am in results["Stable chargeback per team"]}
    assert got.keys() == charge.keys() and got
    for k, (n, lr, am) in charge.items():
        assert got[k][0] == n and got[k][1] == approx(lr) and got[k][2] == approx(am)


# ---------------------------------------------------------------------------------- the buy-versus-host views


def _utc_text(value) -> str:
    """created_at as read back (SQLite: UTC text; PostgreSQL: an aware datetime) → 'YYYY-MM-DD HH:MM:SS' UTC."""
    if isinstance(value, str):
        return value[:19]
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


@pytest.fixture
def seeded_views(migrated_db_url: str) -> str:
    # 4,000 requests a day: busy enough that some hours are above 5% utilisation and some below
    ledger_seed.seed(migrated_db_url, rows=8000, days=2, seed=11)
    return migrated_db_url


def test_view_queries_answer_correctly(seeded_views: str) -> None:
    url = seeded_views
    queries = {h: sql for h, sql in cookbook_queries().items() if uses_views(sql)}
    results = {heading: run(url, sql) for heading, sql in queries.items()}
    for heading, rows in results.items():
        assert rows, f"{heading!r} returned no rows"
    approx = lambda x: pytest.approx(x, rel=1e-9, abs=1e-12)
    reqs = [dict(zip(("t", "team", "route", "backend", "basis", "p", "c", "o", "cost", "cf", "gpu", "sav"),
                     (_utc_text(r[0]), *r[1:]), strict=True))
            for r in run(url, "SELECT created_at, team, route, backend, cost_basis, prompt_tokens, cached_prompt_tokens, "
                              "completion_tokens, cost_usd, counterfactual_cost_usd, gpu_seconds, cache_savings_usd "
                              "FROM requests")]
    uptime = [(_utc_text(t), b, s, busy, rate) for t, b, s, busy, rate in run(
        url, "SELECT created_at, backend, seconds, busy_seconds, device_hour_usd FROM engine_uptime")]
    assert len(reqs) == 8000 and len(uptime) == 2 * 2 * 1440

    # daily_spend: API and in-house per team and day
    spend: dict = defaultdict(lambda: [0.0, 0.0, 0])
    for r in reqs:
        e = spend[(r["t"][:10], r["team"])]
        e[0] += r["cost"] if r["basis"] == "api_price" else 0.0
        e[1] += r["cost"] if r["basis"] == "gpu_amortized" else 0.0
        e[2] += 1
    rows = results["The `daily_spend` view"]
    assert [(d, t) for d, t, *_ in rows] == sorted(spend)
    for d, t, api, inh, n in rows:
        assert (api, inh, n) == (approx(spend[(d, t)][0]), approx(spend[(d, t)][1]), spend[(d, t)][2])
    assert len(rows) == 2 * len(ledger_seed.TEAMS)

    # hours per engine: up, busy and price from engine_uptime; requests from the engines' rows
    hours: dict = defaultdict(lambda: [0.0, 0.0, 0.0, 0])  # up, busy, idle usd, requests
    for t, b, s, busy, rate in uptime:
        e = hours[(b, t[:13])]
        e[0] += s
        e[1] += busy
        e[2] += (s - busy) * rate / 3600
    for r in reqs:
        if r["basis"] == "gpu_amortized":
            hours[(r["backend"], r["t"][:13])][3] += 1
    quiet: dict = defaultdict(lambda: [0, 0.0, 0.0])
    for (b, _), (s, busy, idle, _) in hours.items():
        if busy / s < 0.05:
            quiet[b][0] += 1
            quiet[b][1] += s / 3600
            quiet[b][2] += idle
    rows = results["The `engine_utilisation_hourly` view"]
    assert {b: (n, approx(h), approx(i)) for b, (n, h, i) in quiet.items()} == {b: (n, h, i) for b, n, h, i in rows}
    assert all(0 < n < 48 for _, n, _, _ in rows)  # some hours quiet, some not

    by_hour: dict = defaultdict(lambda: [0.0, 0.0, 0])
    for (b, hour), (s, busy, _, n) in hours.items():
        e = by_hour[(b, hour[11:13])]
        e[0] += s
        e[1] += busy
        e[2] += n
    rows = results["Utilisation by hour of day"]
    assert [(b, h) for b, h, *_ in rows] == sorted(by_hour) and len(rows) == 48
    for b, h, util, n in rows:
        assert util == approx(by_hour[(b, h)][1] / by_hour[(b, h)][0]) and n == by_hour[(b, h)][2]
    gpu = {h: u for b, h, u, _ in rows if b == "local-gpu"}
    assert gpu["15"] > 2 * gpu["03"]  # the seeded diurnal shape: afternoons busier than nights

    # route_cost_per_1k_requests
    routes: dict = defaultdict(lambda: [0, 0.0])
    for r in reqs:
        if r["route"] is not None:
            routes[r["route"]][0] += 1
            routes[r["route"]][1] += r["cost"]
    rows = results["The `route_cost_per_1k_requests` view"]
    assert {rt: (n, s, p) for rt, n, s, p in rows} == {
        rt: (n, approx(s), approx(1000 * s / n)) for rt, (n, s) in routes.items()}
    assert [p for *_, p in rows] == sorted((p for *_, p in rows), reverse=True)

    # realised_savings_daily
    inh = [r for r in reqs if r["basis"] == "gpu_amortized" and r["cf"] is not None]
    rows = results["The `realised_savings_daily` view"]
    assert [b for b, *_ in rows] == ["local-cpu", "local-gpu"]
    for b, n, charged, api, savings, share in rows:
        mine = [r for r in inh if r["backend"] == b]
        assert n == len(mine) and charged == approx(sum(r["cost"] for r in mine))
        assert api == approx(sum(r["cf"] for r in mine))
        assert savings == approx(api - charged) and share == approx((api - charged) / api)

    # prefix cache: hit share over all prompt tokens, dollars saved by the API's cached rate
    rows = results["The `prefix_cache_savings_daily` view"]
    assert [b for b, *_ in rows] == sorted({r["backend"] for r in reqs if r["backend"]})
    for b, prompt, cached, share, saved in rows:
        mine = [r for r in reqs if r["backend"] == b]
        assert prompt == sum(r["p"] for r in mine) and cached == sum(r["c"] for r in mine)
        assert share == approx(cached / prompt)
        assert saved == approx(sum(r["sav"] or 0.0 for r in mine if r["c"] > 0))
    saved = {b: s for b, *_, s in rows}
    assert saved["claude-sonnet"] > 0 and saved["local-gpu"] == 0

    # engine_idle_daily: days where idle cost more than the work
    days: dict = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])  # up, busy, idle usd, busy usd
    for t, b, s, busy, rate in uptime:
        e = days[(t[:10], b)]
        e[0] += s
        e[1] += busy
        e[2] += (s - busy) * rate / 3600
        e[3] += busy * rate / 3600
    expected = sorted(k for k, e in days.items() if e[2] > e[3])
    rows = results["The `engine_idle_daily` view"]
    assert [(d, b) for d, b, *_ in rows] == expected and expected
    for d, b, idle, busy_usd, util in rows:
        e = days[(d, b)]
        assert (idle, busy_usd, util) == (approx(e[2]), approx(e[3]), approx(e[1] / e[0]))

    # engine_minutes: one recorder per minute in the seeded ledger
    rows = results["The `engine_minutes` view"]
    per_backend: dict = defaultdict(lambda: [0, 0.0])
    for _, b, sec, _, _ in uptime:
        per_backend[b][0] += 1
        per_backend[b][1] += sec / 3600
    assert [(b, m, twice) for b, m, twice, _ in rows] == [(b, e[0], 0) for b, e in sorted(per_backend.items())]
    assert [h for *_, h in rows] == [approx(e[1]) for _, e in sorted(per_backend.items())]

    # break-even utilisation per engine
    rows = results["Break-even check: cost per Mtok at measured utilisation versus the API"]
    assert [b for b, *_ in rows] == ["local-cpu", "local-gpu"]
    for b, util, hosted, api, be in rows:
        up = [u for u in uptime if u[1] == b]
        paid = sum(s * rate / 3600 for _, _, s, _, rate in up)
        u = sum(busy for *_, busy, _ in up) / sum(s for _, _, s, _, _ in up)
        mine = [r for r in reqs if r["basis"] == "gpu_amortized" and r["backend"] == b]
        tokens = sum(r["p"] + r["o"] for r in mine)
        priced = [r for r in mine if r["cf"] is not None]
        api_per_mtok = 1e6 * sum(r["cf"] for r in priced) / sum(r["p"] + r["o"] for r in priced)
        assert util == approx(u) and hosted == approx(1e6 * paid / tokens) and api == approx(api_per_mtok)
        assert be == approx(u * (1e6 * paid / tokens) / api_per_mtok)
