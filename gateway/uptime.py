"""Each engine's paid time versus busy time, measured from its own counters and recorded per minute.

An engine is paid for while it runs, busy or idle. The load monitor (gateway/engine_load.py) scrapes every
engine's /metrics a few times a second; each successful scrape hands this recorder the engine's
cumulative `switchyard_engine_busy_seconds_total`. Between two successful scrapes of the same process
(its counter did not go back) the engine was up for the wall time between them, failed scrapes in
between included, and busy for the counter's increase. A process seen for the first time (or again
after a restart) counts from its start, read from the counter's `_created` sample. An engine that never
answers again adds nothing after its last answer. The sums are cut into `interval_s` buckets of wall-clock
time and written as `engine_uptime` rows: the reports' paid device-hours, busy fraction and cost of idle
come from these rows, not from per-request estimates.
"""
from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from gateway.ledger.record import UptimeRecord


@dataclass(frozen=True, slots=True)
class DevicePrice:
    """What one engine backend costs: per hour for all its devices, how many, and of which kind."""

    hour_usd: float
    devices: int = 1
    kind: str = "gpu"


@dataclass(slots=True)
class _Interval:
    start: float  # wall-clock seconds of the bucket's start
    seconds: float = 0.0
    busy: float = 0.0


@dataclass(slots=True)
class _State:
    last_mono: float | None = None
    last_busy: float = 0.0
    interval: _Interval | None = None


class UptimeRecorder:
    def __init__(self, submit: Callable[[UptimeRecord], None], *, interval_s: float = 60.0,
                 max_gap_s: float = 5.0, max_backfill_s: float = 300.0, instance: str | None = None) -> None:
        self._submit = submit
        self.interval_s = interval_s
        self.max_gap_s = max_gap_s  # across a restart without a start time: what counts as up
        self.max_backfill_s = max_backfill_s  # a newly seen process: at most this much of its past
        self.instance = instance or uuid.uuid4().hex[:12]  # several gateways may scrape one engine
        self._prices: dict[str, DevicePrice] = {}
        self._states: dict[str, _State] = {}
        self._reported_kinds: dict[str, str] = {}  # what each engine said it runs on: survives policy reloads

    def set_prices(self, prices: dict[str, DevicePrice]) -> None:
        """The engines to record (policy changes): engines no longer listed have their time written out."""
        for name in list(self._states):
            if name not in prices:
                self._emit(name, self._states.pop(name))
        # A reload re-guesses each kind from the policy's price; an engine's own report still wins (else an
        # interval written between a reload and the next scrape would carry the guess).
        self._prices = {name: self._with_reported_kind(name, price) for name, price in prices.items()}

    def _with_reported_kind(self, backend: str, price: DevicePrice) -> DevicePrice:
        kind = self._reported_kinds.get(backend)
        return price if kind is None or kind == price.kind else DevicePrice(price.hour_usd, price.devices, kind)

    def set_kind(self, backend: str, kind: str) -> None:
        """The device kind the engine itself reports: it wins over the one guessed from the policy's price."""
        self._reported_kinds[backend] = kind
        price = self._prices.get(backend)
        if price is not None:
            self._prices[backend] = self._with_reported_kind(backend, price)

    def observe(self, backend: str, busy_total: float | None, *, started_at: float | None = None,
                mono: float | None = None, wall: float | None = None, new_process: bool = False) -> None:
        """A successful scrape of `backend` whose busy counter reads `busy_total` (None: engine too old).

        `started_at`: the counter's creation time (unix seconds, Prometheus' `_created` sample), i.e. when
        the engine process started; it lets the first scrape of a process count the time before it.
        `new_process`: the engine may have restarted although the counter did not go back (a foreign engine,
        whose busy time the gateway counts itself): the gap since the last scrape counts as up for at most
        max_gap_s, as across a restart."""
        if backend not in self._prices or busy_total is None or not math.isfinite(busy_total):
            return
        mono = time.monotonic() if mono is None else mono
        wall = time.time() if wall is None else wall
        state = self._states.setdefault(backend, _State())
        went_back = state.last_mono is not None and busy_total < state.last_busy
        restarted = went_back or (state.last_mono is not None and new_process)
        if state.last_mono is None or restarted:
            # A process seen for the first time: up since it started (bounded, so an engine that ran
            # long before this gateway does not land in one interval), busy for all its counter says.
            since = wall - started_at if started_at is not None and math.isfinite(started_at) else 0.0
            if restarted:
                since = min(since, mono - state.last_mono) if started_at is not None else self.max_gap_s
            up = min(max(since, 0.0), self.max_backfill_s)
            busy = busy_total - state.last_busy if restarted and not went_back else busy_total
        else:
            # The counter carried on: the same process ran through the gap, even if some scrapes timed
            # out (a busy engine answers slowly), and a running engine is paid for.
            up, busy = max(mono - state.last_mono, 0.0), busy_total - state.last_busy
        if up > 0:
            self._add(backend, state, wall, up, min(max(busy, 0.0), up))
        state.last_mono, state.last_busy = mono, busy_total

    def flush(self) -> None:
        """Write every open interval (at shutdown)."""
        for name, state in self._states.items():
            self._emit(name, state)

    def _add(self, backend: str, state: _State, wall: float, up: float, busy: float) -> None:
        start = math.floor(wall / self.interval_s) * self.interval_s
        if state.interval is not None and state.interval.start != start:
            self._emit(backend, state)
        if state.interval is None:
            state.interval = _Interval(start)
        state.interval.seconds += up
        state.interval.busy += busy

    def _emit(self, backend: str, state: _State) -> None:
        interval, state.interval = state.interval, None
        price = self._prices.get(backend)
        if interval is None or interval.seconds <= 0 or price is None:
            return
        started = datetime.fromtimestamp(interval.start, UTC)
        self._submit(UptimeRecord(
            interval_id=f"{backend}|{started.isoformat()}|{self.instance}", created_at=started, backend=backend,
            seconds=interval.seconds, busy_seconds=interval.busy, device_hour_usd=price.hour_usd,
            devices=price.devices, device_kind=price.kind))
