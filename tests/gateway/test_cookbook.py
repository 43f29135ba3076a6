"""Every query in docs/sql-cookbook.md runs on SQLite and PostgreSQL and gives the right answer.

The ledger is seeded through the real LedgerWriter; expected answers are computed in Python from the
same records.
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

COOKBOOK = Path(__file__).resolve().parents[2] / "docs" / "sql-cookbook.md"
T0 = datetime(2025, 3, 1, tzinfo=UTC)
TEAMS = ("labs", "search", "support")
BACKENDS = {"local": "gpu_amortized", "mini": "api_price", "big": "api_price"}


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
    for heading, sql in queries.items():
        assert "cost_ledger" in sql, heading
        # keep them portable: no dialect-only functions or casts
        for banned in ("::", "percentile_cont", "date_trunc", "strftime(", "julianday", "interval", "ilike"):
            assert banned not in sql.lower(), f"{heading!r} uses non-portable {banned!r}"


def test_every_query_runs_and_answers_correctly(seeded: tuple[str, list[LedgerRecord]]) -> None:
    url, records = seeded
    queries = cookbook_queries()
    results = {heading: run(url, sql) for heading, sql in queries.items()}
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
