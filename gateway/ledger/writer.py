"""LedgerWriter: gets ledger rows into SQL off the request path, and never loses one.

- `submit()` only appends to an in-memory queue (bounded); a background task writes batches with one
  multi-row `INSERT … ON CONFLICT (request_id) DO NOTHING` each.
- When the queue is full, or the database fails, rows go to a local append-only JSONL spool (fsync'd;
  gateway/ledger/spool.py). The writer retries the database with exponential backoff
  (gateway/ledger/outage.py); once it answers, the spool is replayed into it (spool.py: rotated to
  `<spool>.replaying`, replayed, and only then deleted). Replays are idempotent because request_id is unique
  and conflicts are ignored, so a batch that committed but whose acknowledgement was lost is harmless.
- Every row is made storable before the INSERT (gateway/ledger/sanitize.py: NUL, lone surrogates, column
  widths). A row the database still refuses for what it contains is a row error, not an outage
  (gateway/ledger/failures.py): the batch is bisected, the rows around it land, and it goes to the
  quarantine file `<spool>.rejected` with the reason (gateway/ledger/quarantine.py). A spooled row that
  cannot land is quarantined on replay the same way, so no row can block the spool.
- When neither the database nor the spool takes rows (the spool's disk is full or read-only), they stay in
  memory up to `max_queue`; beyond it a row is lost, counted (switchyard_ledger_rows_lost) and logged at
  CRITICAL with its values. `health()` says `degraded` while rows are only spooled or in danger.
- `close()` is bounded in every state (the database hung, the spool gone): what it cannot write or spool by
  its deadline is counted and logged as lost.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import Counter, Gauge, Histogram
from sqlalchemy import Table, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.sql.dml import Insert

from gateway.db import async_url, create_engine
from gateway.ledger import sanitize
from gateway.ledger.failures import is_row_error
from gateway.ledger.models import EngineUptimeRow, RequestRow, ShadowEvalRow
from gateway.ledger.outage import DatabaseState
from gateway.ledger.quarantine import ROWS_REJECTED, Quarantine  # noqa: F401 - ROWS_REJECTED: re-exported
from gateway.ledger.record import LedgerRecord, ShadowRecord, SpoolRecord, UptimeRecord
from gateway.ledger.spool import RateLimited, Spool

log = logging.getLogger("switchyard.ledger")

# Module level, so several writers in one process (tests, multiple apps) share one set of series.
ROWS_WRITTEN = Counter("switchyard_ledger_rows_written", "Ledger rows inserted into the database",
                       ["path"])  # path: direct | replay
ROWS_SPOOLED = Counter("switchyard_ledger_rows_spooled", "Ledger rows appended to the local spool file",
                       ["reason"])  # reason: db_unavailable | queue_full | closed
ROWS_LOST = Counter("switchyard_ledger_rows_lost",
                    "Ledger rows neither the database nor the spool would take, beyond the in-memory bound "
                    "(each logged at CRITICAL with its values)")
SPOOL_ROWS = Gauge("switchyard_ledger_spool_rows", "Rows waiting in a ledger spool file for the database",
                   ["spool"])
SPOOL_AGE = Gauge("switchyard_ledger_spool_age_seconds", "Age of the oldest row waiting in a ledger spool file",
                  ["spool"])
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
    rejected: int = 0  # rows set aside in the quarantine file
    lost: int = 0  # rows neither the database, the spool nor the quarantine took (logged at CRITICAL)
    batches: int = 0
    outages: int = 0


class _Outage(Exception):
    """The database could not be reached or failed for reasons unrelated to the rows."""


def _loggable(row: dict[str, Any]) -> str:
    """A lost row's values for the log, long texts (prompts, answers) replaced by their length."""
    short = {k: (f"<{len(v)} chars>" if isinstance(v, str) and len(v) > 200 else v) for k, v in row.items()}
    return json.dumps(short, default=str)


class LedgerWriter:
    # The table it writes and what the spool's JSON lines are read back as (ShadowEvalWriter sets its own).
    table: Table = RequestRow.__table__
    record_type: type[SpoolRecord] = LedgerRecord
    key_column = "request_id"  # unique per row: replays skip rows already written

    def __init__(self, database_url: str, spool_path: Path, *, max_queue: int = 10_000,
                 batch_size: int = 256, flush_interval_s: float = 0.2,
                 retry_initial_s: float = 0.25, retry_max_s: float = 5.0,
                 connect_timeout_s: float = 10.0) -> None:
        if max_queue < 1 or batch_size < 1:
            raise ValueError("max_queue and batch_size must be ≥ 1")
        self.database_url = database_url
        self.spool = Spool(Path(spool_path), self.record_type)
        self.spool_path, self.replay_path = self.spool.path, self.spool.replay_path
        self.lock_path = self.spool.lock_path
        self.rejected_path = self.spool_path.with_name(self.spool_path.name + ".rejected")
        self.max_queue = max_queue
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.connect_timeout_s = connect_timeout_s
        self.stats = WriterStats()
        self.quarantine = Quarantine(self.rejected_path, self.table.name)

        self._queue: deque[LedgerRecord] = deque()
        self._wake = asyncio.Event()  # queue became non-empty (or shutdown)
        self._urgent = asyncio.Event()  # a full batch, a flush or a close: stop waiting for more rows
        self._enqueued = 0  # rows ever put in the queue
        self._handled = 0  # rows taken from the queue and made durable (DB, fsync'd spool) or given up on
        self._flush_target = 0
        self._flush_probed = 0  # the flush target a database probe was last made for (see _write_or_spool)
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

        self._lost_log = RateLimited(5.0)
        self._db = DatabaseState(retry_initial_s, retry_max_s)
        self._engine: AsyncEngine | None = None
        self._insert: Insert | None = None
        self._task: asyncio.Task[None] | None = None
        self._inflight: list[LedgerRecord] | None = None  # popped from the queue, not yet durable
        self._closing = False
        self._stuck = False  # closing, and a batch could go neither to the database nor to the spool
        self._closed = False

    # ---- public API -------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def db_available(self) -> bool:
        return self._db.up

    @property
    def spool_rows(self) -> int:
        """Rows waiting in the spool files (written there, not yet in the database)."""
        return self.spool.rows

    @property
    def spool_age_s(self) -> float:
        """Seconds since the oldest row still waiting in the spool was spooled (0 when none waits)."""
        return self.spool.age_s

    def health(self) -> dict[str, Any]:
        """The ledger's part of /health: `degraded` while rows do not reach the database: the database is
        down, rows wait in the spool, or the in-memory queue is full. `spool_error` is the spool's last
        failure (until a spool write or a replay succeeds): with the database down, rows beyond the queue's
        bound are then lost (`lost` counts them since start; `quarantined` is the quarantine file's rows)."""
        spool_rows = self.spool_rows
        degraded = not self._db.up or spool_rows > 0 or len(self._queue) >= self.max_queue
        return {"status": "degraded" if degraded else "ok", "database": self._db.up, "queue": len(self._queue),
                "spool_rows": spool_rows, "spool_age_s": round(self.spool_age_s, 1),
                "spool_error": self.spool.error, "quarantined": self.quarantine.rows, "lost": self.stats.lost}

    async def start(self) -> None:
        """Connect lazily and start the background task; a spool left by a previous process replays first.

        A spool directory that cannot be written does not stop the start: rows go to the database, and
        /health reports the spool's error (the rows of a later outage would stay in memory only).
        """
        if self._task is not None:
            return
        try:
            self.spool_path.parent.mkdir(parents=True, exist_ok=True)
            self.spool.take_lock()
        except OSError as exc:
            self.spool.failed(exc, "cannot lock the spool; it will be retried when rows need it")
        await asyncio.to_thread(self._count_existing)
        engine_kwargs: dict[str, Any] = {}
        if async_url(self.database_url).startswith("postgresql+asyncpg"):
            # A hung statement must not stall the ledger forever: it fails, and the batch is spooled; a
            # black-holed server must not hold a connect attempt (or shutdown) for asyncpg's default 60 s.
            engine_kwargs["connect_args"] = {"command_timeout": 30, "timeout": self.connect_timeout_s}
        self._engine = create_engine(self.database_url, **engine_kwargs)
        self._insert = _insert_statement(self.table, self._engine.dialect.name, self.key_column)
        SPOOL_ROWS.labels(self.spool_path.name).set_function(lambda: self.spool_rows)
        SPOOL_AGE.labels(self.spool_path.name).set_function(lambda: self.spool_age_s)
        self._task = asyncio.create_task(self._run(), name="ledger-writer")

    def submit(self, record: LedgerRecord) -> None:
        """Queue a row. Never blocks on and never raises because of the database or the disk."""
        if self._closed or len(self._queue) >= self.max_queue:
            if not self._spool_now(record, "closed" if self._closed else "queue_full"):
                self._lose([record], "queue full and spool unwritable" if not self._closed
                           else "writer closed and spool unwritable")
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
        await self.spool.sync()

    async def close(self, timeout_s: float = 5.0) -> None:
        """Graceful shutdown: write (or spool) everything queued, try a last replay, release the DB.

        Bounded in every state: after `timeout_s` the background task is cancelled and what it had not
        written is spooled; what cannot be spooled either is counted and logged as lost. The steps after
        the deadline (spooling, disposing connections) have a second or two of their own.
        """
        if self._closed:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        self._closing = True
        self._urgent.set()
        self._wake.set()
        if self._task is not None:
            done, _ = await asyncio.wait({self._task}, timeout=max(0.0, deadline - loop.time()))
            if not done:
                log.error("ledger writer still busy after %ss at shutdown; spooling the rest", timeout_s)
                self._task.cancel()
                await asyncio.wait({self._task}, timeout=1.0)
            elif not self._task.cancelled() and self._task.exception() is not None:
                log.error("ledger writer task failed", exc_info=self._task.exception())
        if self._inflight:
            batch, self._inflight = self._inflight, None
            self._queue.extendleft(reversed(batch))
            QUEUE_DEPTH.inc(len(batch))
        if self._queue:
            await self._spool_queue_directly(timeout_s=max(1.0, deadline - loop.time()))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.spool.sync(), max(0.5, deadline - loop.time()))
        self._closed = True
        self.spool.close()
        if self._engine is not None:
            with contextlib.suppress(Exception, TimeoutError):
                await asyncio.wait_for(self._engine.dispose(), max(0.5, min(2.0, deadline - loop.time())))

    def _count_existing(self) -> None:
        """Depth and age of spools and the quarantine left by an earlier process (blocking: run in a thread)."""
        self.quarantine.count_existing()
        self.spool.count_existing()

    # ---- background loop ----------------------------------------------------------------------

    async def _run(self) -> None:
        await self._guarded(self._replay_if_due(force=True, probe=True))  # a previous process's spool
        while True:
            batch = await self._next_batch()
            if batch:
                await self._guarded(self._handle_batch(batch))
            if self._closing and (not self._queue or self._stuck):
                break
            await self._guarded(self._replay_if_due())
        # Last chance to leave an empty spool behind: ignore the backoff timer once.
        await self._guarded(self._replay_if_due(force=True))
        self._stuck = False
        while self._queue and self._db.up and not self._stuck:  # the database is back for the rows the spool refused
            await self._guarded(self._handle_batch(await self._next_batch()))

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
        if not self.spool.pending and self._db.up:
            return None
        if not self._db.up:
            return max(0.01, self._db.retry_at - time.monotonic())
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
        if not self._db.up and self._flush_target > self._flush_probed:
            # Someone waits on flush(): ask the database now rather than at the backoff's end, so a blip
            # that has passed (or a start-up probe that lost a race) does not send a flush to the spool.
            self._flush_probed = self._flush_target
            await self._probe()
        if self._db.up:
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
            return
        # Neither the database nor the disk took them: keep them in memory (the queue's bound applies to
        # new rows) and try again shortly; at shutdown, close() counts what is left as lost.
        self._queue.extendleft(reversed(batch))
        QUEUE_DEPTH.inc(len(batch))
        if self._closing:
            self._stuck = True
        else:
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
        if self._db.mark_down(exc, self.spool_path):
            self.stats.outages += 1

    # ---- database -----------------------------------------------------------------------------

    async def _insert_rows(self, rows: list[dict[str, Any]]) -> int:
        """Make the rows storable, insert them (conflicts ignored); returns rows actually inserted.

        Raises _Outage for anything that is not the rows' fault. A batch the database refuses for its
        contents is bisected, so the good rows land and only the refused ones go to the quarantine.
        """
        return await self._insert_or_bisect(sanitize.safe_rows(self.table, rows, self.key_column))

    async def _insert_or_bisect(self, rows: list[dict[str, Any]]) -> int:
        assert self._engine is not None
        started = time.perf_counter()
        try:
            async with self._engine.begin() as conn:
                result = await conn.execute(self._insert, rows)
                inserted = len(result.all())
        except Exception as exc:  # classified below
            if not is_row_error(exc):
                raise _Outage(f"{type(exc).__name__}: {exc}") from exc
            if len(rows) == 1:
                self._set_aside([{"row": rows[0]}], f"database refused the row: {_first_line(exc)}")
                return 0
            mid = len(rows) // 2
            return await self._insert_or_bisect(rows[:mid]) + await self._insert_or_bisect(rows[mid:])
        self.stats.batches += 1
        BATCH_SECONDS.observe(time.perf_counter() - started)
        return inserted

    def _set_aside(self, entries: list[dict[str, Any]], reason: str) -> None:
        """Quarantine rows that can never be written as they are; if even that fails, they are lost (loudly)."""
        try:
            self.quarantine.add(entries, reason)
        except OSError as exc:
            self._lose([e.get("row", e.get("line")) for e in entries], f"{reason}; quarantine unwritable: {exc}")
            return
        self.stats.rejected += len(entries)

    def _lose(self, rows: list[Any], why: str) -> None:
        """The last resort: the row's values go to the log at CRITICAL, and the loss is counted."""
        self.stats.lost += len(rows)
        ROWS_LOST.inc(len(rows))
        self._lost_log(logging.CRITICAL, "ledger rows LOST (%s): %d so far in this process, see each one below "
                       "(switchyard_ledger_rows_lost counts them)", why, self.stats.lost)
        for row in rows:
            with contextlib.suppress(Exception):
                values = row.to_row() if isinstance(row, SpoolRecord) else row
                log.critical("ledger row lost: %s", _loggable(values) if isinstance(values, dict) else values)

    async def _probe(self) -> bool:
        """Does the database answer? Marks it up or down (a failure's reason goes to the outage log line)."""
        assert self._engine is not None
        try:
            async with self._engine.connect() as conn:
                await conn.execute(text("SELECT 1"))
        except Exception as exc:  # noqa: BLE001 - any failure means "still down"
            self._mark_down(_Outage(f"probe failed: {type(exc).__name__}: {_first_line(exc)}"))
            return False
        self._db.mark_up()
        return True

    # ---- spool --------------------------------------------------------------------------------

    def _spool_now(self, record: LedgerRecord, reason: str) -> bool:
        """Synchronous spool append for rows that cannot be queued (fsync'd later by flush/close)."""
        try:
            line = json.dumps(record.to_json(), default=str) + "\n"
        except Exception as exc:  # noqa: BLE001 - e.g. created_at that is not a datetime
            self._set_aside([{"line": repr(record)}], f"unserializable record: {exc!r}")
            return True
        try:
            # after close(): no background task will fsync, so do it now
            self.spool.write(line.encode(), fsync=self._closed, keep_open=not self._closed)
        except Exception as exc:  # noqa: BLE001 - never raise into the request path
            self.spool.failed(exc, "a row that did not fit the in-memory queue could not be spooled")
            return False
        self.spool.unsynced = not self._closed
        self.stats.spooled += 1
        ROWS_SPOOLED.labels(reason).inc()
        return True

    def _serialize(self, batch: list[LedgerRecord]) -> bytes:
        """JSONL for the spool. A record too malformed to serialize is quarantined and removed from `batch`
        (in place: the caller keeps or counts only the rest), so it is never retried."""
        lines, good, bad = [], [], []
        for r in batch:
            try:
                lines.append(json.dumps(r.to_json(), default=str) + "\n")
                good.append(r)
            except Exception as exc:  # noqa: BLE001 - e.g. created_at that is not a datetime
                bad.append({"error": f"unserializable record: {exc!r}", "line": repr(r)})
        if bad:
            self._set_aside(bad, "malformed record")
            batch[:] = good
        return "".join(lines).encode()

    async def _spool_batch(self, batch: list[LedgerRecord], reason: str) -> bool:
        """fsync'd append of `batch` to the spool (malformed records leave `batch`, handled, in the quarantine)."""
        n = len(batch)
        try:
            data = await asyncio.to_thread(self._serialize, batch)
            self._mark_handled(n - len(batch))
            await asyncio.to_thread(self.spool.write, data, fsync=True)
        except Exception as exc:  # noqa: BLE001 - the caller keeps the rows in memory
            self.spool.failed(exc, f"{len(batch)} rows kept in memory")
            return False
        self.stats.spooled += len(batch)
        ROWS_SPOOLED.labels(reason).inc(len(batch))
        return True

    async def _spool_queue_directly(self, timeout_s: float | None = None) -> None:
        batch = list(self._queue)
        self._queue.clear()
        QUEUE_DEPTH.dec(len(batch))
        if not batch:
            return
        try:
            spooled = await asyncio.wait_for(self._spool_batch(batch, "closed"), timeout_s)
        except TimeoutError:
            spooled = False
        if not spooled and batch:
            self._lose(batch, "shutting down with the database and the spool both unavailable")
        self._mark_handled(len(batch))

    async def _replay_if_due(self, *, force: bool = False, probe: bool = False) -> None:
        if not force and self._db.waiting():
            return
        if not self.spool.pending:
            if not self._db.up or probe:  # probe: learn at start whether the database answers
                await self._probe()
            return
        if self._db.up and not force and (len(self._queue) >= self.batch_size
                                          or time.monotonic() < self.spool.replay_at):
            return  # busy: live rows first, the spool when there is slack (or its disk fails: later)
        try:
            await self.spool.replay(self._insert_replayed, self._set_aside, self.batch_size)
        except _Outage as exc:
            self._mark_down(exc)
        except OSError as exc:  # the spool's files: unreadable, or the lock not ours; try again later
            self.spool.failed(exc, "replay postponed")
            self.spool.replay_at = time.monotonic() + self._db.retry_max_s
            await self._probe()  # live rows need not wait for the spool's disk
        else:
            self._db.mark_up()

    async def _insert_replayed(self, rows: list[dict[str, Any]]) -> None:
        """One chunk of a spool's replay into the database (raises _Outage)."""
        inserted = await self._insert_rows(rows)
        self.stats.replayed += inserted
        self.stats.duplicates += len(rows) - inserted
        ROWS_WRITTEN.labels("replay").inc(inserted)


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:500]


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
