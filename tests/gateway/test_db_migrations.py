"""Schema upgrades: URL handling, idempotent Alembic upgrades, the cost_ledger view contract."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine as create_sync_engine
from sqlalchemy import inspect, text

from gateway import db
from gateway.cli_handlers import db_upgrade as cli_upgrade
from gateway.ledger.models import Base
from gateway.ledger.views import ALL_COLUMNS, STABLE_COLUMNS

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("given", "expected"), [
    ("sqlite:///data/x.db", "sqlite+aiosqlite:///data/x.db"),
    ("sqlite:////abs/x.db", "sqlite+aiosqlite:////abs/x.db"),
    ("postgresql://u:p%40ss@h:5433/db?sslmode=require", "postgresql+asyncpg://u:p%40ss@h:5433/db?sslmode=require"),
    ("postgres://u@h/db", "postgresql+asyncpg://u@h/db"),
    ("postgresql+asyncpg://u@h/db", "postgresql+asyncpg://u@h/db"),
    ("postgresql+psycopg://u@h/db", "postgresql+psycopg://u@h/db"),
    ("sqlite+aiosqlite:///x.db", "sqlite+aiosqlite:///x.db"),
])
def test_async_url(given: str, expected: str) -> None:
    assert db.async_url(given) == expected


@pytest.mark.parametrize(("given", "expected"), [
    ("sqlite:///data/x.db", "sqlite:///data/x.db"),
    ("sqlite+aiosqlite:///data/x.db", "sqlite:///data/x.db"),
    ("postgresql://u@h/db", "postgresql+psycopg://u@h/db"),
    ("postgres://u@h/db", "postgresql+psycopg://u@h/db"),
    ("postgresql+asyncpg://u@h:1/db", "postgresql+psycopg://u@h:1/db"),
])
def test_sync_url(given: str, expected: str) -> None:
    assert db.sync_url(given) == expected


def test_bad_url_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="scheme://"):
        db.async_url("data/switchyard.db")


def _columns(url: str, name: str) -> list[str]:
    engine = create_sync_engine(db.sync_url(url))
    try:
        with engine.connect() as conn:
            return list(conn.execute(text(f"SELECT * FROM {name} WHERE 1 = 0")).keys())
    finally:
        engine.dispose()


def test_upgrade_is_idempotent_and_creates_schema(db_url: str) -> None:
    assert db.current_revision(db_url) is None
    db.upgrade(db_url)
    db.upgrade(db_url)  # second call at the next start: a no-op, no error
    assert db.current_revision(db_url) == db.head_revision()
    engine = create_sync_engine(db.sync_url(db_url))
    try:
        insp = inspect(engine)
        assert {"requests", "api_keys", "alembic_version"} <= set(insp.get_table_names())
        assert "cost_ledger" in insp.get_view_names()
    finally:
        engine.dispose()


def test_cost_ledger_view_has_the_stable_columns_first(migrated_db_url: str) -> None:
    cols = _columns(migrated_db_url, "cost_ledger")
    assert tuple(cols[:len(STABLE_COLUMNS)]) == STABLE_COLUMNS
    assert tuple(cols) == ALL_COLUMNS
    # prompt/completion text is never exposed to analysts through the view
    assert "prompt_text" not in cols and "completion_text" not in cols


def test_migrations_match_models(migrated_db_url: str) -> None:
    """models.py and the migrated database agree (catches a column added to one but not the other)."""
    engine = create_sync_engine(db.sync_url(migrated_db_url))
    try:
        with engine.connect() as conn:
            diffs = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    finally:
        engine.dispose()
    assert diffs == []


def test_sqlite_parent_dir_created_and_wal(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'deep' / 'er' / 'ledger.db'}"
    db.upgrade(url)
    assert (tmp_path / "deep" / "er" / "ledger.db").is_file()

    async def journal_mode() -> str:
        engine = db.create_engine(f"sqlite:///{tmp_path / 'other' / 'x.db'}")
        async with engine.connect() as conn:
            mode = (await conn.execute(text("PRAGMA journal_mode"))).scalar_one()
            timeout = (await conn.execute(text("PRAGMA busy_timeout"))).scalar_one()
        await engine.dispose()
        assert timeout == db.SQLITE_BUSY_TIMEOUT_MS
        return mode

    import asyncio

    assert asyncio.run(journal_mode()) == "wal"


def test_cli_upgrade_in_process_uses_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'env.db'}"
    monkeypatch.setenv("SWITCHYARD_DATABASE_URL", url)
    assert cli_upgrade(argparse.Namespace(database_url=None)) == 0
    assert db.current_revision(url) == db.head_revision()
    assert "head" in capsys.readouterr().out


def test_cli_upgrade_reports_failure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = "postgresql://nobody@127.0.0.1:1/nowhere"  # nothing listens on port 1
    assert cli_upgrade(argparse.Namespace(database_url=bad)) == 1
    assert "switchyard db upgrade: failed" in capsys.readouterr().err


def test_switchyard_db_upgrade_from_another_cwd(tmp_path: Path) -> None:
    """The real console entry point, run from a directory with no alembic.ini or migrations/."""
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    env = {**os.environ, "SWITCHYARD_MIGRATIONS_DIR": ""}
    script = Path(sys.executable).parent / "switchyard"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "gateway.cli"]
    proc = subprocess.run([*cmd, "db", "upgrade", "--database-url", url],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert db.current_revision(url) == db.head_revision()


def test_a_migrated_sqlite_file_is_already_in_wal_mode(tmp_path):
    """CI: a ledger writer's start-up probe failed on a fresh SQLite file (a false outage that sent a test's rows
    to the spool): the gateway's writers each switched the file to WAL as they first connected, a switch that
    needs the file to itself. Migrating now leaves the file in WAL mode, before any writer opens it."""
    import sqlite3

    from gateway import db

    path = tmp_path / "ledger.db"
    db.upgrade(f"sqlite:///{path}")
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        conn.close()
