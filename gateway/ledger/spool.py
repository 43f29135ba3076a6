"""The ledger writer's disk spool: an append-only JSONL file for rows the database cannot take now, and its replay.

Appends are whole lines (a failed one is cut back, so a torn line never swallows the next row), fsync'd when the
writer says so. One process owns a spool (an flock on `<spool>.lock`). To replay, the spool is renamed to
`<spool>.replaying`, streamed into the database in chunks by the writer's insert, and only then deleted; a crash at
any point leaves a file that the next writer replays at start (replays are idempotent: the writer's INSERT skips
rows already there). `rows` and `age_s` are the spool's depth and age for /health and the metrics.
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
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

from gateway.ledger.record import SpoolRecord

log = logging.getLogger("switchyard.ledger")

# insert(rows) -> None: the writer's insert of one replayed chunk (raises its outage error to stop the replay)
Insert = Callable[[list[dict[str, Any]]], Awaitable[None]]
# set_aside(entries, reason): the writer's quarantine of lines that cannot be read back
SetAside = Callable[[list[dict[str, Any]], str], None]


class RateLimited:
    """Log a repeating failure once, then at most every `every_s` seconds with how often it happened."""

    def __init__(self, every_s: float = 30.0) -> None:
        self.every_s = every_s
        self._last = float("-inf")
        self._suppressed = 0

    def __call__(self, level: int, msg: str, *args: Any, exc_info: bool = False) -> None:
        now = time.monotonic()
        if now - self._last < self.every_s:
            self._suppressed += 1
            return
        if self._suppressed:
            msg += f" ({self._suppressed} more since the last report)"
        self._last, self._suppressed = now, 0
        log.log(level, msg, *args, exc_info=exc_info)


class Spool:
    def __init__(self, path: Path, record_type: type[SpoolRecord]) -> None:
        self.path = Path(path)
        self.replay_path = self.path.with_name(self.path.name + ".replaying")
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self.record_type = record_type  # what the JSON lines are read back as
        self.pending = self.path.exists() or self.replay_path.exists()  # rows may wait in a file
        self.unsynced = False  # lines appended without fsync (sync() fsyncs them)
        self.error: str | None = None  # the last spool failure, until a spool write or a replay succeeds
        self.replay_at = 0.0  # a replay that failed on the spool's own files waits until then (monotonic)
        self._lock = threading.Lock()  # the event loop (overflow) and a worker thread both append
        self._fd: int | None = None
        self._lock_fd: int | None = None
        self._log = RateLimited()
        # Rows in the spool file and in the file being replayed, and when the oldest of each was spooled (wall
        # time): what /health reports as the spool's depth and age.
        self._rows = 0
        self._since: float | None = None
        self._replay_rows = 0
        self._replay_done = 0
        self._replay_since: float | None = None

    @property
    def rows(self) -> int:
        """Rows waiting in the spool files (written there, not yet in the database)."""
        return self._rows + max(0, self._replay_rows - self._replay_done)

    @property
    def age_s(self) -> float:
        """Seconds since the oldest row still waiting in the spool was spooled (0 when none waits)."""
        if not self.rows:
            return 0.0
        since = [t for t in (self._since, self._replay_since) if t is not None]
        return max(0.0, time.time() - min(since)) if since else 0.0

    def failed(self, exc: BaseException, what: str) -> None:
        self.error = f"{type(exc).__name__}: {exc}"[:300]
        self._log(logging.ERROR, "ledger spool %s: %s (%s)", self.path, self.error, what)

    def take_lock(self) -> None:
        """One writer per spool file: a second process renaming the spool under us would lose rows."""
        if self._lock_fd is not None:
            return
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(
                f"ledger spool {self.path} is in use by another writer; give each gateway process "
                f"its own spool path") from None
        self._lock_fd = fd

    def count_existing(self) -> None:
        """Depth and age of spools left by an earlier process (blocking: run in a thread)."""
        for path in (self.replay_path, self.path):
            rows = _count_lines(path)
            if not rows:
                continue
            since = _first_row_time(path)
            if path == self.replay_path:
                self._replay_rows, self._replay_since = rows, since
            else:
                self._rows, self._since = rows, since

    def write(self, data: bytes, *, fsync: bool, keep_open: bool = True) -> None:
        """Append whole lines; on a failure (disk full, read-only) the file is cut back to where it was,
        so a torn line can never swallow the next row appended."""
        with self._lock:
            self.take_lock()
            if self._fd is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            fd = self._fd
            size = os.fstat(fd).st_size
            try:
                view = memoryview(data)
                while view:  # O_APPEND: each write lands at the end
                    view = view[os.write(fd, view):]
                if fsync:
                    os.fsync(fd)
            except OSError:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, size)
                raise
            finally:
                if not keep_open:
                    os.close(fd)
                    self._fd = None
            self.pending = True
            rows = data.count(b"\n")
            if rows and not self._rows:
                self._since = time.time()
            self._rows += rows
        self.error = None

    async def sync(self) -> None:
        """fsync what was appended without it (a failure is logged as loudly as a loss)."""
        if not self.unsynced:
            return
        self.unsynced = False

        def sync() -> None:
            with self._lock:
                if self._fd is not None:
                    os.fsync(self._fd)

        try:
            await asyncio.to_thread(sync)
        except OSError as exc:
            # Rows appended without fsync (queue overflow) may not have reached the disk; they cannot be
            # told apart any more. Say so as loudly as a loss.
            log.critical("ledger spool %s could not be fsync'd (%s): rows appended since the last fsync may be "
                         "lost", self.path, exc)
            self.failed(exc, "fsync failed")

    def close(self) -> None:
        """Close the spool file (appends after this open it for each line) and release the flock."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    # ---- replay -------------------------------------------------------------------------------

    async def replay(self, insert: Insert, set_aside: SetAside, chunk_rows: int) -> None:
        """Replay spool files through `insert` until none is left (what `insert` raises stops it, the file kept)."""
        for _ in range(8):  # bounded: overflow may keep refilling the spool under sustained load
            path = await asyncio.to_thread(self._rotate)
            if path is None:
                return
            total = 0
            self._replay_done = 0  # a replay cut short by an outage starts the file again
            # Streamed in chunks: a long outage can leave a spool far larger than memory should hold.
            f = await asyncio.to_thread(open, path, encoding="utf-8", errors="replace")
            try:
                while True:
                    chunk, bad = await asyncio.to_thread(self._read_chunk, f, chunk_rows)
                    if bad:
                        await asyncio.to_thread(set_aside, bad, "unreadable spool line")
                    if not chunk:
                        break
                    await insert(chunk)
                    total += len(chunk)
                    self._replay_done += len(chunk) + len(bad)
            finally:
                f.close()
            await asyncio.to_thread(self._finish_replay, path)
            log.info("ledger replayed %d spooled row(s) from %s", total, path)

    def _rotate(self) -> Path | None:
        """The file to replay next: a leftover .replaying file, else the spool renamed to it."""
        with self._lock:
            if self.replay_path.exists():
                return self.replay_path
            if not self.path.exists():
                self.pending = False
                self._rows, self._since = 0, None
                return None
            self.take_lock()  # another writer may own these files
            if self._fd is not None:
                os.fsync(self._fd)
                os.close(self._fd)
                self._fd = None
            if self.path.stat().st_size == 0:
                self.path.unlink()
                self.pending = False
                self._rows, self._since = 0, None
                return None
            os.replace(self.path, self.replay_path)
            self._replay_rows, self._replay_since, self._replay_done = self._rows, self._since, 0
            self._rows, self._since = 0, None
            _fsync_dir(self.path.parent)
            return self.replay_path

    def _read_chunk(self, f: TextIO, max_rows: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Up to max_rows rows from an open spool file ([] at the end), and the lines that could not be read."""
        rows: list[dict[str, Any]] = []
        bad: list[dict[str, Any]] = []
        while len(rows) < max_rows:
            line = f.readline()
            if not line:
                break
            if not line.strip():
                continue
            try:
                rows.append(self.record_type.from_json(json.loads(line)).to_row())
            except Exception as exc:  # noqa: BLE001 - e.g. a line torn by a crash mid-write
                bad.append({"error": f"unreadable spool line: {exc}", "line": line})
        return rows, bad

    def _finish_replay(self, path: Path) -> None:
        path.unlink()
        self._replay_rows, self._replay_since, self._replay_done = 0, None, 0
        _fsync_dir(path.parent)
        self.error = None  # the spool's directory works again


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _first_row_time(path: Path) -> float | None:
    """Wall time of the oldest row in a spool file: its first line's created_at, else the file's mtime."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            first = f.readline()
        return datetime.fromisoformat(json.loads(first)["created_at"]).timestamp()
    except Exception:  # noqa: BLE001 - a torn or foreign first line: the file's own time will do
        with contextlib.suppress(OSError):
            return path.stat().st_mtime
    return None


def _count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    except OSError:
        return 0
