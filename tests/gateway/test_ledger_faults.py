"""Issue 30, item 8 (the ledger's faults) and defect 11 (bounded shutdown), against real PostgreSQL behind a
TCP proxy the test owns and real file systems: a tmpfs mounted read-only, a 64 KiB tmpfs that fills up.

In each fault the writer must never raise into or block the request path (`submit`), must keep rows in
memory up to its bound, count and log (CRITICAL, with the values) any row it cannot keep, and recover by
itself; `close()` finishes within 10 s whatever is broken.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from gateway.db import upgrade
from gateway.ledger.writer import ROWS_LOST, LedgerWriter
from tests.gateway.test_ledger_outage import _produce, _proxy_to
from tests.gateway.test_ledger_writer import assert_exactly_once, make_record, request_id_counts


@contextmanager
def tmpfs(path: Path, size: str = "64k") -> Iterator[Path]:
    """A real tmpfs of `size` at `path` (root, or CAP_SYS_ADMIN, is needed to mount one)."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def remount_read_only(path: Path) -> None:
    """What the kernel does to a file system after an I/O error (errors=remount-ro); mount refuses while a
    file is open for writing, so this is for a directory before the writer opens anything in it."""
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)


def fill(path: Path) -> None:
    """Take every free byte of the file system at `path` (the writer's files stay open, as on a real disk)."""
    fd = os.open(path / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == 28  # ENOSPC
    finally:
        os.close(fd)


def lost_ids(caplog) -> set[str]:
    return {json.loads(r.getMessage().split(": ", 1)[1])["request_id"] for r in caplog.records
            if r.levelno == logging.CRITICAL and r.getMessage().startswith("ledger row lost: ")}


def submit_timed(writer: LedgerWriter, ids: list[str], prefix: str, n: int) -> float:
    """Submit n rows (no await in between, like a burst of finishing requests); the slowest submit in s."""
    worst = 0.0
    for i in range(n):
        rec = make_record(len(ids), prefix=prefix)
        ids.append(rec.request_id)
        started = time.perf_counter()
        writer.submit(rec)
        worst = max(worst, time.perf_counter() - started)
    return worst


async def wait_until(predicate, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_spool_directory_read_only_rows_stay_in_memory_and_loss_is_counted(
        pg_url: str, tmp_path: Path, caplog) -> None:
    upgrade(pg_url)
    proxy = await _proxy_to(pg_url)
    caplog.set_level(logging.WARNING, logger="switchyard.ledger")
    with tmpfs(tmp_path / "spool") as spool_dir:
        remount_read_only(spool_dir)
        writer = LedgerWriter(proxy.url_for(pg_url), spool_dir / "spool.jsonl", max_queue=100, batch_size=20,
                              flush_interval_s=0.02, retry_initial_s=0.05, retry_max_s=0.2)
        await writer.start()  # a read-only spool directory does not stop the gateway
        ids: list[str] = []
        submit_timed(writer, ids, "ro", 50)
        await writer.flush()
        assert sum(request_id_counts(pg_url).values()) == 50  # the database takes rows as usual
        assert writer.health()["status"] == "ok" and "Read-only" in writer.health()["spool_error"]

        await proxy.cut()  # now the database goes too: nowhere to put rows but memory
        lost_before = ROWS_LOST._value.get()
        worst = 0.0
        for _ in range(6):
            worst = max(worst, submit_timed(writer, ids, "ro", 50))
            await asyncio.sleep(0.1)
        health = writer.health()
        assert worst < 0.05, f"a submit took {worst:.3f} s"
        assert writer.queue_depth <= writer.max_queue + writer.batch_size
        assert health["status"] == "degraded" and not health["database"] and health["lost"] > 0
        assert writer.stats.lost == ROWS_LOST._value.get() - lost_before == health["lost"]

        await proxy.restore()
        await wait_until(lambda: writer.queue_depth == 0 and writer.db_available)
        await writer.close()
    in_db = set(request_id_counts(pg_url))
    lost = lost_ids(caplog)
    assert len(lost) == writer.stats.lost and not in_db & lost
    assert in_db | lost == set(ids)  # every row is in the database or, counted, in the log
    assert len(in_db) >= 50 + writer.max_queue
    assert writer.health()["status"] == "ok"
    await proxy.cut()


async def test_disk_full_during_an_outage_leaves_no_torn_line_and_every_row_is_accounted(
        pg_url: str, tmp_path: Path, caplog) -> None:
    upgrade(pg_url)
    proxy = await _proxy_to(pg_url)
    caplog.set_level(logging.WARNING, logger="switchyard.ledger")
    with tmpfs(tmp_path / "spool", "64k") as spool_dir:
        spool = spool_dir / "spool.jsonl"
        writer = LedgerWriter(proxy.url_for(pg_url), spool, max_queue=100, batch_size=25, flush_interval_s=0.02,
                              retry_initial_s=0.05, retry_max_s=0.2)
        await writer.start()
        await proxy.cut()
        ids: list[str] = []
        worst = 0.0
        for _ in range(10):  # ~1,000 rows of ~700 bytes: the 64 KiB spool holds under a tenth of them
            worst = max(worst, submit_timed(writer, ids, "full", 100))
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        health = writer.health()
        assert worst < 0.05, f"a submit took {worst:.3f} s"
        assert health["status"] == "degraded" and 0 < health["spool_rows"] < 200
        assert "No space left" in health["spool_error"] and health["lost"] > 0
        lines = [line for path in (writer.replay_path, spool) if path.exists()
                 for line in path.read_text().splitlines()]
        assert len(lines) == health["spool_rows"]
        assert all(json.loads(line)["request_id"].startswith("full-") for line in lines)  # no torn line

        await proxy.restore()  # the spool replays (freeing the disk), the rows in memory land
        await wait_until(lambda: writer.health()["status"] == "ok")
        await writer.close()
        assert not spool.exists() and not writer.replay_path.exists()
    in_db = set(request_id_counts(pg_url))
    lost = lost_ids(caplog)
    assert len(lost) == writer.stats.lost and not in_db & lost and in_db | lost == set(ids)
    assert_exactly_once(pg_url, in_db)
    await proxy.cut()


async def test_database_blocked_then_restarted_under_load(pg_url: str, tmp_path: Path) -> None:
    """The server stops answering mid-load (a hung PostgreSQL), then restarts: /health says `degraded` while
    rows only reach the spool, requests are never held up, and afterwards every row is there exactly once."""
    upgrade(pg_url)
    proxy = await _proxy_to(pg_url)
    writer = LedgerWriter(proxy.url_for(pg_url), tmp_path / "spool.jsonl", max_queue=200, batch_size=32,
                          flush_interval_s=0.02, retry_initial_s=0.1, retry_max_s=0.5)
    await writer.start()
    ids: list[str] = []
    producers = [asyncio.create_task(_produce(writer, ids, "blk", k * 1000, 150, 3.0)) for k in range(10)]
    await asyncio.sleep(0.5)
    proxy.stall()  # the insert in flight hangs; new rows fill the queue, then overflow to the spool
    await asyncio.sleep(1.2)
    blocked = writer.health()
    assert blocked["status"] == "degraded" and blocked["spool_rows"] > 0 and blocked["spool_age_s"] > 0
    await proxy.cut()  # the restart: every connection dropped, the port closed for a moment
    await asyncio.sleep(0.3)
    proxy.unstall()
    await proxy.restore()
    await asyncio.gather(*producers)
    await wait_until(lambda: writer.health()["status"] == "ok")
    await writer.close()
    assert len(ids) == 1500
    assert_exactly_once(pg_url, set(ids))
    assert writer.stats.lost == 0 and writer.stats.rejected == 0 and writer.stats.replayed > 0
    await proxy.cut()


@pytest.mark.parametrize("database", ["refused", "black_holed"])
async def test_close_is_bounded_with_the_database_and_the_spool_both_gone(
        pg_url: str, tmp_path: Path, caplog, database: str) -> None:
    """Defect 11: with the database and the spool gone, shutdown took over 90 s; close() takes under 10 s."""
    upgrade(pg_url)
    proxy = await _proxy_to(pg_url)
    caplog.set_level(logging.WARNING, logger="switchyard.ledger")
    with tmpfs(tmp_path / "spool") as spool_dir:
        writer = LedgerWriter(proxy.url_for(pg_url), spool_dir / "spool.jsonl", max_queue=200, batch_size=50,
                              flush_interval_s=0.02)
        await writer.start()
        ids: list[str] = []
        submit_timed(writer, ids, "gone", 50)
        await writer.flush()
        fill(spool_dir)
        if database == "refused":
            await proxy.cut()
        else:
            proxy.stall()  # connections open, no byte answered, new connects hang too
        submit_timed(writer, ids, "gone", 300)
        await asyncio.sleep(0.3)
        started = time.monotonic()
        await asyncio.wait_for(writer.close(), 30)  # on the old code: 60 s per writer, then more
        took = time.monotonic() - started
        print(f"close() with the database {database} and the spool full: {took:.2f} s")
        assert took < 10, f"close() took {took:.1f} s"
    in_db = set(request_id_counts(pg_url))
    lost = lost_ids(caplog)
    assert len(in_db) == 50 and in_db | lost == set(ids) and len(lost) == writer.stats.lost == 300
    if database == "black_holed":
        proxy.unstall()
        await proxy.cut()


def test_tmpfs_helper_really_fills_and_locks(tmp_path: Path) -> None:
    """The faults above are real: the kernel answers ENOSPC and EROFS."""
    with tmpfs(tmp_path / "t", "64k") as d:
        with pytest.raises(OSError) as full:
            (d / "big").write_bytes(b"x" * 200_000)
        assert full.value.errno == 28  # ENOSPC
        remount_read_only(d)
        with pytest.raises(OSError) as ro:
            os.open(d / "new", os.O_WRONLY | os.O_CREAT)
        assert ro.value.errno == 30  # EROFS
