"""The quarantine: a JSONL file beside the spool (`<spool>.rejected`) for rows that can never be written as
they are — refused by the database for what they contain, too malformed to serialize, or torn in the spool
by a crash — each line with the reason, so that a person can look at them and nothing blocks the rows around
them. Every row set aside is counted (switchyard_ledger_rows_rejected) and logged at WARNING.

A line is {"at": ISO time, "table": name, "error": reason, "row": {...}} (or "line": the raw text when the
row could not be parsed). `row` has the column values as the writer tried them; `switchyard` reads nothing
back from this file.
"""
from __future__ import annotations

import json
import logging
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prometheus_client import Counter

log = logging.getLogger("switchyard.ledger")

ROWS_REJECTED = Counter("switchyard_ledger_rows_rejected",
                        "Ledger rows set aside in the quarantine file (<spool>.rejected) with the reason")


class Quarantine:
    def __init__(self, path: Path, table: str) -> None:
        self.path = path
        self.table = table
        self.rows = 0  # lines in the file, this process's and earlier ones' (counted at start)
        self.added = 0  # rows this process set aside

    def count_existing(self) -> None:
        """Count the lines earlier processes left (blocking: call it in a thread)."""
        try:
            with open(self.path, "rb") as f:
                self.rows = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
        except FileNotFoundError:
            self.rows = 0
        except OSError as exc:
            log.error("ledger quarantine %s unreadable: %s", self.path, exc)

    def add(self, entries: list[dict[str, Any]], reason: str) -> None:
        """Append entries (each has "row" or "line", may have its own "error"), fsync'd; raises OSError."""
        at = datetime.now(UTC).isoformat()
        lines = [json.dumps({"at": at, "table": self.table, "error": reason, **e}, default=str) + "\n"
                 for e in entries]
        data = "".join(lines).encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            except OSError:
                os.ftruncate(fd, size)  # no torn line left behind for the next append to run into
                raise
        finally:
            os.close(fd)
        self.rows += len(entries)
        self.added += len(entries)
        ROWS_REJECTED.inc(len(entries))
        log.warning("ledger: %d %s row(s) set aside in quarantine %s: %s", len(entries), self.table, self.path,
                    reason[:300])
