"""The database goes away under load: no ledger row may be lost or duplicated.

Real PostgreSQL is reached through a TCP proxy on 127.0.0.1 that the test owns; "cutting" it closes
the listener and aborts every open connection (clients see resets and refused connects), exactly
what a database crash or a network partition looks like to the gateway.
"""
from __future__ import annotations

import asyncio
import random
import time

from sqlalchemy.engine import make_url

from gateway.db import upgrade
from gateway.ledger.writer import LedgerWriter
from tests.gateway.test_ledger_writer import assert_exactly_once, make_record, request_id_counts, spool_lines


class TcpProxy:
    """A byte forwarder 127.0.0.1:port -> target that can be cut and restored on the same port."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()
        self.connections = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        await self._flowing.wait()
        try:
            up_r, up_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.transport.abort()
            return
        self.connections += 1
        self._writers |= {client_w, up_w}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    await self._flowing.wait()
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.transport.abort()

        await asyncio.gather(pipe(client_r, up_w), pipe(up_r, client_w))
        self._writers -= {client_w, up_w}

    async def cut(self) -> None:
        assert self._server is not None
        self._server.close()
        for w in list(self._writers):
            w.transport.abort()
        self._writers.clear()
        await self._server.wait_closed()
        self._server = None

    async def restore(self) -> None:
        await self.start()

    def stall(self) -> None:
        """Keep every connection open but stop moving bytes: a hung server or a black-holed network."""
        self._flowing.clear()

    def unstall(self) -> None:
        self._flowing.set()

    def url_for(self, pg_url: str) -> str:
        return make_url(pg_url).set(host="127.0.0.1", port=self.port).render_as_string(hide_password=False)


async def _proxy_to(pg_url: str) -> TcpProxy:
    url = make_url(pg_url)
    proxy = TcpProxy(url.host or "127.0.0.1", url.port or 5432)
    await proxy.start()
    return proxy


async def _produce(writer: LedgerWriter, ids: list[str], prefix: str, start: int, n: int, seconds: float) -> None:
    """Submit n records spread over about `seconds`, the way concurrent requests finish."""
    rng = random.Random(start)
    for i in range(start, start + n):
        rec = make_record(i, prefix=prefix)
        ids.append(rec.request_id)
        writer.submit(rec)
        await asyncio.sleep(rng.uniform(0, 2 * seconds / n))


async def test_database_cut_under_load_loses_and_duplicates_nothing(pg_url: str, tmp_path) -> None:
    upgrade(pg_url)
    proxy = await _proxy_to(pg_url)
    writer = LedgerWriter(proxy.url_for(pg_url), tmp_path / "spool.jsonl", batch_size=64,
                          flush_interval_s=0.05, retry_initial_s=0.1, retry_max_s=0.5)
    await writer.start()
    ids: list[str] = []
    producers = [asyncio.create_task(_produce(writer, ids, "load", k * 100, 100, 2.5)) for k in range(20)]

    await asyncio.sleep(0.8)
    rows_before_cut = sum(request_id_counts(pg_url).values())
    await proxy.cut()
    cut_at = time.monotonic()
    await asyncio.sleep(1.0)
    assert not writer.db_available  # the writer noticed, and is spooling instead of blocking
    await proxy.restore()
    await asyncio.gather(*producers)
    await writer.close()

    assert len(ids) == 2000
    assert_exactly_once(pg_url, set(ids))
    assert 0 < rows_before_cut < 2000  # the cut really happened mid-stream
    assert writer.stats.outages >= 1 and writer.stats.spooled > 0 and writer.stats.replayed > 0
    # A batch committed just as the link dropped is spooled too, and replays as duplicates.
    assert writer.stats.written + writer.stats.replayed + writer.stats.duplicates == 2000
    assert not writer.spool_path.exists() and not writer.replay_path.exists()
    assert time.monotonic() - cut_at < 20


async def test_restarted_process_replays_what_the_old_one_spooled(pg_url: str, tmp_path) -> None:
    upgrade(pg_url)
    proxy = await _proxy_to(pg_url)
    spool = tmp_path / "spool.jsonl"
    ids: list[str] = []

    old = LedgerWriter(proxy.url_for(pg_url), spool, batch_size=32, flush_interval_s=0.02, retry_initial_s=0.1)
    await old.start()
    producer = asyncio.create_task(_produce(old, ids, "old", 0, 400, 1.0))
    await asyncio.sleep(0.3)
    await proxy.cut()
    await producer
    await old.close()  # the database is still down: the rest stays in the spool
    in_db = sum(request_id_counts(pg_url).values())
    assert 0 < in_db < 400
    assert spool_lines(spool) + spool_lines(old.replay_path) >= 400 - in_db

    await proxy.restore()
    new = LedgerWriter(proxy.url_for(pg_url), spool, batch_size=32, flush_interval_s=0.02)
    await new.start()
    await _produce(new, ids, "new", 0, 200, 0.3)
    await new.close()

    assert_exactly_once(pg_url, set(ids))
    assert new.stats.replayed == 400 - in_db
    assert not spool.exists() and not new.replay_path.exists()


async def test_hung_database_shutdown_is_bounded_and_loses_nothing(pg_url: str, tmp_path) -> None:
    """The server stops answering (no reset, no refusal): close() gives up on time and spools the rest."""
    upgrade(pg_url)
    proxy = await _proxy_to(pg_url)
    spool = tmp_path / "spool.jsonl"
    ids: list[str] = []
    old = LedgerWriter(proxy.url_for(pg_url), spool, batch_size=50, flush_interval_s=0.02)
    await old.start()
    await _produce(old, ids, "hang", 0, 100, 0.2)
    await old.flush()
    proxy.stall()
    await _produce(old, ids, "hang", 100, 200, 0.2)  # one batch hangs in flight, the rest queue up
    started = time.monotonic()
    await old.close(timeout_s=1.0)
    assert time.monotonic() - started < 5
    assert sum(request_id_counts(pg_url).values()) == 100
    assert spool_lines(spool) >= 200

    proxy.unstall()
    new = LedgerWriter(pg_url, spool)  # e.g. restarted with the proxy gone
    await new.start()
    await new.close()
    assert_exactly_once(pg_url, set(ids))
    await proxy.cut()


async def test_one_writer_per_spool(sqlite_url: str, tmp_path) -> None:
    upgrade(sqlite_url)
    first = LedgerWriter(sqlite_url, tmp_path / "spool.jsonl")
    await first.start()
    second = LedgerWriter(sqlite_url, tmp_path / "spool.jsonl")
    try:
        await second.start()
    except RuntimeError as exc:
        assert "in use by another writer" in str(exc)
    else:
        raise AssertionError("a second writer on the same spool must be refused")
    await first.close()
    await second.start()  # free again once the first has closed
    await second.close()


async def test_flush_asks_the_database_again_instead_of_waiting_out_the_backoff(pg_url: str, tmp_path) -> None:
    """CI: a start-up probe that failed once sent every row of a test to the spool, and flush() returned with
    nothing in the database although it answered again (the next probe was a backoff away). A flush now
    asks the database at once; its rows land there, the spool stays empty. The probe's reason is logged."""
    upgrade(pg_url)
    proxy = await _proxy_to(pg_url)
    await proxy.cut()
    writer = LedgerWriter(proxy.url_for(pg_url), tmp_path / "spool.jsonl", retry_initial_s=60, retry_max_s=60)
    await writer.start()
    for _ in range(100):  # the start-up probe runs in the writer's task
        if not writer.db_available:
            break
        await asyncio.sleep(0.05)
    assert not writer.db_available  # the start-up probe failed: the next try is a minute away
    await proxy.restore()
    records = [make_record(i, prefix="flush") for i in range(5)]
    for record in records:
        writer.submit(record)
    await writer.flush()
    try:
        assert writer.db_available and writer.stats.spooled == 0
        assert request_id_counts(pg_url) == {r.request_id: 1 for r in records}
    finally:
        await writer.close()
        await proxy.cut()
