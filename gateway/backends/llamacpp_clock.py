"""Device time of an engine that serves several requests at once, shared among them: llama.cpp's (`engine_type:
llamacpp`, gateway/backends/llamacpp.py).

llama-server reports each request's own span (`timings`: prompt_ms + predicted_ms, from the first prompt token
to the last generated one). With parallel slots those spans overlap — two requests decoded in one batch each
report the whole wall time — so their sum counts a busy second once per running request. Here a busy second is
split equally among the requests running in it, the rule our own engine applies to each batch step
(hosted/engine.py charges `elapsed / len(seqs)`): a request's device time is the integral of 1 / n(t) over its
span, where n(t) is the number of requests this gateway has in flight on the engine, at most its `slots`
(requests beyond them wait in llama-server's queue and use no device time). The sum over requests is then the
wall time in which the engine was working, and a request served alone is charged its whole span.

The same state gives the engine's busy time (wall time with a request in flight: the `engine_uptime` busy
seconds) and its busy fraction over a recent window (the ledger's `utilisation`). Both count this gateway's
requests only: an engine shared by several gateways is, to each, busy with that gateway's work alone.
"""
from __future__ import annotations

import bisect
import time
from collections.abc import Callable


class SharedBusyClock:
    """Piecewise-linear record of (shared time v, busy time b) against monotonic time, one point per change.

    dv/dt = 1 / min(n, slots) and db/dt = 1 while n > 0; both are 0 while idle. Points older than `horizon_s`
    are dropped (a request's span must end within it to be charged in full)."""

    __slots__ = ("_b", "_n", "_now", "_points", "_times", "_v", "created", "horizon_s", "slots")

    def __init__(self, *, horizon_s: float = 3600.0, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self.horizon_s = horizon_s
        self.slots: int | None = None  # the engine's parallel sequences (llama-server -np); None: unknown
        self.created = now()
        self._n = 0
        self._v = self._b = 0.0
        # (t, v, b, n): the state from t on, until the next point.
        self._points: list[tuple[float, float, float, int]] = [(self.created, 0.0, 0.0, 0)]
        self._times: list[float] = [self.created]

    @property
    def in_flight(self) -> int:
        return self._n

    def _rates(self, n: int) -> tuple[float, float]:
        if n <= 0:
            return 0.0, 0.0
        running = min(n, self.slots) if self.slots else n
        return 1.0 / running, 1.0

    def _values(self, t: float) -> tuple[float, float]:
        """(v, b) at time t (clamped to the recorded range)."""
        i = bisect.bisect_right(self._times, t) - 1
        if i < 0:
            i, t = 0, self._times[0]
        t0, v0, b0, n0 = self._points[i]
        dv, db = self._rates(n0)
        span = max(t - t0, 0.0)
        return v0 + span * dv, b0 + span * db

    def _change(self, n: int | None = None, slots: int | None = None) -> float:
        t = max(self._now(), self._times[-1])
        self._v, self._b = self._values(t)
        if n is not None:
            self._n = n
        if slots is not None:
            self.slots = slots
        if t == self._times[-1]:
            self._points[-1] = (t, self._v, self._b, self._n)
        else:
            self._points.append((t, self._v, self._b, self._n))
            self._times.append(t)
        if t - self._times[0] > 2 * self.horizon_s:  # trim in bulk: amortised O(1) per change
            keep = bisect.bisect_left(self._times, t - self.horizon_s) - 1
            if keep > 0:
                del self._points[:keep], self._times[:keep]
        return t

    def set_slots(self, slots: int) -> None:
        if slots >= 1 and slots != self.slots:
            self._change(slots=slots)

    def start(self) -> float:
        """A request was sent: returns the time (this clock's) it was sent."""
        return self._change(n=self._n + 1)

    def finish(self) -> None:
        """A request ended (answered, failed or abandoned)."""
        self._change(n=max(self._n - 1, 0))

    def now(self) -> float:
        return self._now()

    def share(self, sent_at: float, end: float, span_s: float) -> float:
        """The device seconds of a request in flight since `sent_at` whose engine-side span of `span_s` seconds
        ended at `end` (call before finish()): the integral of 1 / min(n, slots) over that span."""
        start = max(end - max(span_s, 0.0), sent_at)
        if end <= start:
            return 0.0
        return max(self._values(end)[0] - self._values(start)[0], 0.0)

    def busy_seconds(self, at: float | None = None) -> float:
        """Cumulative wall seconds with a request in flight (a counter: it never goes back)."""
        return self._values(self._now() if at is None else at)[1]

    def busy_fraction(self, window_s: float = 60.0) -> float:
        """Busy seconds / wall seconds over the last window_s (or since the clock began, if shorter)."""
        now = self._now()
        window = min(window_s, now - self.created)
        if window <= 0:
            return 0.0
        return max(0.0, min(1.0, (self._values(now)[1] - self._values(now - window)[1]) / window))
