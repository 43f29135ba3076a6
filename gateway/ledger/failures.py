"""Whose fault is a failed INSERT: the rows' (retrying them cannot help: quarantine them) or the database's
(spool the rows and retry later)?

SQLAlchemy does not translate asyncpg's errors by kind: a NUL in a string (SQLSTATE 22021), a value too long
for its column (22001), a lone surrogate the driver cannot encode (asyncpg's client-side DataError, 22000)
and an integrity violation all arrive as a plain `DBAPIError`, like a dropped connection. So the SQLSTATE of
the driver's error decides; an error without one is the rows' fault only when it is a value the driver or
SQLAlchemy could not convert (a ValueError / TypeError before anything reached the server).
"""
from __future__ import annotations

from collections.abc import Iterator

from sqlalchemy import exc as sa_exc

# SQLSTATE classes caused by the values sent: 22 data exception, 23 integrity constraint violation.
# Everything else (08 connection, 40 rollback, 42 missing table, 53 disk full, 57 shutdown, …) is an outage.
ROW_SQLSTATE_CLASSES = frozenset({"22", "23"})


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """The exception, the driver error SQLAlchemy wraps, and their causes and contexts (each once)."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        orig = getattr(e, "orig", None)
        stack += [e.__context__, e.__cause__, orig if isinstance(orig, BaseException) else None]


def _sqlstate(exc: BaseException) -> str | None:
    for attr in ("sqlstate", "pgcode"):  # asyncpg / psycopg; SQLAlchemy's asyncpg adapter
        state = getattr(exc, attr, None)
        if isinstance(state, str) and len(state) == 5:
            return state
    return None


def is_row_error(exc: BaseException) -> bool:
    """True when the rows themselves are at fault, so retrying the same rows cannot succeed."""
    if isinstance(exc, (sa_exc.DataError, sa_exc.IntegrityError)):
        return True
    if isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated:
        return False
    chain = list(_chain(exc))
    for e in chain:
        state = _sqlstate(e)
        if state is not None:
            return state[:2] in ROW_SQLSTATE_CLASSES
    if any(isinstance(e, OSError) for e in chain):
        return False
    # Raised before the server saw anything: a bind parameter SQLAlchemy could not process (StatementError
    # that is not a DBAPIError), or a value the driver could not encode (UnicodeEncodeError on SQLite).
    if isinstance(exc, sa_exc.StatementError) and not isinstance(exc, sa_exc.DBAPIError):
        return True
    return any(isinstance(e, (ValueError, TypeError, OverflowError)) for e in chain)
