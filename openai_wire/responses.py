"""Starlette glue for the OpenAI wire: an error response, and an SSE response that always cleans up."""
from __future__ import annotations

import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel
from starlette.responses import JSONResponse, StreamingResponse

from openai_wire import APIError


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


_YIELD_EVERY_S = 0.002
_YIELD_EVERY_EVENTS = 4


class EventStreamResponse(StreamingResponse):
    """An SSE response that runs `on_end` exactly once however it ends: after a normal end, after a send to
    a client that has gone away (ASGI 2.4 servers raise instead of reporting a disconnect), or when the body
    never started. The body iterator is closed first, so its own `finally` runs before `on_end`."""

    def __init__(self, content: AsyncIterator[Any], on_end: Callable[[], Awaitable[None] | None],
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self._on_end = on_end

    async def stream_response(self, send: Any) -> None:
        """Starlette's, yielding to the event loop every _YIELD_EVERY_S or _YIELD_EVERY_EVENTS events, whichever
        comes first: when the upstream's chunks are already buffered, reading and sending them never suspends, so
        without it one relay holds the loop for a whole backlog, the loop never learns that its client left, the
        disconnect watcher never runs, and every other request waits. The event bound keeps the sends after a
        lost connection below asyncio's threshold (5) for logging "socket.send() raised exception" on a busy
        machine, where a few milliseconds hold many events."""
        clock = time.monotonic
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        due, unyielded = clock() + _YIELD_EVERY_S, 0
        async for chunk in self.body_iterator:
            await send({"type": "http.response.body", "body": chunk if isinstance(chunk, bytes | memoryview)
                        else chunk.encode(self.charset), "more_body": True})
            unyielded += 1
            # a stream that suspends on its own (the engine's, paced by decoding) pays a clock read per event
            if unyielded >= _YIELD_EVERY_EVENTS or clock() >= due:
                await anyio.lowlevel.checkpoint()
                due, unyielded = clock() + _YIELD_EVERY_S, 0
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
                result = self._on_end()
                if inspect.isawaitable(result):
                    await result
