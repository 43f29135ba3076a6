"""Background task plumbing shared by the gateway's watchers (policy file, difficulty models, engine load)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("switchyard.tasks")


async def poll_forever(check: Callable[[], Awaitable[object]], interval_s: float, what: str) -> None:
    """Run `check` every interval_s seconds until cancelled; an error is logged and the next round still runs."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await check()
        except Exception:
            log.exception("%s error", what)


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel a background task (None: nothing) and wait until it has stopped."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
