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
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import pytest
from sqlalchemy.engine import make_url

from gateway.testing import postgres


@cache
def _pg_unreachable_reason() -> str | None:
    try:
        import psycopg

        with psycopg.connect(postgres.conninfo(), connect_timeout=3):
            return None
    except Exception as exc:  # noqa: BLE001 - any failure means unreachable
        return f"PostgreSQL at {make_url(postgres.PG_BASE_URL).render_as_string()} unreachable: {exc}"


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
    with postgres.fresh_database("sy_test") as url:
        yield url


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


@pytest.fixture
def kernel_switches():
    """`configure(**switches)` for the process's kernel switches (kernels/switches.py: backend, native kernels,
    AMX, -march, packed weights, the native decode step), restored after the test. Tests pass a mode this way,
    not through the environment (read once per process)."""
    from kernels import switches

    with switches.using():
        yield switches.configure
