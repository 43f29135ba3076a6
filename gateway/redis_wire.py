"""The hot path's Redis connection: one socket, commands pipelined as they come, replies matched in order.

redis-py's asyncio client takes a pooled connection per command and parses replies in Python layers (~150-250 us a
round trip on a shared 2-core machine); a request's admission is one EVALSHA, so the gateway writes it on one
long-lived socket and waits for its reply (~40 us). Concurrent requests share the socket: their commands go out
back to back (pipelined, in the order written) and each reply resolves the oldest waiting command (Redis answers
a connection's commands in order). A command that times out keeps its place in that order: its late reply is read
and dropped.

Errors are redis-py's classes (ConnectionError, TimeoutError, ResponseError, NoScriptError), so callers tell a
Redis outage from a refusal as they do for redis-py. URLs: redis://, rediss:// (TLS), unix://; user, password
and database number as redis-py reads them.
"""
from __future__ import annotations

import asyncio
import collections
import ssl
from urllib.parse import unquote, urlparse

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError


class _Incomplete(Exception):
    pass


def encode(*args: str | float | bytes) -> bytes:
    """A command as RESP (an array of bulk strings)."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def _parse(buf: bytearray, pos: int):
    """One reply from buf[pos:]: (value, next position); _Incomplete when it has not all arrived."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        raise _Incomplete
    kind, line = buf[pos:pos + 1], bytes(buf[pos + 1:end])
    pos = end + 2
    if kind == b"$":
        size = int(line)
        if size < 0:
            return None, pos
        if len(buf) < pos + size + 2:
            raise _Incomplete
        return bytes(buf[pos:pos + size]).decode(), pos + size + 2
    if kind == b"*":
        count = int(line)
        if count < 0:
            return None, pos
        items = []
        for _ in range(count):
            item, pos = _parse(buf, pos)
            items.append(item)
        return items, pos
    if kind == b":":
        return int(line), pos
    if kind == b"+":
        return line.decode(), pos
    if kind == b"-":
        text = line.decode()
        return (NoScriptError(text) if text.startswith("NOSCRIPT") else ResponseError(text)), pos
    raise RedisConnectionError(f"unexpected reply type {kind!r} from Redis")


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiting: collections.deque[asyncio.Future] = collections.deque()
        self.buffer = bytearray()
        self.lost: Exception | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        pos = 0
        try:
            while pos < len(self.buffer):
                reply, pos = _parse(self.buffer, pos)
                future = self.waiting.popleft()
                if not future.done():  # done: its command timed out; the reply is dropped, the order kept
                    if isinstance(reply, Exception):
                        future.set_exception(reply)
                    else:
                        future.set_result(reply)
        except _Incomplete:
            pass
        except Exception as exc:  # noqa: BLE001 - a reply we cannot read: the connection is unusable
            self.transport.close()
            self.connection_lost(RedisConnectionError(f"unreadable reply from Redis: {exc}"))
        del self.buffer[:pos]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.lost is None:
            self.lost = RedisConnectionError(f"connection to Redis lost: {exc}" if exc else "Redis closed the "
                                                                                            "connection")
        while self.waiting:
            future = self.waiting.popleft()
            if not future.done():
                future.set_exception(self.lost)


class WireClient:
    """Commands on one pipelined connection, (re)connected on demand."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self._url = urlparse(url)
        self._timeout_s = timeout_s
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Future | None = None

    async def execute(self, *args) -> object:
        return (await self.execute_many([encode(*args)]))[0]

    async def execute_many(self, commands: list[bytes], *, raise_on_error: bool = True) -> list:
        """Send encoded commands in one write; their replies in order (errors raised, or returned in place)."""
        protocol = self._protocol
        if protocol is None or protocol.lost is not None:
            protocol = await self._connect()
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in commands]
        protocol.waiting.extend(futures)
        protocol.transport.write(b"".join(commands))
        try:
            async with asyncio.timeout(self._timeout_s):
                if len(futures) == 1:  # the hot path's one EVALSHA: no gather
                    try:
                        replies = [await futures[0]]
                    except ResponseError as exc:
                        replies = [exc]
                else:
                    replies = await asyncio.gather(*futures, return_exceptions=True)
        except TimeoutError:
            if all(future.done() and not future.cancelled() for future in futures):
                # The replies came, but the timer ran first in the same loop turn (a loop lagging under load):
                # a busy gateway, not a hung Redis.
                replies = [future.exception() or future.result() for future in futures]
            else:
                for future in futures:
                    future.cancel()  # their replies, if they come, are dropped in order
                raise RedisTimeoutError(f"no reply from Redis in {self._timeout_s} s") from None
        if raise_on_error:
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
        return replies

    async def _connect(self) -> _Protocol:
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._open())
        connecting = self._connecting
        try:
            return await asyncio.shield(connecting)
        finally:
            if self._connecting is connecting and connecting.done():
                self._connecting = None

    async def _open(self) -> _Protocol:
        loop, url = asyncio.get_running_loop(), self._url
        try:
            async with asyncio.timeout(self._timeout_s):
                if url.scheme == "unix":
                    _, protocol = await loop.create_unix_connection(_Protocol, url.path)
                else:
                    _, protocol = await loop.create_connection(
                        _Protocol, url.hostname or "localhost", url.port or 6379,
                        ssl=ssl.create_default_context() if url.scheme == "rediss" else None)
        except (OSError, TimeoutError) as exc:
            raise RedisConnectionError(f"cannot connect to Redis: {exc or type(exc).__name__}") from None
        self._protocol = protocol
        setup = []
        if url.password is not None:
            setup.append(encode("AUTH", *([unquote(url.username)] if url.username else []), unquote(url.password)))
        db = _db(url)
        if db:
            setup.append(encode("SELECT", db))
        if setup:
            await self.execute_many(setup)
        return protocol

    def close(self) -> None:
        """Drop the connection (its waiting commands fail); the next command opens a new one."""
        protocol, self._protocol = self._protocol, None
        if protocol is not None and protocol.transport is not None:
            protocol.transport.close()


def _db(url) -> int:
    from urllib.parse import parse_qs

    if url.scheme == "unix":
        return int(parse_qs(url.query).get("db", ["0"])[0])
    path = url.path.strip("/")
    return int(path) if path else 0
