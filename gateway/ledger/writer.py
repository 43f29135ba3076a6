"""LedgerWriter: gets ledger rows into SQL off the request path, and never loses one.

- `submit()` only appends to an in-memory queue (bounded); a background task writes batches with one
  multi-row `INSERT … ON CONFLICT (request_id) DO NOTHING` each.
- When the queue is full, or the database fails, rows go to a local append-only JSONL spool (fsync'd).
  The writer retries the database with exponential backoff; once it answers, the spool is rotated to
  `<spool>.replaying`, replayed, and only then deleted. A crash at any point leaves a file that the
  next writer replays at start; replays are idempotent because request_id is unique and conflicts
  are ignored, so a batch that committed but whose acknowledgement was lost is harmless.
- Rows the database rejects on their own merits (e.g. a too-long value on PostgreSQL) are not retried
  forever: they are written to `<spool>.rejected` with the error, for a person to look at.
"""
from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from prometheus_client import Counter, Gauge, Histogram
from sqlalchemy import Table, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.sql.dml import Insert

from gateway.db import async_url, create_engine
from gateway.ledger.models import EngineUptimeRow, RequestRow, ShadowEvalRow
from gateway.ledger.record import LedgerRecord, ShadowRecord, SpoolRecord, UptimeRecord

log = logging.getLogger("switchyard.ledger")

# Module level, so several writers in one process (tests, multiple apps) share one set of series.
ROWS_WRITTEN = Counter("switchyard_ledger_rows_written", "Ledger rows inserted into the database",
                       ["path"])  # path: direct | replay
ROWS_SPOOLED = Counter("switchyard_ledger_rows_spooled", "Ledger rows appended to the local spool file",
                       ["reason"])  # reason: db_unavailable | queue_full | closed
ROWS_REJECTED = Counter("switchyard_ledger_rows_rejected",
                        "Ledger rows the database refused (written to the .rejected file)")
QUEUE_DEPTH = Gauge("switchyard_ledger_queue_depth", "Ledger rows waiting in memory for the batch writer")
BATCH_SECONDS = Histogram("switchyard_ledger_batch_write_seconds", "Time to write one batch to the database",
                          buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))

def _insert_statement(table: Table, dialect: str, key: str = "request_id") -> Insert:
    """INSERT into `table` that skips rows whose request_id is already there (replays are idempotent).

    Executed with a list of rows, SQLAlchemy renders this one cached statement as a single multi-row
    `INSERT … VALUES (…), (…) ON CONFLICT DO NOTHING RETURNING request_id` ("insertmanyvalues"), so no
    statement is compiled per batch on the event loop. RETURNING is what enables that batching here and
    it also tells how many rows were new (SQLite ≥ 3.35 supports it).
    """
    if dialect == "postgresql":
        stmt = postgresql.insert(table).on_conflict_do_nothing(index_elements=[key])
    elif dialect == "sqlite":
        stmt = sqlite.insert(table).on_conflict_do_nothing(index_elements=[key])
    else:
        raise RuntimeError(f"unsupported ledger database dialect: {dialect} (use SQLite or PostgreSQL)")
    return stmt.returning(table.c[key])


@dataclass(slots=True)
class WriterStats:
    """Per-writer counts (the Prometheus metrics are process-wide)."""

    written: int = 0  # rows inserted directly from the queue
    replayed: int = 0  # rows inserted from the spool
    duplicates: int = 0  # spooled rows that were already in the database (ignored)
    spooled: int = 0
    rejected: int = 0
    batches: int = 0
    outages: int = 0


class _Outage(Exception):
    """The database could not be reached or failed for reasons unrelated to the rows."""


def _is_row_error(exc: BaseException) -> bool:
    """True when the rows themselves are at fault (retrying the same rows cannot succeed)."""
    return isinstance(exc, (sa_exc.DataError, sa_exc.IntegrityError))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LedgerWriter:
    # The table it writes and what the spool's JSON lines are read back as (ShadowEvalWriter sets its own).
    table: Table = RequestRow.__table__
    record_type: type[SpoolRecord] = LedgerRecord
    key_column = "request_id"  # unique per row: replays skip rows already written

    def __init__(self, database_url: str, spool_path: Path, *, max_queue: int = 10_000,
                 batch_size: int = 256, flush_interval_s: float = 0.2,
                 retry_initial_s: float = 0.25, retry_max_s: float = 5.0) -> None:
        if max_queue < 1 or batch_size < 1:
            raise ValueError("max_queue and batch_size must be ≥ 1")
        self.database_url = database_url
        self.spool_path = Path(spool_path)
        self.replay_path = self.spool_path.with_name(self.spool_path.name + ".replaying")
        self.rejected_path = self.spool_path.with_name(self.spool_path.name + ".rejected")
        self.lock_path = self.spool_path.with_name(self.spool_path.name + ".lock")
        self.max_queue = max_queue
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self.stats = WriterStats()

        self._queue: deque[LedgerRecord] = deque()
        self._wake = asyncio.Event()  # queue became non-empty (or shutdown)
        self._urgent = asyncio.Event()  # a full batch, a flush or a close: stop waiting for more rows
        self._enqueued = 0  # rows ever put in the queue
        self._handled = 0  # rows taken from the queue and made durable (DB or fsync'd spool)
        self._flush_target = 0
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

        self._spool_lock = threading.Lock()  # the event loop (overflow) and a worker thread both append
        self._spool_fd: int | None = None
        self._spool_unsynced = False
        self._spool_pending = self.spool_path.exists() or self.replay_path.exists()

        self._db_up = True
        self._backoff = retry_initial_s
        self._retry_at = 0.0
        self._engine: AsyncEngine | None = None
        self._insert: Insert | None = None
        self._task: asyncio.Task[None] | None = None
        self._inflight: list[LedgerRecord] | None = None  # popped from the queue, not yet durable
        self._lock_fd: int | None = None
        self._closing = False
        self._closed = False

    # ---- public API -------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def db_available(self) -> bool:
        return self._db_up

    async def start(self) -> None:
        """Connect lazily and start the background task; a spool left by a previous process replays first."""
        if self._task is not None:
            return
        self.spool_path.parent.mkdir(parents=True, exist_ok=True)
        self._take_spool_lock()
        engine_kwargs: dict[str, Any] = {}
        if async_url(self.database_url).startswith("postgresql+asyncpg"):
            # A hung statement must not stall the ledger forever: it fails, and the batch is spooled.
            engine_kwargs["connect_args"] = {"command_timeout": 30}
        self._engine = create_engine(self.database_url, **engine_kwargs)
        self._insert = _insert_statement(self.table, self._engine.dialect.name, self.key_column)
        self._task = asyncio.create_task(self._run(), name="ledger-writer")

    def submit(self, record: LedgerRecord) -> None:
        """Queue a row. Never blocks on and never raises because of the database."""
        if self._closed or len(self._queue) >= self.max_queue:
            self._spool_now(record, "closed" if self._closed else "queue_full")
            return
        self._queue.append(record)
        self._enqueued += 1
        QUEUE_DEPTH.inc()
        self._wake.set()
        if len(self._queue) >= self.batch_size:
            self._urgent.set()

    async def flush(self) -> None:
        """Return once every row submitted so far is in the database or fsync'd in the spool."""
        target = self._enqueued
        self._flush_target = max(self._flush_target, target)
        self._urgent.set()
        self._wake.set()
        while self._handled < target:
            if self._task is None or self._task.done():
                await self._spool_queue_directly()
                break
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append((target, fut))
            await asyncio.wait({fut, self._task}, return_when=asyncio.FIRST_COMPLETED)
        await self._sync_spool()

    async def close(self, timeout_s: float | None = 60.0) -> None:
        """Graceful shutdown: write (or spool) everything queued, try a last replay, release the DB.

        If the database hangs past `timeout_s`, the rows not yet written are spooled instead (they
        replay at the next start), so shutdown is bounded (timeout_s plus the ~2 s asyncpg takes to
        drop a dead connection) and still loses nothing.
        """
        if self._closed:
            return
        self._closing = True
        self._urgent.set()
        self._wake.set()
        if self._task is not None:
            done, _ = await asyncio.wait({self._task}, timeout=timeout_s)
            if not done:
                log.error("ledger writer still busy after %ss at shutdown; spooling the rest", timeout_s)
                self._task.cancel()
                with contextlib.suppress(BaseException):
                    await self._task
            elif not self._task.cancelled() and self._task.exception() is not None:
                log.error("ledger writer task failed", exc_info=self._task.exception())
        if self._inflight:
            batch, self._inflight = self._inflight, None
            if await self._spool_batch(batch, "closed"):
                self._mark_handled(len(batch))
        if self._queue:
            await self._spool_queue_directly()
        await self._sync_spool()
        self._closed = True
        with self._spool_lock:
            if self._spool_fd is not None:
                os.close(self._spool_fd)
                self._spool_fd = None
        if self._engine is not None:
            with contextlib.suppress(Exception, TimeoutError):
                await asyncio.wait_for(self._engine.dispose(), 10)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def _take_spool_lock(self) -> None:
        """One writer per spool file: a second process renaming the spool under us would lose rows."""
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(
                f"ledger spool {self.spool_path} is in use by another writer; give each gateway process "
                f"its own spool path") from None
        self._lock_fd = fd

    # ---- background loop ----------------------------------------------------------------------

    async def _run(self) -> None:
        await self._guarded(self._replay_if_due(force=True))  # a previous process's spool
        while True:
            batch = await self._next_batch()
            if batch:
                await self._guarded(self._handle_batch(batch))
            if self._closing and not self._queue:
                break
            await self._guarded(self._replay_if_due())
        # Last chance to leave an empty spool behind: ignore the backoff timer once.
        await self._guarded(self._replay_if_due(force=True))

    async def _guarded(self, step: Awaitable[None]) -> None:
        """Run one step; an unexpected error is logged and the rows in flight are spooled, not dropped."""
        try:
            await step
        except Exception:  # keep the writer alive whatever happens
            log.exception("ledger writer error")
            if self._inflight:
                batch, self._inflight = self._inflight, None
                if await self._spool_batch(batch, "db_unavailable"):
                    self._mark_handled(len(batch))
                else:
                    self._queue.extendleft(reversed(batch))
                    QUEUE_DEPTH.inc(len(batch))
            await asyncio.sleep(0.1)

    def _idle_timeout(self) -> float | None:
        if not self._spool_pending and self._db_up:
            return None
        if not self._db_up:
            return max(0.01, self._retry_at - time.monotonic())
        return 1.0  # overflow rows are waiting in the spool; replay them when idle

    async def _next_batch(self) -> list[LedgerRecord]:
        if not self._queue:
            if self._closing:
                return []
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), self._idle_timeout())
            except TimeoutError:
                return []
        hurry = self._closing or self._flush_target > self._handled
        if len(self._queue) < self.batch_size and not hurry and self.flush_interval_s > 0:
            self._urgent.clear()
            try:  # let a small batch grow for a moment, unless it fills, or a flush/close comes
                await asyncio.wait_for(self._urgent.wait(), self.flush_interval_s)
            except TimeoutError:
                pass
        n = min(len(self._queue), self.batch_size)
        batch = [self._queue.popleft() for _ in range(n)]
        QUEUE_DEPTH.dec(n)
        return batch

    async def _handle_batch(self, batch: list[LedgerRecord]) -> None:
        self._inflight = batch
        await self._write_or_spool(batch)
        self._inflight = None  # not in a finally: if close() cancels us, it spools what is in flight

    async def _write_or_spool(self, batch: list[LedgerRecord]) -> None:
        if self._db_up:
            rows = [r.to_row() for r in batch]
            try:
                inserted = await self._insert_rows(rows)
                self.stats.written += inserted
                self.stats.duplicates += len(rows) - inserted
                ROWS_WRITTEN.labels("direct").inc(inserted)
                self._mark_handled(len(batch))
                return
            except _Outage as exc:
                self._mark_down(exc)
        if await self._spool_batch(batch, "db_unavailable"):
            self._mark_handled(len(batch))
        else:  # neither the DB nor the disk took them: keep them queued and try again shortly
            self._queue.extendleft(reversed(batch))
            QUEUE_DEPTH.inc(len(batch))
            await asyncio.sleep(0.5)

    def _mark_handled(self, n: int) -> None:
        self._handled += n
        still: list[tuple[int, asyncio.Future[None]]] = []
        for target, fut in self._waiters:
            if self._handled >= target:
                if not fut.done():
                    fut.set_result(None)
            else:
                still.append((target, fut))
        self._waiters = still

    def _mark_down(self, exc: BaseException) -> None:
        if self._db_up:
            self.stats.outages += 1
            log.warning("ledger database unavailable, spooling rows to %s: %s", self.spool_path, exc)
            self._backoff = self.retry_initial_s
        else:
            self._backoff = min(self._backoff * 2, self.retry_max_s)
        self._db_up = False
        self._retry_at = time.monotonic() + self._backoff

    def _mark_up(self) -> None:
        if not self._db_up:
            log.warning("ledger database is back")
        self._db_up = True
        self._backoff = self.retry_initial_s

    # ---- database -----------------------------------------------------------------------------

    async def _insert_rows(self, rows: list[dict[str, Any]]) -> int:
        """Insert rows (conflicts ignored) in one transaction; returns rows actually inserted.

        Raises _Outage for anything that is not the rows' fault. Rows the database refuses are
        retried one at a time so one bad row cannot hold the others hostage.
        """
        assert self._engine is not None
        started = time.perf_counter()
        try:
            async with self._engine.begin() as conn:
                result = await conn.execute(self._insert, rows)
                inserted = len(result.all())
        except Exception as exc:  # classified below
            if _is_row_error(exc) and len(rows) > 1:
                return await self._insert_one_by_one(rows)
            if _is_row_error(exc):
                self._reject(rows, exc)
                return 0
            raise _Outage(f"{type(exc).__name__}: {exc}") from exc
        self.stats.batches += 1
        BATCH_SECONDS.observe(time.perf_counter() - started)
        return inserted

    async def _insert_one_by_one(self, rows: list[dict[str, Any]]) -> int:
        inserted = 0
        for row in rows:
            inserted += await self._insert_rows([row])
        return inserted

    def _reject(self, rows: list[dict[str, Any]], exc: BaseException) -> None:
        self.stats.rejected += len(rows)
        ROWS_REJECTED.inc(len(rows))
        log.error("ledger database refused %d row(s); kept in %s: %s", len(rows), self.rejected_path, exc)
        lines = [json.dumps({"error": str(exc).splitlines()[0][:500], "row": row}, default=str) + "\n"
                 for row in rows]
        self._append_lines(self.rejected_path, lines, fsync=True)

    async def _probe(self) -> bool:
        assert self._engine is not None
        try:
            async with self._engine.connect() as conn:
                await conn.execute(text("SELECT 1"))
            return True
        except Exception:  # noqa: BLE001 - any failure means "still down"
            return False

    # ---- spool --------------------------------------------------------------------------------

    def _append_lines(self, path: Path, lines: Iterable[str], *, fsync: bool) -> None:
        data = "".join(lines).encode()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _spool_write(self, data: bytes, *, fsync: bool) -> None:
        with self._spool_lock:
            if self._spool_fd is None:
                self.spool_path.parent.mkdir(parents=True, exist_ok=True)
                self._spool_fd = os.open(self.spool_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            fd = self._spool_fd
            view = memoryview(data)
            while view:  # O_APPEND: each write lands at the end, even with two writers
                view = view[os.write(fd, view):]
            self._spool_pending = True
            if fsync:
                os.fsync(fd)

    def _spool_now(self, record: LedgerRecord, reason: str) -> None:
        """Synchronous spool append for rows that cannot be queued (fsync'd later by flush/close)."""
        try:
            line = json.dumps(record.to_json(), default=str) + "\n"
            if self._closed:  # after close(): no background task will fsync, so do it now
                with self._spool_lock:
                    self._append_lines(self.spool_path, [line], fsync=True)
            else:
                self._spool_write(line.encode(), fsync=False)
        except Exception:  # never raise into the request path; keep the row in memory
            log.exception("ledger spool append failed; keeping the row in memory")
            self._queue.append(record)
            self._enqueued += 1
            QUEUE_DEPTH.inc()
            self._wake.set()
            return
        self._spool_unsynced = True
        self.stats.spooled += 1
        ROWS_SPOOLED.labels(reason).inc()

    def _serialize(self, batch: list[LedgerRecord]) -> bytes:
        """JSONL for the spool; a record too malformed to serialize goes to the .rejected file instead."""
        lines, bad = [], []
        for r in batch:
            try:
                lines.append(json.dumps(r.to_json(), default=str) + "\n")
            except Exception as exc:  # noqa: BLE001 - e.g. created_at that is not a datetime
                bad.append(json.dumps({"error": f"unserializable record: {exc!r}", "line": repr(r)}) + "\n")
        if bad:
            log.error("ledger got %d malformed record(s); kept in %s", len(bad), self.rejected_path)
            self.stats.rejected += len(bad)
            ROWS_REJECTED.inc(len(bad))
            self._append_lines(self.rejected_path, bad, fsync=True)
        return "".join(lines).encode()

    async def _spool_batch(self, batch: list[LedgerRecord], reason: str) -> bool:
        try:
            data = await asyncio.to_thread(self._serialize, batch)
            await asyncio.to_thread(self._spool_write, data, fsync=True)
        except Exception:
            log.exception("ledger spool write failed (%d rows kept in memory)", len(batch))
            return False
        self.stats.spooled += len(batch)
        ROWS_SPOOLED.labels(reason).inc(len(batch))
        return True

    async def _spool_queue_directly(self) -> None:
        batch = list(self._queue)
        self._queue.clear()
        QUEUE_DEPTH.dec(len(batch))
        if batch and await self._spool_batch(batch, "closed"):
            self._mark_handled(len(batch))
        elif batch:
            log.critical("ledger rows could not be written anywhere: %s",
                         json.dumps([r.to_json() for r in batch]))

    async def _sync_spool(self) -> None:
        if not self._spool_unsynced:
            return
        self._spool_unsynced = False

        def sync() -> None:
            with self._spool_lock:
                if self._spool_fd is not None:
                    os.fsync(self._spool_fd)

        await asyncio.to_thread(sync)

    def _rotate(self) -> Path | None:
        """The file to replay next: a leftover .replaying file, else the spool renamed to it."""
        with self._spool_lock:
            if self.replay_path.exists():
                return self.replay_path
            if not self.spool_path.exists():
                self._spool_pending = False
                return None
            if self._spool_fd is not None:
                os.fsync(self._spool_fd)
                os.close(self._spool_fd)
                self._spool_fd = None
            if self.spool_path.stat().st_size == 0:
                self.spool_path.unlink()
                self._spool_pending = False
                return None
            os.replace(self.spool_path, self.replay_path)
            _fsync_dir(self.spool_path.parent)
            return self.replay_path

    def _read_chunk(self, f: TextIO, max_rows: int) -> list[dict[str, Any]]:
        """Up to max_rows rows from an open spool file ([] at the end); unreadable lines are set aside."""
        rows: list[dict[str, Any]] = []
        bad: list[str] = []
        while len(rows) < max_rows:
            line = f.readline()
            if not line:
                break
            if not line.strip():
                continue
            try:
                rows.append(self.record_type.from_json(json.loads(line)).to_row())
            except Exception as exc:  # noqa: BLE001 - e.g. a line torn by a crash mid-write
                bad.append(json.dumps({"error": f"unreadable spool line: {exc}", "line": line}) + "\n")
        if bad:
            log.error("ledger spool had %d unreadable line(s); kept in %s", len(bad), self.rejected_path)
            self.stats.rejected += len(bad)
            ROWS_REJECTED.inc(len(bad))
            self._append_lines(self.rejected_path, bad, fsync=True)
        return rows

    async def _replay_if_due(self, *, force: bool = False) -> None:
        if not self._db_up and not force and time.monotonic() < self._retry_at:
            return
        if not self._spool_pending:
            if not self._db_up:
                if await self._probe():
                    self._mark_up()
                else:
                    self._mark_down(_Outage("probe failed"))
            return
        if self._db_up and not force and len(self._queue) >= self.batch_size:
            return  # busy: live rows first, the spool when there is slack
        try:
            await self._replay()
        except _Outage as exc:
            self._mark_down(exc)
        else:
            self._mark_up()

    async def _replay(self) -> None:
        """Replay spool files into the database until none is left (raises _Outage)."""
        for _ in range(8):  # bounded: overflow may keep refilling the spool under sustained load
            path = await asyncio.to_thread(self._rotate)
            if path is None:
                return
            total = 0
            # Streamed in batches: a long outage can leave a spool far larger than memory should hold.
            f = await asyncio.to_thread(open, path, encoding="utf-8", errors="replace")
            try:
                while chunk := await asyncio.to_thread(self._read_chunk, f, self.batch_size):
                    inserted = await self._insert_rows(chunk)
                    total += len(chunk)
                    self.stats.replayed += inserted
                    self.stats.duplicates += len(chunk) - inserted
                    ROWS_WRITTEN.labels("replay").inc(inserted)
            finally:
                f.close()
            await asyncio.to_thread(self._finish_replay, path)
            log.info("ledger replayed %d spooled row(s) from %s", total, path)

    def _finish_replay(self, path: Path) -> None:
        path.unlink()
        _fsync_dir(path.parent)


class ShadowEvalWriter(LedgerWriter):
    """The same queue, batching, spool and replay, writing `shadow_evals` (give it its own spool file).

    Its Prometheus series (switchyard_ledger_rows_*) count these rows together with the ledger's.
    """

    table = ShadowEvalRow.__table__
    record_type = ShadowRecord


class UptimeWriter(LedgerWriter):
    """The same queue, batching, spool and replay, writing `engine_uptime` (give it its own spool file)."""

    table = EngineUptimeRow.__table__
    record_type = UptimeRecord
    key_column = "interval_id"
