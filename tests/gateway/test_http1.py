"""gateway/backends/http1.py against a real socket server on 127.0.0.1 that answers each request with raw
bytes the test chooses: every body framing, keep-alive and its stale connections, caps, deadlines, garbage."""
from __future__ import annotations

import asyncio
import socket
from typing import Self

import pytest

from gateway.backends.guard import AnswerRejected
from gateway.backends.http1 import ConnectFailed, Http1Pool, ProtocolError


class RawServer:
    """Reads one request (head + Content-Length body) at a time and writes the next scripted answer; an answer
    of None closes the connection without a word. Counts connections and the requests it read."""

    def __init__(self, answers: list[bytes | None], close_after_each: bool = False) -> None:
        self.answers = list(answers)
        self.close_after_each = close_after_each
        self.connections = 0
        self.requests: list[bytes] = []
        self.port = 0
        self.in_flight = self.max_in_flight = 0

    async def __aenter__(self) -> Self:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                self.requests.append(head + await reader.readexactly(length))
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
                await asyncio.sleep(0.01)
                self.in_flight -= 1
                answer = self.answers.pop(0)
                if answer is None:
                    break
                writer.write(answer)
                await writer.drain()
                if self.close_after_each:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        len(body), extra, body)


async def post(pool: Http1Pool, body: bytes = b'{"q": 1}', **kw) -> tuple[int, dict, bytes]:
    options = {"timeout_s": 5.0, "max_bytes": 1 << 20, "error_bytes": 64} | kw
    return await pool.post(pool.head("/chat/completions", {"content-type": "application/json"}), body, **options)


async def test_keep_alive_reuses_one_connection_and_sends_the_request_as_given():
    async with RawServer([ok(b'{"a": 1}'), ok(b'{"a": 2}'), ok(b'{"a": 3}')]) as server:
        pool = Http1Pool(f"http://127.0.0.1:{server.port}/v1", 4, 1.0)
        answers = [await post(pool, b'{"n": %d}' % i) for i in range(3)]
        await pool.aclose()
    assert [a[2] for a in answers] == [b'{"a": 1}', b'{"a": 2}', b'{"a": 3}']
    assert answers[0][:2] == (200, {"content-type": "application/json", "content-length": "8"})
    assert server.connections == 1
    first = server.requests[0]
    assert first.startswith(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:")
    assert b"content-type: application/json\r\n" in first and first.endswith(b'\r\ncontent-length: 8\r\n\r\n{"n": 0}')


async def test_chunked_bodies_with_extensions_and_trailers_and_interim_answers():
    chunked = (b"HTTP/1.1 100 Continue\r\n\r\n"
               b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"4;ext=1\r\n{\"a\"\r\n5\r\n: 12}\r\n0\r\nx-trailer: t\r\n\r\n")
    async with RawServer([chunked, ok(b"{}")]) as server:
        pool = Http1Pool(f"http://127.0.0.1:{server.port}", 2, 1.0)
        status, headers, body = await post(pool)
        again = await post(pool)
        await pool.aclose()
    assert (status, body) == (201, b'{"a": 12}') and headers["transfer-encoding"] == "chunked"
    assert again[2] == b"{}" and server.connections == 1  # the chunked answer was read whole: kept alive


async def test_read_to_close_bodies_connection_close_and_http10_are_not_reused():
    answers = [b"HTTP/1.1 200 OK\r\n\r\n{\"eof\": true}", ok(b"{}", b"Connection: close\r\n"),
               b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\n{}", ok(b"{}")]
    async with RawServer(answers, close_after_each=True) as server:
        pool = Http1Pool(f"http://127.0.0.1:{server.port}", 2, 1.0)
        bodies = [(await post(pool))[2] for _ in range(4)]
        await pool.aclose()
    assert bodies == [b'{"eof": true}', b"{}", b"{}", b"{}"]
    assert server.connections == 4


async def test_a_stale_idle_connection_is_replaced_once_and_a_fresh_one_that_closes_is_an_error():
    async with RawServer([ok(b"{}"), None, ok(b'{"b": 1}'), None]) as server:
        pool = Http1Pool(f"http://127.0.0.1:{server.port}", 2, 1.0)
        await post(pool)
        # the server drops the idle connection (None) when the next request arrives: sent again, fresh
        assert (await post(pool))[2] == b'{"b": 1}'
        assert len(server.requests) == 3 and server.connections == 2
        # a fresh connection that closes without an answer is not retried
        server.answers = [None]
        pool._idle.clear()
        with pytest.raises(ProtocolError):
            await post(pool)
        await pool.aclose()


async def test_answers_past_the_cap_are_refused_and_error_bodies_are_cut():
    big = b"x" * 5000
    chunked_big = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1388\r\n" + big + b"\r\n0\r\n\r\n"
    error = b"HTTP/1.1 500 Oops\r\ncontent-length: 5000\r\nretry-after: 3\r\n\r\n" + big
    async with RawServer([ok(big), chunked_big, b"HTTP/1.1 200 OK\r\n\r\n" + big, error]) as server:
        pool = Http1Pool(f"http://127.0.0.1:{server.port}", 2, 1.0)
        for _ in range(3):
            with pytest.raises(AnswerRejected) as caught:
                await post(pool, max_bytes=1000)
            assert caught.value.kind == "too_large"
        status, headers, body = await post(pool, error_bytes=64)
        await pool.aclose()
    assert (status, headers["retry-after"], body) == (500, "3", b"x" * 64)


async def test_garbage_deadlines_refusals_and_the_connection_limit():
    async with RawServer([b"SSH-2.0-OpenSSH\r\n\r\n", b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n"]) as server:
        pool = Http1Pool(f"http://127.0.0.1:{server.port}", 2, 1.0)
        for _ in range(2):
            with pytest.raises(ProtocolError):
                await post(pool)
    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1 << 16)
        await asyncio.sleep(30)

    silent = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    pool = Http1Pool(f"http://127.0.0.1:{silent.sockets[0].getsockname()[1]}", 2, 1.0)
    with pytest.raises(TimeoutError):
        await post(pool, timeout_s=0.3)
    silent.close()
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ConnectFailed):
        await post(Http1Pool(f"http://127.0.0.1:{port}", 2, 1.0))
    async with RawServer([ok(b"{}")] * 12) as busy:
        pool = Http1Pool(f"http://127.0.0.1:{busy.port}", 3, 1.0)
        await asyncio.gather(*(post(pool) for _ in range(12)))
        await pool.aclose()
    assert busy.max_in_flight <= 3 and busy.connections <= 3


def test_only_http_urls():
    with pytest.raises(ValueError):
        Http1Pool("unix:///tmp/x.sock", 1, 1.0)
