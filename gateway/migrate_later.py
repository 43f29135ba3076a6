"""Migrate the ledger database once it answers: `switchyard serve` starts while the database is down (keys
from the cache or the master key, rows to the spool), and this background task brings the schema to head when
the database is back; the ledger writer then replays its spool on its own (it retries with backoff too).

Each attempt runs Alembic in a daemon thread: a shutdown never waits for a connection attempt to time out.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from gateway import db

log = logging.getLogger("switchyard.db")


async def migrate_when_reachable(url: str, *, initial_s: float = 0.5, max_s: float = 10.0,
                                 upgrade: Callable[[str], Any] = db.upgrade,
                                 then: Callable[[], Awaitable[Any]] | None = None) -> None:
    """Retry `upgrade(url)` with exponential backoff until it succeeds (cancel to stop); then run `then` (what
    start-up skipped for want of the database, e.g. the first admin key), retried the same way while the
    database is unreachable again."""
    await _migrate(url, initial_s, max_s, upgrade)
    if then is not None:
        await _retry_while_unreachable(then, url, initial_s, max_s)


async def _retry_while_unreachable(fn: Callable[[], Awaitable[Any]], url: str, initial_s: float,
                                   max_s: float) -> None:
    delay = initial_s
    while True:
        try:
            await fn()
            return
        except Exception as exc:  # noqa: BLE001 - unreachable: retried; anything else: logged once, given up
            if not db.is_unreachable(exc):
                log.error("after migrating %s: %s", db.redact_url(url), _one_line(exc))
                return
        await asyncio.sleep(delay)
        delay = min(delay * 2, max_s)


async def _migrate(url: str, initial_s: float, max_s: float, upgrade: Callable[[str], Any]) -> None:
    delay, attempts = initial_s, 0
    while True:
        attempts += 1
        try:
            await _in_daemon_thread(upgrade, url)
        except Exception as exc:  # noqa: BLE001 - unreachable: retried; anything else: logged, retried slower
            if not db.is_unreachable(exc):
                log.error("migrating %s failed (attempt %d, retrying in %.0f s): %s", db.redact_url(url), attempts,
                          max_s, _one_line(exc))
                delay = max_s
        else:
            log.warning("database %s reachable: schema migrated to head after %d attempt(s); spooled ledger rows "
                        "replay now", db.redact_url(url), attempts)
            return
        await asyncio.sleep(delay)
        delay = min(delay * 2, max_s)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


async def _in_daemon_thread(fn: Callable[[str], Any], arg: str) -> Any:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, exc: BaseException | None) -> None:
        if done.done():
            return  # cancelled meanwhile
        if exc is not None:
            done.set_exception(exc)
        else:
            done.set_result(result)

    def run() -> None:
        try:
            result, error = fn(arg), None
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is waiting any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, daemon=True, name="db-migrate-later").start()
    return await done
