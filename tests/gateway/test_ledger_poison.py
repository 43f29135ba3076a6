"""Issue 30, defect 1: a client string the database refuses must never wedge the ledger.

Real SQLite and PostgreSQL. PostgreSQL refuses NUL characters in text, no UTF-8 driver can encode a lone
surrogate (which JSON can carry: "\\ud800"), and a value longer than its VARCHAR column is refused too.
Before the fix, one such row made the writer take the whole batch for a database outage: it spooled it,
every replay failed on the same row, and every later row of every tenant only reached the spool.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import sqlalchemy as sa

from gateway import db
from gateway.ledger import sanitize
from gateway.ledger.models import EngineUptimeRow, RequestRow, ShadowEvalRow
from gateway.ledger.record import ShadowRecord, UptimeRecord
from gateway.ledger.writer import ROWS_REJECTED, LedgerWriter, ShadowEvalWriter, UptimeWriter
from tests.gateway.test_ledger_writer import T0, assert_exactly_once, make_record

# One hostile value per record, each in a column a client (or an upstream) controls.
HOSTILE = [
    {"requested_model": "x\u0000"},
    {"team": "t\ud800eam"},
    {"api_key_id": "k\u0000\udfff"},
    {"route": "r" * 1000},
    {"error_type": "e" * 65 + "\u0000"},
    {"served_model": "\ud83d\ude00 fine", "completion_text": "a\u0000b" * 10_000},
    {"prompt_tokens": 2**40},  # an upstream's absurd usage: beyond PostgreSQL's INTEGER
]


def _rows(url: str, table: str, where: str = "1=1") -> list[dict]:
    engine = sa.create_engine(db.sync_url(url))
    try:
        with engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(sa.text(f"SELECT * FROM {table} WHERE {where}"))]
    finally:
        engine.dispose()


def _assert_storable(rows: list[dict], table: sa.Table) -> None:
    for row in rows:
        for col in table.columns:
            value = row[col.name]
            if isinstance(value, str):
                assert "\x00" not in value and not any(0xD800 <= ord(c) <= 0xDFFF for c in value), col.name
                if getattr(col.type, "length", None):
                    assert len(value) <= col.type.length, col.name


async def test_hostile_strings_land_cleaned_and_the_ledger_keeps_flowing(migrated_db_url: str, tmp_path: Path) -> None:
    writer = LedgerWriter(migrated_db_url, tmp_path / "spool.jsonl", batch_size=16, flush_interval_s=0.01)
    await writer.start()
    ids = set()
    for i in range(70):  # several tenants; the hostile rows sit among the others
        rec = make_record(i, **{"team": f"team-{i % 3}", **(HOSTILE[i // 10] if i % 10 == 5 else {})})
        ids.add(rec.request_id)
        writer.submit(rec)
    await writer.flush()
    assert writer.db_available and writer.stats.spooled == 0
    for i in range(70, 100):  # later rows of every tenant go straight to the database
        rec = make_record(i, team=f"team-{i % 3}")
        ids.add(rec.request_id)
        writer.submit(rec)
    await writer.close()

    assert_exactly_once(migrated_db_url, ids)
    assert writer.stats.spooled == 0 and writer.stats.rejected == 0 and writer.stats.outages == 0
    assert not writer.spool_path.exists() and not writer.rejected_path.exists()
    rows = {r["request_id"]: r for r in _rows(migrated_db_url, "requests")}
    _assert_storable(list(rows.values()), RequestRow.__table__)
    assert rows["req-000005"]["requested_model"] == "x\ufffd"  # visible, not silently dropped
    assert rows["req-000015"]["team"] == "t\ufffdeam"
    assert rows["req-000035"]["route"] == "r" * 256
    assert rows["req-000055"]["served_model"] == "\U0001F600 fine"  # a valid pair is kept whole
    assert rows["req-000055"]["completion_text"] == "a\ufffdb" * 10_000  # TEXT: cleaned, not cut
    assert rows["req-000065"]["prompt_tokens"] == 2**31 - 1
    assert writer.health()["status"] == "ok"


async def test_every_record_type_is_cleaned_and_long_keys_stay_unique(migrated_db_url: str, tmp_path: Path) -> None:
    shadow = ShadowEvalWriter(migrated_db_url, tmp_path / "shadow.jsonl")
    uptime = UptimeWriter(migrated_db_url, tmp_path / "uptime.jsonl")
    await shadow.start()
    await uptime.start()
    shadow.submit(ShadowRecord(
        request_id="sh-1\u0000", created_at=T0, route="r\ud800", endpoint="chat", prompt_text="p\u0000",
        messages_json='[{"content": "\u0000"}]', easy_backend="e", hard_backend="h", served_backend="e",
        weak_answer="\udfff", strong_answer="s", weak_correct=True, strong_correct=False, judge="j" * 500))
    long_id = "b" * 250
    for suffix in ("1", "2", "1"):  # two distinct ids sharing 250 characters, one of them twice (a replay)
        uptime.submit(UptimeRecord(interval_id=long_id + suffix, created_at=T0, backend="eng\u0000",
                                   seconds=60.0, busy_seconds=1.0, device_hour_usd=2.0))
    await shadow.close()
    await uptime.close()

    for writer in (shadow, uptime):
        assert writer.stats.spooled == 0 and writer.stats.rejected == 0 and not writer.spool_path.exists()
    shadows = _rows(migrated_db_url, "shadow_evals")
    uptimes = _rows(migrated_db_url, "engine_uptime")
    assert len(shadows) == 1 and len(uptimes) == 2
    _assert_storable(shadows, ShadowEvalRow.__table__)
    _assert_storable(uptimes, EngineUptimeRow.__table__)
    assert shadows[0]["prompt_text"] == "p\ufffd" and shadows[0]["judge"] == "j" * 128
    assert len({r["interval_id"] for r in uptimes}) == 2


def test_cleaning_is_deterministic_and_leaves_good_rows_alone() -> None:
    table = RequestRow.__table__
    good = make_record(1, served_model="\U0001F600 ok").to_row()
    assert sanitize.safe_rows(table, [good], "request_id") == [good]
    long_key = make_record(2, request_id="q" * 100).to_row()
    a = sanitize.safe_rows(table, [long_key], "request_id")[0]["request_id"]
    b = sanitize.safe_rows(table, [dict(long_key)], "request_id")[0]["request_id"]
    other = sanitize.safe_rows(table, [make_record(2, request_id="q" * 99 + "r").to_row()], "request_id")
    assert a == b and len(a) == 64 and other[0]["request_id"] != a  # a replay finds the same key


async def test_a_row_the_database_refuses_is_quarantined_and_its_batch_lands(
        pg_url: str, tmp_path: Path, monkeypatch, caplog) -> None:
    """Defence in depth: with the cleaning switched off, PostgreSQL's refusals are row errors, not outages."""
    db.upgrade(pg_url)
    monkeypatch.setattr(sanitize, "safe_rows", lambda table, rows, key: rows)
    poison = {37: {"requested_model": "x\u0000"}, 90: {"stream": "yes"}, 150: {"team": "t\ud800"},
              151: {"route": "r" * 300}}
    writer = LedgerWriter(pg_url, tmp_path / "spool.jsonl", batch_size=200, flush_interval_s=0.05)
    await writer.start()
    before = ROWS_REJECTED._value.get()
    caplog.set_level(logging.WARNING, logger="switchyard.ledger")
    for i in range(200):
        writer.submit(make_record(i, **poison.get(i, {})))
    await writer.flush()
    assert writer.db_available and writer.stats.outages == 0 and writer.stats.spooled == 0
    writer.submit(make_record(200))  # the ledger keeps flowing
    await writer.close()

    assert_exactly_once(pg_url, {f"req-{i:06d}" for i in range(201) if i not in poison})
    assert writer.stats.rejected == 4 and ROWS_REJECTED._value.get() - before == 4
    assert writer.stats.batches < 40  # bisected, not 200 one-row transactions
    quarantined = [json.loads(line) for line in writer.rejected_path.read_text().splitlines()]
    assert sorted(q["row"]["request_id"] for q in quarantined) == [f"req-{i:06d}" for i in sorted(poison)]
    assert all(q["error"] and q["table"] == "requests" for q in quarantined)
    assert any("quarantine" in r.getMessage() and r.levelno >= logging.WARNING for r in caplog.records)
    assert writer.health()["quarantined"] == 4


@pytest.mark.parametrize("cleaning", [True, False])
async def test_poison_rows_in_a_spool_do_not_block_its_replay(
        pg_url: str, tmp_path: Path, monkeypatch, cleaning: bool) -> None:
    """A spool left by an older gateway, with rows PostgreSQL refuses, replays; only what cannot land is set aside."""
    db.upgrade(pg_url)
    if not cleaning:
        monkeypatch.setattr(sanitize, "safe_rows", lambda table, rows, key: rows)
    poison = {10: {"requested_model": "x\u0000"}, 20: {"team": "\ud800"}, 30: {"stream": "yes"}}
    spool = tmp_path / "spool.jsonl"
    spool.write_text("".join(json.dumps(make_record(i, **poison.get(i, {})).to_json()) + "\n" for i in range(100)))
    writer = LedgerWriter(pg_url, spool, batch_size=32)
    await writer.start()
    writer.submit(make_record(100))
    await writer.close()

    refused = {30} if cleaning else set(poison)
    assert_exactly_once(pg_url, {f"req-{i:06d}" for i in range(101) if i not in refused})
    assert writer.stats.rejected == len(refused)
    assert not spool.exists() and not writer.replay_path.exists()
    assert writer.db_available and writer.health()["spool_rows"] == 0
