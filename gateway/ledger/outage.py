"""Is the ledger's database up, and when to ask it again: the writer's outage detection.

A failure that is not the rows' fault (gateway/ledger/failures.py) marks it down; while down, the writer asks
again (a probe, or the spool's replay) no sooner than `retry_at`, backing off exponentially from
`retry_initial_s` to `retry_max_s`; any success marks it up.
"""
from __future__ import annotations

import logging
import time

log = logging.getLogger("switchyard.ledger")


class DatabaseState:
    def __init__(self, retry_initial_s: float, retry_max_s: float) -> None:
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self.up = True
        self.retry_at = 0.0  # monotonic: while down, do not ask before this
        self._backoff = retry_initial_s

    def mark_down(self, exc: BaseException, spool: object) -> bool:
        """The database failed (`exc`); True when this starts an outage (it was up)."""
        started = self.up
        if started:
            log.warning("ledger database unavailable, spooling rows to %s: %s", spool, exc)
            self._backoff = self.retry_initial_s
        else:
            self._backoff = min(self._backoff * 2, self.retry_max_s)
        self.up = False
        self.retry_at = time.monotonic() + self._backoff
        return started

    def mark_up(self) -> None:
        if not self.up:
            log.warning("ledger database is back")
        self.up = True
        self._backoff = self.retry_initial_s

    def waiting(self) -> bool:
        """Down, and not yet time to ask again."""
        return not self.up and time.monotonic() < self.retry_at
