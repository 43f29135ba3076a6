"""Reading an untrusted upstream answer within bounds: a size cap enforced while reading, and SSE that is SSE.

Both backends use `SSELines` (a bounded SSE line splitter) and `AnswerRejected` (what a bad answer raises
before it becomes an UpstreamError of kind "malformed" or "too_large"). litellm's HTTP goes through
`GuardedTransport`, an httpx transport wrapping litellm's own, which applies the limits the calling backend
put in `ANSWER_LIMITS` for the duration of its call: nothing past the cap is ever buffered.
"""
from __future__ import annotations

import asyncio
import contextvars
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx

# The lines an SSE stream may carry (https://html.spec.whatwg.org/multipage/server-sent-events.html):
# fields, comments (":" keep-alives) and blank lines between events.
_SSE_FIELDS = (b"data:", b"event:", b"id:", b"retry:", b":")


class AnswerRejected(Exception):
    """An upstream answer refused while it was read: kind "malformed" or "too_large"."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def too_large(what: str, limit: int) -> AnswerRejected:
    return AnswerRejected("too_large", f"{what} is larger than the backend's cap of {limit} bytes")


class SSELines:
    """Splits SSE bytes into lines as they arrive, bounded: a line (one event's data) past `max_line`, or
    more than `max_total` bytes in all, raises AnswerRejected("too_large") before more is buffered; a line
    that is not an SSE field raises AnswerRejected("malformed")."""

    __slots__ = ("_pending", "_pending_len", "max_line", "max_total", "total")

    def __init__(self, max_line: int, max_total: int):
        self.max_line, self.max_total = max_line, max_total
        self._pending: list[bytes] = []  # the start of a line whose end has not arrived
        self._pending_len = 0
        self.total = 0

    def feed(self, data: bytes) -> list[bytes]:
        """The complete lines (without their line ending) that `data` finishes."""
        self.total += len(data)
        if self.total > self.max_total:
            raise too_large("the stream", self.max_total)
        if b"\n" not in data:  # no copy of what is pending until its line ends
            self._pending_len += len(data)
            if self._pending_len > self.max_line:
                raise too_large("an SSE event", self.max_line)
            self._pending.append(data)
            return []
        if self._pending:
            data = b"".join(self._pending) + data
            self._pending.clear()
        lines = data.split(b"\n")
        rest = lines.pop()
        self._pending_len = len(rest)
        if rest:
            self._pending.append(rest)
        for line in lines:
            check_line(line, self.max_line)
        if self._pending_len > self.max_line:
            raise too_large("an SSE event", self.max_line)
        return lines

    def end(self) -> bytes:
        """What is left at the end of the body (a last line without its line ending)."""
        rest = b"".join(self._pending)
        self._pending.clear()
        self._pending_len = 0
        check_line(rest, self.max_line)
        return rest


def check_line(line: bytes, max_line: int) -> None:
    if len(line) > max_line:
        raise too_large("an SSE event", max_line)
    stripped = line.strip()
    if stripped and not stripped.startswith(_SSE_FIELDS):
        raise AnswerRejected("malformed", f"the stream is not SSE (a line starts {stripped[:24]!r})")


def is_event_stream(content_type: str | None) -> bool:
    return bool(content_type) and content_type.split(";", 1)[0].strip().lower() == "text/event-stream"


# ---------------------------------------------------------------- litellm's HTTP


@dataclass(slots=True)
class AnswerLimits:
    """One backend call's limits, and what its HTTP exchange saw (set by the transport)."""

    max_bytes: int
    max_stream_bytes: int
    stream: bool  # a stream was asked for: a 2xx answer must be text/event-stream
    status: int | None = None  # the last answer's status


ANSWER_LIMITS: contextvars.ContextVar[AnswerLimits | None] = contextvars.ContextVar("answer_limits", default=None)


class GuardedTransport(httpx.AsyncBaseTransport):
    """Applies the calling backend's ANSWER_LIMITS to each answer read through the inner transport; calls
    made without limits (none set) pass through unchanged. One inner transport per event loop (its
    connection pool belongs to that loop; litellm's clients are shared process-wide)."""

    def __init__(self, make_inner: Callable[[], httpx.AsyncBaseTransport]):
        self._make_inner = make_inner
        self._inners: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncBaseTransport] = \
            weakref.WeakKeyDictionary()

    def _inner(self) -> httpx.AsyncBaseTransport:
        loop = asyncio.get_running_loop()
        inner = self._inners.get(loop)
        if inner is None:
            inner = self._inners[loop] = self._make_inner()
        return inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._inner().handle_async_request(request)
        limits = ANSWER_LIMITS.get()
        if limits is None:
            return response
        limits.status = response.status_code
        try:
            declared = response.headers.get("content-length")
            sse = is_event_stream(response.headers.get("content-type"))
            if declared is not None and declared.isdigit() and int(declared) > limits.max_bytes:
                raise too_large("the answer", limits.max_bytes)
            if limits.stream and 200 <= response.status_code < 300 and not sse:
                raise AnswerRejected("malformed", "a stream was asked for and the answer is not text/event-stream "
                                                  f"({response.headers.get('content-type')!r})")
        except AnswerRejected:
            await response.aclose()
            raise
        response.stream = _GuardedStream(response.stream, limits, sse and 200 <= response.status_code < 300)
        return response

    async def aclose(self) -> None:
        """Close this event loop's connections (the gateway's shutdown)."""
        inner = self._inners.pop(asyncio.get_running_loop(), None)
        if inner is not None:
            await inner.aclose()


class _GuardedStream(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, limits: AnswerLimits, sse: bool):
        self._inner = inner
        self._max = limits.max_bytes
        self._lines = SSELines(limits.max_bytes, limits.max_stream_bytes) if sse else None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        total = 0
        async for chunk in self._inner:
            if self._lines is not None:
                self._lines.feed(chunk)
            else:
                total += len(chunk)
                if total > self._max:
                    raise too_large("the answer", self._max)
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


def guarded_client() -> httpx.AsyncClient:
    """An httpx client for litellm (litellm.aclient_session) over litellm's own transport, guarded."""
    from litellm.llms.custom_httpx.http_handler import AsyncHTTPHandler

    def make_inner() -> httpx.AsyncBaseTransport:
        return AsyncHTTPHandler.create_async_transport() or httpx.AsyncHTTPTransport()

    return httpx.AsyncClient(transport=GuardedTransport(make_inner), follow_redirects=True)
