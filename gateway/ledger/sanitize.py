"""Make ledger rows storable: nothing a client or an upstream sends may make the database refuse a row.

PostgreSQL refuses a NUL character in text; no UTF-8 driver can encode a lone surrogate (JSON carries one as
"\\ud800"); a string longer than its VARCHAR column and an integer beyond INTEGER are refused too. The writer
passes every row of every table it writes (requests, shadow_evals, engine_uptime) through `safe_rows` just
before the INSERT, so the column widths come from one place: the SQLAlchemy models.

Cleaning is visible, not silent: a NUL or a lone surrogate becomes U+FFFD, a valid surrogate pair is joined
into its character, and each change is counted (switchyard_ledger_values_cleaned) and logged (rate-limited).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import time
from typing import Any

from prometheus_client import Counter
from sqlalchemy import BigInteger, Integer, String, Table

log = logging.getLogger("switchyard.ledger")

VALUES_CLEANED = Counter("switchyard_ledger_values_cleaned",
                         "Ledger values changed so the database can store them",
                         ["kind"])  # kind: invalid_char | truncated | clamped
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
_LOG_EVERY_S = 60.0
_last_log = [float("-inf")]


@functools.cache
def _plan(table: Table) -> tuple[tuple[tuple[str, int | None], ...], frozenset[str]]:
    """Per table, once: string columns -> their length (None: unbounded TEXT); INTEGER columns to clamp."""
    strings: dict[str, int | None] = {}
    ints: set[str] = set()
    for col in table.columns:
        if isinstance(col.type, String):  # Text is a String without a length
            strings[col.name] = col.type.length
        elif isinstance(col.type, Integer) and not isinstance(col.type, BigInteger):
            ints.add(col.name)
    return tuple(strings.items()), frozenset(ints)


def _has_surrogate(value: str) -> bool:
    if value.isascii():
        return False
    try:  # C speed; a regex over the surrogate range costs ~8 ns a character
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def clean_text(value: str) -> str:
    """NUL and lone surrogates -> U+FFFD; a surrogate pair (a str built from UTF-16 halves) -> its character."""
    surrogate = _has_surrogate(value)
    if "\x00" not in value and not surrogate:
        return value
    value = value.replace("\x00", "\ufffd")
    if surrogate:
        value = value.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
    return value


def _cut(value: str, length: int, is_key: bool) -> str:
    if not is_key:
        return value[:length]
    # A unique key cut short could collide with another row's (ON CONFLICT would drop that row): keep a
    # digest of the whole value, so the key stays unique and a replay of the same row finds the same key.
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return value[:length - 17] + "~" + digest


def safe_rows(table: Table, rows: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """`rows` with every value the database would refuse made storable (rows needing no change are returned as is)."""
    strings, ints = _plan(table)
    out = []
    for row in rows:
        changed: dict[str, Any] = {}
        for name, length in strings:
            value = row.get(name)
            if value.__class__ is not str:
                continue
            if value.isascii() and "\x00" not in value and (length is None or len(value) <= length):
                continue  # the common case, at C speed
            new = clean_text(value)
            if new is not value:
                VALUES_CLEANED.labels("invalid_char").inc()
            if length is not None and len(new) > length:
                new = _cut(new, length, name == key)
                VALUES_CLEANED.labels("truncated").inc()
            if new is not value:
                changed[name] = new
        for name in ints:
            value = row.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and not INT32_MIN <= value <= INT32_MAX:
                changed[name] = max(INT32_MIN, min(INT32_MAX, value))
                VALUES_CLEANED.labels("clamped").inc()
        if changed:
            _log_cleaned(table.name, row.get(key), sorted(changed))
            row = {**row, **changed}
        out.append(row)
    return out


def _log_cleaned(table: str, key: Any, columns: list[str]) -> None:
    """One WARNING a minute at most: a client sending NULs on every request must not flood the log."""
    now = time.monotonic()
    if now - _last_log[0] >= _LOG_EVERY_S:
        _last_log[0] = now
        log.warning("ledger: %s row %r had values the database cannot store (%s); cleaned before the insert "
                    "(switchyard_ledger_values_cleaned counts every one)", table, clean_text(str(key))[:80],
                    ", ".join(columns))
