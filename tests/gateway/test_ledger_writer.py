"""LedgerWriter against real SQLite files and real PostgreSQL: batching, flush/close, spool and replay."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections import Counter
from dataclasses import fields
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from gateway.db import sync_url, upgrade
from gateway.ledger.models import RequestRow
from gateway.ledger.record import LedgerRecord
from gateway.ledger.writer import QUEUE_DEPTH, ROWS_WRITTEN, LedgerWriter

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
DEAD_PG = "postgresql://postgres@127.0.0.1:1/nowhere"  # nothing listens on port 1: refused at once


# ---- helpers (also used by test_ledger_outage.py) ---------------------------------------------------

def make_record(i: int, prefix: str = "req", **overrides) -> LedgerRecord:
    base = {
        "request_id": f"{prefix}-{i:06d}", "created_at": T0 + timedelta(seconds=i), "api_key_id": "key_a",
        "team": "search", "requested_model": "gpt-4o-mini", "route": "gpt-4o-mini", "backend": "mini",
        "served_model": "openai/gpt-4o-mini", "prompt_tokens": 100 + i % 7, "completion_tokens": 20 + i % 5,
        "cost_usd": 0.0001 * (i % 13), "cost_basis": "api_price", "latency_ms": 50.0 + i % 11,
    }
    return LedgerRecord(**{**base, **overrides})


def request_id_counts(url: str) -> Counter[str]:
    engine = create_engine(sync_url(url))
    try:
        with engine.connect() as conn:
            return Counter(r[0] for r in conn.execute(text("SELECT request_id FROM requests")))
    finally:
        engine.dispose()


def assert_exactly_once(url: str, expected_ids: set[str]) -> None:
    counts = request_id_counts(url)
    missing = expected_ids - counts.keys()
    dupes = {k: v for k, v in counts.items() if v > 1}
    extra = counts.keys() - expected_ids
    assert not missing, f"{len(missing)} rows lost, e.g. {sorted(missing)[:5]}"
    assert not dupes, f"duplicated rows: {dict(list(dupes.items())[:5])}"
    assert not extra, f"unexpected rows: {sorted(extra)[:5]}"


def spool_lines(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if line.strip()) if path.exists() else 0


# ---- LedgerRecord -----------------------------------------------------------------------------------

def test_record_mirrors_the_requests_table() -> None:
    columns = {c.name for c in RequestRow.__table__.columns} - {"id"}
    assert {f.name for f in fields(LedgerRecord)} == columns
    with pytest.raises(TypeError):
        LedgerRecord()  # request_id and created_at are required


def test_record_json_round_trip_normalises_to_utc() -> None:
    local = datetime(2025, 3, 1, 14, 0, tzinfo=UTC).astimezone(__import__("datetime").timezone(timedelta(hours=2)))
    rec = make_record(1, created_at=local, difficulty=0.7, stream=True)
    back = LedgerRecord.from_json(json.loads(json.dumps(rec.to_json())))
    assert back.to_row() == rec.to_row()
    assert back.to_row()["created_at"] == datetime(2025, 3, 1, 14, 0, tzinfo=UTC)
    naive = make_record(2, created_at=datetime(2025, 1, 1, 8, 0)).to_row()["created_at"]
    assert naive.tzinfo is not None and naive.hour == 8


# ---- writing ------------------------------------------------------------------------------------------

async def test_batches_and_close_writes_everything(migrated_db_url: str, tmp_path: Path) -> None:
    writer = LedgerWriter(migrated_db_url, tmp_path / "spool.jsonl", batch_size=50, flush_interval_s=0.05)
    await writer.start()
    before = ROWS_WRITTEN.labels("direct")._value.get()
    ids = set()
    for i in range(500):
        rec = make_record(i)
        ids.add(rec.request_id)
        writer.submit(rec)
    await writer.close()
    assert_exactly_once(migrated_db_url, ids)
    assert writer.stats.written == 500 and writer.stats.spooled == 0
    # batched: 500 rows in about 500/50 multi-row inserts, not 500 round trips
    assert 10 <= writer.stats.batches <= 15
    assert ROWS_WRITTEN.labels("direct")._value.get() - before == 500
    assert not (tmp_path / "spool.jsonl").exists()


async def test_all_columns_round_trip_through_the_view(migrated_db_url: str, tmp_path: Path) -> None:
    rec = make_record(
        7, endpoint="completions", cached_prompt_tokens=64, input_cost_usd=0.002, output_cost_usd=0.001,
        cost_usd=0.003, cost_basis="gpu_amortized", gpu_seconds=0.42, counterfactual_cost_usd=0.01,
        ttft_ms=12.5, status="error", error_type="upstream_timeout", http_status=504, attempts=3,
        policy_version="p-abc", price_table_version="litellm-1.2", difficulty=0.31, threshold=0.5,
        route_reason="difficulty", stream=True,
    )
    writer = LedgerWriter(migrated_db_url, tmp_path / "spool.jsonl")
    await writer.start()
    writer.submit(rec)
    await writer.close()
    engine = create_engine(sync_url(migrated_db_url))
    with engine.connect() as conn:
        row = conn.execute(text("SELECT * FROM cost_ledger")).mappings().one()
    engine.dispose()
    expected = rec.to_row()
    for name, value in row.items():
        if name == "created_at":
            if isinstance(value, str):  # SQLite stores "YYYY-MM-DD HH:MM:SS.ffffff" in UTC
                assert value == "2025-03-01 12:00:07.000000"
                value = datetime.fromisoformat(value)
            got = value if value.tzinfo else value.replace(tzinfo=UTC)
            assert got == expected["created_at"]
        elif name == "stream":
            assert bool(value) is True
        else:
            assert value == expected[name], name


async def test_flush_makes_rows_durable_while_running(migrated_db_url: str, tmp_path: Path) -> None:
    writer = LedgerWriter(migrated_db_url, tmp_path / "spool.jsonl", flush_interval_s=5.0)
    await writer.start()
    for i in range(10):
        writer.submit(make_record(i))
    await writer.flush()  # must not wait out the 5 s batching window
    assert sum(request_id_counts(migrated_db_url).values()) == 10
    assert writer.queue_depth == 0
    await writer.close()


async def test_database_down_rows_spool_then_replay_at_next_start(sqlite_url: str, tmp_path: Path) -> None:
    spool = tmp_path / "spool.jsonl"
    down = LedgerWriter(DEAD_PG, spool, batch_size=32, retry_initial_s=0.05)
    await down.start()
    for i in range(100):
        down.submit(make_record(i))  # never raises, never blocks, although the DB is unreachable
    await down.flush()
    assert spool_lines(spool) == 100
    await down.close()
    assert not down.db_available and down.stats.written == 0 and down.stats.spooled == 100

    upgrade(sqlite_url)
    up = LedgerWriter(sqlite_url, spool)
    await up.start()
    await up.close()
    assert_exactly_once(sqlite_url, {f"req-{i:06d}" for i in range(100)})
    assert up.stats.replayed == 100
    assert not spool.exists() and not up.replay_path.exists()


async def test_full_queue_overflows_to_spool_without_loss(migrated_db_url: str, tmp_path: Path) -> None:
    writer = LedgerWriter(migrated_db_url, tmp_path / "spool.jsonl", max_queue=10, batch_size=5)
    await writer.start()
    depth_before = QUEUE_DEPTH._value.get()
    for i in range(200):  # no await in between: the background task cannot drain meanwhile
        writer.submit(make_record(i))
    assert writer.queue_depth == 10
    assert QUEUE_DEPTH._value.get() - depth_before == 10
    assert writer.stats.spooled == 190
    await writer.close()
    assert_exactly_once(migrated_db_url, {f"req-{i:06d}" for i in range(200)})
    assert writer.stats.written + writer.stats.replayed == 200
    assert not writer.spool_path.exists()


async def test_replay_after_crash_is_idempotent(migrated_db_url: str, tmp_path: Path) -> None:
    """A crash can leave rows both in the DB and in the spool, and a half-replayed .replaying file."""
    spool = tmp_path / "spool.jsonl"
    first = LedgerWriter(migrated_db_url, spool)
    await first.start()
    for i in range(20):  # committed rows whose acknowledgement was "lost"
        first.submit(make_record(i))
    await first.close()

    replaying = spool.with_name(spool.name + ".replaying")
    replaying.write_text("".join(json.dumps(make_record(i).to_json()) + "\n" for i in range(60)))
    spool.write_text("".join(json.dumps(make_record(i).to_json()) + "\n" for i in range(40, 100))
                     + '{"request_id": "req-torn", "created_at": "2025-03-01T1')  # torn by the crash
    second = LedgerWriter(migrated_db_url, spool)
    await second.start()
    second.submit(make_record(100))
    await second.close()

    assert_exactly_once(migrated_db_url, {f"req-{i:06d}" for i in range(101)})
    assert second.stats.replayed == 80  # ids 20..99
    assert second.stats.duplicates == 40  # 0..19 from .replaying, 40..59 in both files
    assert not spool.exists() and not replaying.exists()
    rejected = second.rejected_path.read_text().splitlines()
    assert len(rejected) == 1 and "req-torn" in json.loads(rejected[0])["line"]


async def test_rows_the_database_refuses_do_not_block_the_rest(migrated_db_url: str, tmp_path: Path) -> None:
    writer = LedgerWriter(migrated_db_url, tmp_path / "spool.jsonl", batch_size=20)
    await writer.start()
    for i in range(30):
        writer.submit(make_record(i, status=None if i == 5 else "ok"))  # status is NOT NULL
    await writer.close()
    assert_exactly_once(migrated_db_url, {f"req-{i:06d}" for i in range(30) if i != 5})
    assert writer.stats.rejected == 1 and writer.stats.spooled == 0
    bad = json.loads(writer.rejected_path.read_text())
    assert bad["row"]["request_id"] == "req-000005" and bad["error"]


def test_hard_crash_after_flush_loses_nothing(sqlite_url: str, tmp_path: Path) -> None:
    """A real process spools while the DB is down, flushes, and dies with os._exit (no close)."""
    spool = tmp_path / "spool.jsonl"
    script = textwrap.dedent(f"""
        import asyncio, os, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_ledger_writer import make_record
        from gateway.ledger.writer import LedgerWriter

        async def main():
            w = LedgerWriter({DEAD_PG!r}, {str(spool)!r}, batch_size=25)
            await w.start()
            for i in range(300):
                w.submit(make_record(i, prefix="crash"))
            await w.flush()
            os._exit(9)

        asyncio.run(main())
    """)
    proc = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr
    assert spool_lines(spool) == 300

    import asyncio

    async def replay() -> LedgerWriter:
        w = LedgerWriter(sqlite_url, spool)
        await w.start()
        await w.close()
        return w

    upgrade(sqlite_url)
    w = asyncio.run(replay())
    assert w.stats.replayed == 300
    assert_exactly_once(sqlite_url, {f"crash-{i:06d}" for i in range(300)})


async def test_malformed_record_is_set_aside_not_retried_forever(migrated_db_url: str, tmp_path: Path) -> None:
    writer = LedgerWriter(migrated_db_url, tmp_path / "spool.jsonl", batch_size=10, flush_interval_s=0.01)
    await writer.start()
    for i in range(25):
        writer.submit(make_record(i, created_at="yesterday") if i == 3 else make_record(i))
    await writer.flush()
    await writer.close()
    assert_exactly_once(migrated_db_url, {f"req-{i:06d}" for i in range(25) if i != 3})
    assert writer.stats.rejected == 1
    assert "req-000003" in writer.rejected_path.read_text()
