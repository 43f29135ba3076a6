"""Database plumbing: URL normalisation, the async engine, and schema upgrades via Alembic.

Users give plain URLs (`sqlite:///data/x.db`, `postgresql://u@h/db`); the gateway talks to them
through async drivers (aiosqlite, asyncpg) while Alembic uses sync ones (sqlite3, psycopg).
Migrations are the only way the schema is created.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

# migrations/ is a top-level directory of the repository, next to gateway/, not a package.
# An editable install (`pip install -e .`) resolves gateway/ to the checkout, so the sibling
# directory is found; other layouts point SWITCHYARD_MIGRATIONS_DIR at a copy of migrations/.
MIGRATIONS_ENV = "SWITCHYARD_MIGRATIONS_DIR"
SQLITE_BUSY_TIMEOUT_MS = 10_000


def _split_scheme(url: str) -> tuple[str, str]:
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"not a database URL (expected scheme://…): {url!r}")
    return scheme.lower(), rest


def async_url(url: str) -> str:
    """The same database, addressed through an async driver; URLs naming a driver pass through."""
    scheme, rest = _split_scheme(url)
    dialect, plus, driver = scheme.partition("+")
    if dialect == "postgres":  # Heroku-style alias SQLAlchemy no longer accepts
        dialect = "postgresql"
    if plus:
        return f"{dialect}+{driver}://{rest}"
    if dialect == "sqlite":
        return f"sqlite+aiosqlite://{rest}"
    if dialect == "postgresql":
        return f"postgresql+asyncpg://{rest}"
    return url


def sync_url(url: str) -> str:
    """The same database through a sync driver, for Alembic: sqlite3 or psycopg (v3)."""
    scheme, rest = _split_scheme(url)
    dialect = scheme.partition("+")[0]
    if dialect == "sqlite":
        return f"sqlite://{rest}"
    if dialect in ("postgresql", "postgres"):
        return f"postgresql+psycopg://{rest}"
    return url


def is_sqlite(url: str) -> bool:
    return _split_scheme(url)[0].startswith("sqlite")


def ensure_sqlite_dir(url: str) -> None:
    """Create the parent directory of a SQLite file (no-op for memory DBs and other dialects)."""
    if not is_sqlite(url):
        return
    database = make_url(url).database
    if database and database != ":memory:" and not database.startswith("file:"):
        Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)


def sqlite_file_missing(url: str) -> bool:
    """Whether the URL names a SQLite file that does not exist (memory databases, other dialects and URLs that do
    not parse: False). Readers check first: connecting would leave an empty file behind."""
    try:
        if not is_sqlite(url):
            return False
        database = make_url(url).database
    except Exception:  # noqa: BLE001 - a malformed URL: let the open report it
        return False
    if not database or database == ":memory:" or database.startswith("file:"):
        return False
    return not Path(database).expanduser().exists()


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # WAL lets the batch writer and readers (keys, reports, dashboard) work at the same time;
    # the busy timeout makes a second writer wait instead of failing with "database is locked".
    cur = dbapi_connection.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


def create_engine(url: str, **kwargs: Any) -> AsyncEngine:
    """An AsyncEngine for a plain or async URL. Extra kwargs go to `create_async_engine`."""
    aurl = async_url(url)
    options: dict[str, Any] = {"pool_pre_ping": True}
    if is_sqlite(aurl):
        ensure_sqlite_dir(aurl)
        connect_args = {"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000}
    elif aurl.startswith("postgresql+asyncpg"):
        # Fail fast when the server is unreachable rather than asyncpg's 60 s default.
        connect_args = {"timeout": 10}
    else:
        connect_args = {}
    connect_args.update(kwargs.pop("connect_args", {}))
    options["connect_args"] = connect_args
    options.update(kwargs)
    engine = create_async_engine(aurl, **options)
    if is_sqlite(aurl):
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
    return engine


def migrations_dir() -> Path:
    """Locate migrations/: $SWITCHYARD_MIGRATIONS_DIR, else the repository checkout next to gateway/."""
    override = os.environ.get(MIGRATIONS_ENV)
    candidates = [Path(override)] if override else []
    candidates.append(Path(__file__).resolve().parent.parent / "migrations")
    for path in candidates:
        if (path / "env.py").is_file():
            return path
    tried = ", ".join(str(p) for p in candidates)
    raise FileNotFoundError(
        f"Alembic migrations not found (tried {tried}). Install switchyard from a checkout "
        f"(`pip install -e .`) or set {MIGRATIONS_ENV} to the repository's migrations/ directory."
    )


def alembic_config(url: str):  # -> alembic.config.Config (imported lazily: only upgrades need it)
    """An Alembic Config built in code: no alembic.ini, works from any working directory."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    # Passed as an attribute, not an ini option: ini values go through %-interpolation, which
    # would mangle URL-encoded passwords.
    cfg.attributes["database_url"] = _with_connect_timeout(sync_url(url))
    return cfg


PG_CONNECT_TIMEOUT_S = 10  # libpq waits forever for a host that drops packets; a migration at start must not


def _with_connect_timeout(url: str) -> str:
    """A PostgreSQL URL with libpq's connect_timeout set, unless the URL sets its own."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "postgresql" or "connect_timeout" in parsed.query:
        return url
    return parsed.update_query_dict({"connect_timeout": str(PG_CONNECT_TIMEOUT_S)}).render_as_string(
        hide_password=False)


def is_unreachable(exc: BaseException) -> bool:
    """True when `exc` says the database cannot be reached (down, refusing, timing out, not there yet), as
    opposed to a fault of the statement or of the migrations themselves."""
    from sqlalchemy import exc as sa_exc

    if isinstance(exc, (OSError, TimeoutError, sa_exc.OperationalError, sa_exc.InterfaceError)):
        return True
    return isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated


def upgrade(url: str, revision: str = "head") -> None:
    """Apply migrations up to `revision`. Idempotent; safe to call at every start."""
    from alembic import command

    ensure_sqlite_dir(url)
    command.upgrade(alembic_config(url), revision)
    if is_sqlite(url):
        _set_wal(url)


def _set_wal(url: str) -> None:
    """Put a SQLite file in WAL mode once, here, before the gateway's writers open it: WAL is kept in the file,
    and several writers connecting at start-up would otherwise each try to switch the journal mode, which needs
    the file to themselves (under load one could fail with "database is locked": a false ledger outage)."""
    import sqlite3

    database = make_url(sync_url(url)).database
    if not database or database == ":memory:" or database.startswith("file:"):
        return
    conn = sqlite3.connect(database, timeout=SQLITE_BUSY_TIMEOUT_MS / 1000)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
    finally:
        conn.close()


def current_revision(url: str) -> str | None:
    """The revision the database is at (None if never migrated)."""
    from alembic.runtime.migration import MigrationContext
    from sqlalchemy import create_engine as create_sync_engine

    engine = create_sync_engine(sync_url(url))
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def head_revision() -> str | None:
    from alembic.script import ScriptDirectory

    return ScriptDirectory(str(migrations_dir())).get_current_head()


def redact_url(url: str) -> str:
    """The URL for display: its password hidden."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - only for display
        return "<database url>"
