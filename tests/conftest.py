"""Shared database fixtures for every test package.

- `sqlite_url`: a fresh SQLite file URL in tmp_path (file not created yet).
- `pg_url`: a fresh, uniquely named PostgreSQL database (time zone UTC) on the server named by
  $SWITCHYARD_TEST_PG_URL (default postgresql://postgres@127.0.0.1:5432/test), dropped after the test.
  Skips when Postgres is unreachable and $CI is unset; fails when it is unreachable on CI.
- `db_url`: parametrized over both ("sqlite", "postgresql").
- `migrated_db_url`: `db_url` with the ledger migrations applied.

URLs are plain (`sqlite:///…`, `postgresql://…`); gateway.db picks async/sync drivers.
"""
from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import pytest
from sqlalchemy.engine import make_url

PG_BASE_URL = os.environ.get("SWITCHYARD_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")


def _pg_conninfo(database: str | None = None) -> str:
    url = make_url(PG_BASE_URL)
    if database:
        url = url.set(database=database)
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


@cache
def _pg_unreachable_reason() -> str | None:
    try:
        import psycopg

        with psycopg.connect(_pg_conninfo(), connect_timeout=3):
            return None
    except Exception as exc:  # noqa: BLE001 - any failure means unreachable
        return f"PostgreSQL at {make_url(PG_BASE_URL).render_as_string()} unreachable: {exc}"


def require_postgres() -> None:
    """Skip (locally) or fail (with CI set) when PostgreSQL is unreachable."""
    reason = _pg_unreachable_reason()
    if reason is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set: PostgreSQL tests must run)")
    pytest.skip(reason)


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'switchyard-test.db'}"


@contextmanager
def fresh_pg_database() -> Iterator[str]:
    """A new, empty PostgreSQL database (session time zone UTC), dropped afterwards; skips without a server."""
    require_postgres()
    import psycopg

    name = f"sy_test_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(_pg_conninfo(), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
        conn.execute(f"ALTER DATABASE \"{name}\" SET timezone TO 'UTC'")
    try:
        yield _pg_conninfo(name)
    finally:
        with psycopg.connect(_pg_conninfo(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def pg_url() -> Iterator[str]:
    with fresh_pg_database() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request) -> str:
    return request.getfixturevalue(f"{'pg' if request.param == 'postgresql' else 'sqlite'}_url")


@pytest.fixture
def migrated_db_url(db_url: str) -> str:
    from gateway.db import upgrade

    upgrade(db_url)
    return db_url
