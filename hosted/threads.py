"""Running the engine's heavy work on threads that suit OpenMP.

libgomp keeps a pool of worker threads for each thread that starts a parallel region (torch's CPU ops and
kernels/cpu_native.c both do), for as long as that thread lives. When the pools' threads outnumber the cores,
libgomp stops spinning between regions in every pool and parks its workers instead, and each of a decode
step's hundreds of short regions then pays a wake-up: the engine thread decoded at 45 tok/s instead of 82
(SmolLM2 int8, batch 1, 2 cores) after the model had been loaded on a long-lived asyncio executor thread.
So the load runs on a thread of its own that ends with it (taking its pool along), and the engine thread sets
its own OpenMP thread count (a per-thread setting) to what torch was given. (The native decode step has since
moved to barriers of its own, kernels/cpu_team.c, that never sleep; prefill and mixed steps, a region per op,
still depend on this.)
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


async def in_fresh_thread(fn: Callable[[], T], name: str = "switchyard-worker") -> T:
    """fn() on a new thread that exits when fn returns; awaitable from the event loop."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: object, exc: BaseException | None) -> None:
        if done.done():
            return
        if exc is not None:
            done.set_exception(exc)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def target() -> None:
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=target, name=name, daemon=True).start()
    return await done
