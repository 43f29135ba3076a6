"""The token demand each engine backend sees from this gateway, and the replicas it needs (for autoscalers).

Fed once per served request from the request path's accounting (gateway/proxy.py `_charge`: the usage and the
time in system), per engine backend, over a sliding window (the backend's `autoscale.window_s`, default 60 s):

    prompt / output tokens per second   = tokens finished in the window ÷ window_s
    in-flight tokens                    = Σ tokens × seconds in system ÷ window_s   (Little's Law, L = λW, in tokens)
    desired replicas                    = `switchyard report capacity`'s devices for λ = output tokens/s

The last is gateway/reports/capacity.plan_capacity itself: the curve point is the largest measured concurrency
whose TTFT p95 meets `autoscale.p95_ttft_ms` (default the report's), and replicas = ceil(λ / (that point's
tokens/s × target utilisation)). One replica's capacity is `autoscale.capacity_tokens_per_s` when the policy
gives it (what the operator measured on their own engine and device at their TTFT target), else the packaged
curve (gateway/reports/bench_data.py: our engine on the CPU it was benchmarked on). No demand in the window: 0.

The denominator is always the whole window, so the first window after a start under-reads (autoscalers' own
stabilisation windows absorb that). Each gateway sees only its own share: with N gateways, sum the token rates
across them and divide by `switchyard_backend_replica_target_tokens_per_second` (docs/deploy.md) rather than
adding up per-gateway desired replicas. The gauges are computed when /metrics is read (prometheus_client's
set_function), so they fall as the window slides past the last request.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from gateway import metrics
from gateway.policy import AutoscaleSpec, BackendSpec
from gateway.reports.capacity import (
    DEFAULT_P95_TTFT_MS,
    DEFAULT_TARGET_UTILISATION,
    CapacityError,
    Curve,
    CurvePoint,
    choose_point,
    load_curve,
    plan_capacity,
)

log = logging.getLogger("switchyard.gateway.demand")

_DEFAULTS = AutoscaleSpec()


@dataclass(frozen=True, slots=True)
class Demand:
    """One backend's window, as the gauges export it."""

    prompt_tok_s: float
    output_tok_s: float
    in_flight_tokens: float
    requests: int
    mean_completion_tokens: float | None  # None: nothing finished in the window
    mean_seconds_in_system: float | None


@dataclass(slots=True)
class _Bucket:  # one second of finished requests
    second: int
    prompt: int = 0
    completion: int = 0
    requests: int = 0
    token_seconds: float = 0.0  # Σ (prompt + completion) × seconds in system
    seconds: float = 0.0  # Σ seconds in system


@dataclass(slots=True)
class _Backend:
    spec: BackendSpec  # the latest seen: a policy reload's autoscale settings apply from its next request
    buckets: deque[_Bucket] = field(default_factory=deque)
    warned: str | None = None  # the last capacity problem logged (once each)


def _settings(spec: BackendSpec) -> AutoscaleSpec:
    return spec.autoscale or _DEFAULTS


class DemandTracker:
    """Sliding-window token demand per engine backend. `observe` is O(1) amortised (one bucket a second)."""

    def __init__(self, clock=time.monotonic, export: bool = True) -> None:
        self._clock = clock
        self._export_gauges = export  # False: a tracker that only computes (the gauges stay the live one's)
        self._backends: dict[str, _Backend] = {}
        self._lock = threading.Lock()  # /metrics may be rendered off the event loop (a scrape thread)
        self._curve: Curve | None = None
        self._curve_error: str | None = None

    # ------------------------------------------------------------------ feeding

    def observe(self, spec: BackendSpec, prompt_tokens: int, completion_tokens: int, seconds: float) -> None:
        """One finished request on `spec` (engine backends only; others are ignored)."""
        if spec.kind != "engine":
            return
        now = self._clock()
        second = int(now)
        with self._lock:
            b = self._backends.get(spec.name)
            if b is None:
                b = self._backends[spec.name] = _Backend(spec)
                if self._export_gauges:
                    self._export(spec.name)
            b.spec = spec
            if not b.buckets or b.buckets[-1].second != second:
                b.buckets.append(_Bucket(second))
                self._expire(b, now)
            bucket = b.buckets[-1]
            bucket.prompt += prompt_tokens
            bucket.completion += completion_tokens
            bucket.requests += 1
            bucket.token_seconds += (prompt_tokens + completion_tokens) * seconds
            bucket.seconds += seconds

    def _expire(self, b: _Backend, now: float) -> None:
        oldest = now - _settings(b.spec).window_s
        while b.buckets and b.buckets[0].second + 1 <= oldest:
            b.buckets.popleft()

    # ------------------------------------------------------------------ reading

    def demand(self, backend: str) -> Demand:
        with self._lock:
            b = self._backends.get(backend)
            if b is None:
                return Demand(0.0, 0.0, 0.0, 0, None, None)
            self._expire(b, self._clock())
            window = _settings(b.spec).window_s
            p = sum(x.prompt for x in b.buckets)
            c = sum(x.completion for x in b.buckets)
            n = sum(x.requests for x in b.buckets)
            ts = sum(x.token_seconds for x in b.buckets)
            s = sum(x.seconds for x in b.buckets)
        return Demand(p / window, c / window, ts / window, n, c / n if n else None, s / n if n else None)

    def capacity(self, backend: str) -> tuple[Curve, float | None, float] | None:
        """(curve, TTFT target, utilisation) the backend is planned with; None when no curve can be had."""
        b = self._backends.get(backend)
        if b is None:
            return None
        a = _settings(b.spec)
        util = a.target_utilisation or DEFAULT_TARGET_UTILISATION
        if a.capacity_tokens_per_s is not None:
            # The operator's own figure, taken as measured at their TTFT target: a one-point curve. Its time in
            # system is what this gateway measures (Little's Law for sequences in flight; not used for replicas).
            w = self.demand(backend).mean_seconds_in_system or 1.0
            point = CurvePoint(1, a.capacity_tokens_per_s, None, w)
            return Curve((point,), f"policy: backends.{backend}.autoscale.capacity_tokens_per_s"), None, util
        curve = self._packaged_curve()
        if curve is None:
            return None
        return curve, a.p95_ttft_ms or DEFAULT_P95_TTFT_MS, util

    def _packaged_curve(self) -> Curve | None:
        if self._curve is None and self._curve_error is None:
            try:
                self._curve = load_curve()
            except CapacityError as e:
                self._curve_error = str(e)
                log.warning("desired replicas unavailable without autoscale.capacity_tokens_per_s: %s", e)
        return self._curve

    def desired_replicas(self, backend: str) -> float:
        """report capacity's devices for this backend's output tokens/s; 0 with no demand, NaN when it cannot
        be planned (no curve, or no curve point meets the TTFT target: logged once)."""
        d = self.demand(backend)
        if d.output_tok_s <= 0:
            return 0.0
        planned = self.capacity(backend)
        if planned is None:
            return math.nan
        curve, ttft, util = planned
        try:
            return float(plan_capacity(curve, d.output_tok_s, util, ttft, d.mean_completion_tokens).devices)
        except CapacityError as e:
            self._warn_once(backend, str(e))
            return math.nan

    def replica_target_tokens_per_s(self, backend: str) -> float:
        """Output tokens/s one replica is planned to carry: the chosen point's throughput × target utilisation."""
        planned = self.capacity(backend)
        if planned is None:
            return math.nan
        curve, ttft, util = planned
        try:
            return choose_point(curve.points, ttft).output_tok_s * util
        except CapacityError as e:
            self._warn_once(backend, str(e))
            return math.nan

    def _warn_once(self, backend: str, problem: str) -> None:
        b = self._backends.get(backend)
        if b is not None and b.warned != problem:
            b.warned = problem
            log.warning("backend %s: desired replicas unavailable: %s", backend, problem)

    # ------------------------------------------------------------------ exporting

    def _export(self, name: str) -> None:
        """The backend's gauges read this tracker whenever /metrics is rendered."""
        metrics.DEMAND_PROMPT_TOK_S.labels(name).set_function(lambda: self.demand(name).prompt_tok_s)
        metrics.DEMAND_OUTPUT_TOK_S.labels(name).set_function(lambda: self.demand(name).output_tok_s)
        metrics.DEMAND_IN_FLIGHT_TOKENS.labels(name).set_function(lambda: self.demand(name).in_flight_tokens)
        metrics.DESIRED_REPLICAS.labels(name).set_function(lambda: self.desired_replicas(name))
        metrics.REPLICA_TARGET_TOK_S.labels(name).set_function(lambda: self.replica_target_tokens_per_s(name))


TRACKER = DemandTracker()


def observe(spec: BackendSpec, prompt_tokens: int, completion_tokens: int, latency_ms: float | None) -> None:
    """The request path's hook (gateway/proxy.py `_charge`)."""
    TRACKER.observe(spec, prompt_tokens, completion_tokens, (latency_ms or 0.0) / 1000)
