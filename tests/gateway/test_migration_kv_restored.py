"""Migration 0007 (issue 34): the KV-tier restored-token columns go onto `requests` and the end of `cost_ledger`,
and come off again on a downgrade, on SQLite and PostgreSQL alike (a SQLite table rebuild would fail on the other
views over `requests`, so the downgrade drops the columns in place)."""
from __future__ import annotations

import sqlalchemy as sa
from alembic import command

from gateway import db


def _view_columns(url: str) -> list[str]:
    engine = sa.create_engine(db.sync_url(url))
    try:
        with engine.connect() as conn:
            return list(conn.execute(sa.text("SELECT * FROM cost_ledger")).keys())
    finally:
        engine.dispose()


def test_upgrade_appends_and_downgrade_removes_the_columns(db_url: str) -> None:
    db.upgrade(db_url)
    cols = _view_columns(db_url)
    at = cols.index("replica")  # later migrations may append after these
    assert cols[at:at + 3] == ["replica", "kv_restored_host_tokens", "kv_restored_disk_tokens"]
    command.downgrade(db.alembic_config(db_url), "0006_request_replica")
    assert db.current_revision(db_url) == "0006_request_replica"
    assert _view_columns(db_url)[-1] == "replica"
    db.upgrade(db_url)
    assert db.current_revision(db_url) == db.head_revision()
    assert "kv_restored_disk_tokens" in _view_columns(db_url)
