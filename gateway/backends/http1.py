"""A small keep-alive HTTP/1.1 client for the engine backend's plain (non-streamed) JSON POSTs.

Why our own: on the request path aiohttp's client cost ~230-260 us of CPU per request on the 2-core development
machine (request and response objects, its connector, timers, tracing hooks), against ~50-65 us for a client that
writes one request and reads one response off a pooled asyncio stream (measured in the same run, against the
same stand-in engine). That difference was the largest single part of the gateway's overhead on engine routes.
It does only what an engine's answer needs: Content-Length, chunked and read-to-close bodies, keep-alive, TLS for
https bases, a total deadline, a cap on the bytes read (the answer guard's), a cap on error bodies. Streams keep
using aiohttp (gateway/backends/engine_backend.py), where its SSE reading earns its cost.

Errors: `ConnectFailed` (could not connect: the request was never sent), `TimeoutError` (the deadline passed),
`ProtocolError` / `OSError` (the connection broke or spoke something that is not HTTP/1.x), and the guard's
AnswerRejected when the answer is larger than the cap. A request on a reused keep-alive connection that the
server had already closed (no byte of an answer came back) is sent once more on a fresh connection: what every
HTTP client does for idle connections, as the server never saw the first.
"""
from __future__ import annotations

import asyncio
import ssl
from urllib.parse import urlsplit

from gateway.backends.guard import too_large

_MAX_HEAD = 64 * 1024  # status line and headers
_Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class ConnectFailed(OSError):
    """The connection could not be made (refused, unreachable, or not within the connect timeout)."""


class ProtocolError(OSError):
    """The peer's answer is not HTTP/1.x as we read it."""


class _Stale(Exception):
    """A reused connection was closed by the peer before any byte of the answer: safe to send again."""


class Http1Pool:
    """Keep-alive connections to one origin (scheme://host:port), at most `limit` in use at a time."""

    def __init__(self, base_url: str, limit: int, connect_timeout_s: float) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.host = parts.hostname
        self.tls = parts.scheme == "https"
        self.port = parts.port or (443 if self.tls else 80)
        self.prefix = parts.path.rstrip("/")
        self._host_header = parts.netloc.rsplit("@", 1)[-1]
        self.limit = max(1, limit)
        self.connect_timeout_s = connect_timeout_s
        self._idle: list[_Conn] = []
        self._slots: asyncio.Semaphore | None = None
        self._ssl: ssl.SSLContext | None = ssl.create_default_context() if self.tls else None

    def head(self, path: str, headers: dict[str, str]) -> bytes:
        """The request head for POSTs to `path` (under the base URL's path) with these headers, less the
        Content-Length that each request adds: built once per endpoint by the caller."""
        lines = [f"POST {self.prefix}{path} HTTP/1.1", f"host: {self._host_header}",
                 *(f"{k}: {v}" for k, v in headers.items())]
        return ("\r\n".join(lines) + "\r\ncontent-length: ").encode("latin-1")

    async def post(self, head: bytes, body: bytes, *, timeout_s: float, max_bytes: int,
                   error_bytes: int) -> tuple[int, dict[str, str], bytes]:
        """(status, lower-cased headers, body). A 2xx-3xx body past `max_bytes` is AnswerRejected("too_large");
        of a 4xx/5xx body only the first `error_bytes` are kept (the rest goes with the connection)."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.limit)
        request = b"".join((head, str(len(body)).encode(), b"\r\n\r\n", body))
        async with self._slots, asyncio.timeout(timeout_s):
            while self._idle:
                conn = self._idle.pop()
                if conn[0].at_eof() or conn[1].is_closing():
                    _close(conn)
                    continue
                try:
                    return await self._exchange(conn, request, max_bytes, error_bytes, reused=True)
                except _Stale:
                    continue  # the next idle one, or a fresh connection
            return await self._exchange(await self._connect(), request, max_bytes, error_bytes, reused=False)

    async def _connect(self) -> _Conn:
        try:
            return await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port, ssl=self._ssl, limit=_MAX_HEAD,
                                        server_hostname=self.host if self.tls else None),
                self.connect_timeout_s)
        except TimeoutError as exc:
            raise ConnectFailed(f"no connection to {self.host}:{self.port} within {self.connect_timeout_s:g} s") \
                from exc
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: {exc}") from exc

    async def _exchange(self, conn: _Conn, request: bytes, max_bytes: int, error_bytes: int, *,
                        reused: bool) -> tuple[int, dict[str, str], bytes]:
        reader, writer = conn
        keep = False
        try:
            try:
                writer.write(request)
                await writer.drain()
                head = await reader.readuntil(b"\r\n\r\n")
            except (ConnectionError, asyncio.IncompleteReadError) as exc:
                if getattr(exc, "partial", b""):
                    raise ProtocolError("the connection closed in the middle of the answer's head") from exc
                if reused:
                    raise _Stale from exc
                raise ProtocolError("the server closed the connection without an answer") from exc
            status, headers = _parse_head(head)
            while 100 <= status < 200:  # interim answers (we send no Expect, but a server may)
                head = await reader.readuntil(b"\r\n\r\n")
                status, headers = _parse_head(head)
            cap = error_bytes if status >= 400 else max_bytes
            body, complete = await _read_body(reader, headers, cap, status >= 400)
            keep = complete and headers.get("connection", "").lower() != "close" and not head.startswith(b"HTTP/1.0")
            return status, headers, body
        except asyncio.LimitOverrunError as exc:
            raise ProtocolError("the answer's head is too long") from exc
        except asyncio.IncompleteReadError as exc:
            raise ProtocolError("the connection closed in the middle of the answer") from exc
        finally:
            if keep:
                self._idle.append(conn)
            else:
                _close(conn)

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            _close(conn)


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    """(status, lower-cased headers) of a status line and header block ending in a blank line."""
    status_line, _, block = head.partition(b"\r\n")
    if not status_line.startswith(b"HTTP/1.") or len(status_line) < 12 or not status_line[9:12].isdigit():
        raise ProtocolError(f"not an HTTP/1.x status line: {status_line[:60]!r}")
    headers: dict[str, str] = {}
    for raw in block.split(b"\r\n"):
        if not raw:
            continue
        name, sep, value = raw.partition(b":")
        if not sep:
            raise ProtocolError(f"a header line without a colon: {raw[:60]!r}")
        headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    return int(status_line[9:12]), headers


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str], cap: int,
                     truncate: bool) -> tuple[bytes, bool]:
    """(body, read to its end?). Past `cap`: AnswerRejected, or with `truncate` the first `cap` bytes."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        parts: list[bytes] = []
        size = 0
        while True:
            size_line = await reader.readuntil(b"\r\n")
            try:
                n = int(size_line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise ProtocolError(f"a bad chunk size line: {size_line[:40]!r}") from None
            if n == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers, then the blank line
                    pass
                return b"".join(parts), True
            if size + n > cap:
                if truncate:
                    parts.append(await reader.readexactly(max(0, cap - size)))
                    return b"".join(parts), False
                raise too_large("the answer", cap)
            parts.append(await reader.readexactly(n))
            size += n
            await reader.readexactly(2)
    length = headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise ProtocolError(f"a bad Content-Length: {length[:40]!r}")
        n = int(length)
        if n > cap:
            if truncate:
                return await reader.readexactly(cap), False
            raise too_large("the answer", cap)
        return await reader.readexactly(n), True
    # No length: the body runs to the connection's end.
    data = await reader.read(cap + 1)
    parts = [data]
    size = len(data)
    while data and size <= cap:
        data = await reader.read(cap + 1 - size)
        parts.append(data)
        size += len(data)
    if size > cap:
        if truncate:
            return b"".join(parts)[:cap], False
        raise too_large("the answer", cap)
    return b"".join(parts), False


def _close(conn: _Conn) -> None:
    conn[1].close()
