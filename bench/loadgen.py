"""A small, fast HTTP/1.1 load generator (keep-alive, raw asyncio sockets) for benchmarks.

A Python HTTP client costs more per request than the servers it measures on a 2-core box; this one
does the minimum (write one request, read headers and a Content-Length body) so the server dominates.
"""
from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass(slots=True)
class LoadResult:
    requests: int
    errors: int
    seconds: float
    latencies_ms: list[float]

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    def percentile(self, q: float) -> float:
        if not self.latencies_ms:
            return float("nan")
        ordered = sorted(self.latencies_ms)
        index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
        return ordered[index]

    @property
    def p50(self) -> float:
        return statistics.median(self.latencies_ms) if self.latencies_ms else float("nan")


class _Connection:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, raw: bytes) -> int:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        chunked = False
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
        if chunked:
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).strip(), 16)
                await self.reader.readexactly(size + 2)
                if size == 0:
                    break
        elif length:
            await self.reader.readexactly(length)
        return status

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def build_request(url: str, body: bytes, headers: dict[str, str]) -> tuple[str, int, bytes]:
    parts = urlsplit(url)
    head = [f"POST {parts.path} HTTP/1.1", f"Host: {parts.hostname}:{parts.port}",
            "Content-Type: application/json", f"Content-Length: {len(body)}"]
    head += [f"{k}: {v}" for k, v in headers.items()]
    return parts.hostname, parts.port, ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def run_load(url: str, body: bytes | list[bytes], headers: dict[str, str], *, concurrency: int,
                   requests: int | None = None, seconds: float | None = None, warmup: int = 20) -> LoadResult:
    """Closed-loop load: `concurrency` workers, each with one keep-alive connection. `body`: one body for every
    request, or a list the requests take in turn (e.g. distinct prompts, so no cache answers for the server)."""
    bodies = body if isinstance(body, list) else [body]
    built = [build_request(url, b, headers) for b in bodies]
    host, port = built[0][0], built[0][1]
    raws = [r for _, _, r in built]
    turn = 0

    def next_raw() -> bytes:
        nonlocal turn
        turn += 1
        return raws[turn % len(raws)]

    warm = _Connection(host, port)
    for _ in range(warmup):
        await warm.request(next_raw())
    warm.close()
    latencies: list[float] = []
    errors = 0
    issued = 0
    start = time.perf_counter()
    deadline = start + seconds if seconds else None

    async def worker() -> None:
        nonlocal errors, issued
        conn = _Connection(host, port)
        try:
            while True:
                if requests is not None and issued >= requests:
                    return
                if deadline is not None and time.perf_counter() >= deadline:
                    return
                issued += 1
                t0 = time.perf_counter()
                try:
                    status = await conn.request(next_raw())
                except (OSError, asyncio.IncompleteReadError, ValueError):
                    errors += 1
                    conn.close()
                    continue
                latencies.append((time.perf_counter() - t0) * 1000)
                if status != 200:
                    errors += 1
        finally:
            conn.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    return LoadResult(requests=len(latencies), errors=errors, seconds=elapsed, latencies_ms=latencies)
