"""Throwaway PostgreSQL databases for tests and benchmarks: one freshly created database (session time zone
UTC) on the server named by $SWITCHYARD_TEST_PG_URL, dropped afterwards."""
from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator

from sqlalchemy.engine import make_url

PG_BASE_URL = os.environ.get("SWITCHYARD_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")


def conninfo(database: str | None = None) -> str:
    """A plain postgresql:// URL for the server, optionally naming another database on it."""
    url = make_url(PG_BASE_URL)
    if database:
        url = url.set(database=database)
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


@contextlib.contextmanager
def fresh_database(prefix: str = "sy_test") -> Iterator[str]:
    """The URL of a new, empty database `PREFIX_<random>`; dropped (connections forced off) on exit."""
    import psycopg

    name = f"{prefix}_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(conninfo(), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
        conn.execute(f"ALTER DATABASE \"{name}\" SET timezone TO 'UTC'")
    try:
        yield conninfo(name)
    finally:
        with psycopg.connect(conninfo(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
