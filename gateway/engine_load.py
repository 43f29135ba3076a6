"""How loaded each in-house engine is, read from its Prometheus /metrics in the background.

The router asks `EngineLoadMonitor.get(name)` on the request path; that is a dict lookup and a clock read.
A background task scrapes every engine backend's `/metrics` (its api_base without `/v1`) every
`interval_s` and keeps one `EngineLoad` per engine: queue length, running batch, KV usage, busy fraction,
and the time-to-first-token percentiles of the requests that finished in the last `ttft_window_s` (from
the difference of two histogram snapshots, as Prometheus' histogram_quantile over a rate). An engine that
does not answer, or whose last answer is older than `stale_after_s`, reads `UNKNOWN`: routing then
ignores load and the fallback chain handles a dead engine.

A foreign engine (`engine_type:` in the policy) has none of our metrics. llama.cpp's server: `/metrics`
only with `--metrics` (`llamacpp:requests_processing` / `requests_deferred` as running / waiting), else
`/health` for liveness alone; its busy time comes from the gateway's own count (gateway/backends/llamacpp.py,
`busy_seconds`), not from the engine.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from prometheus_client import Counter, Gauge

from gateway.backends.llamacpp import HEALTH_PATH, engine_root
from gateway.backends.llamacpp import parse_metrics as parse_llamacpp_metrics
from gateway.engine_scrape import ForeignEngines, Scrape
from gateway.tasks import cancel_and_wait
from gateway.uptime import DevicePrice, UptimeRecorder

log = logging.getLogger("switchyard.engine_load")

SCRAPE_FAILURES = Counter("switchyard_engine_load_scrape_failures", "Failed scrapes of an engine's /metrics",
                          ["backend"])
# vLLM / SGLang backends (gateway/engine_scrape.py): device time handed to ledger rows, and busy time no row of
# ours claimed (another client's work on the engine); their sum is the engine's busy time.
ATTRIBUTED = Gauge("switchyard_engine_attributed_seconds", "Device-seconds attributed to this gateway's requests "
                   "on a vLLM / SGLang backend since the gateway started", ["backend"])
UNATTRIBUTED = Gauge("switchyard_engine_unattributed_seconds", "Busy seconds of a vLLM / SGLang backend that no "
                     "request of this gateway claimed since the gateway started", ["backend"])

_P = "switchyard_engine_"
_TTFT_BUCKET = _P + "time_to_first_token_seconds_bucket"
_DEVICE_INFO = _P + "device_info{"


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One engine's load as last scraped; every field is None when unknown."""

    known: bool
    waiting: int | None = None
    running: int | None = None
    kv_usage: float | None = None  # KV blocks used / total, 0..1
    busy: float | None = None  # the engine's busy fraction, 0..1
    ttft_p50_ms: float | None = None  # of requests finished in the recent window; None when none did
    ttft_p95_ms: float | None = None
    observed_at: float = 0.0  # time.monotonic() of the scrape


UNKNOWN = EngineLoad(known=False)


def metrics_url(api_base: str) -> str:
    """http://host:port/v1 → http://host:port/metrics (the engine serves both at its root)."""
    base = api_base.rstrip("/")
    return base.removesuffix("/v1") + "/metrics"


def parse_samples(text: str) -> tuple[dict[str, float], list[tuple[float, float]]]:
    """Unlabelled samples by name, and the TTFT histogram as (upper bound, cumulative count) pairs."""
    values: dict[str, float] = {}
    buckets: list[tuple[float, float]] = []
    for line in text.splitlines():
        if not line.startswith(_P):
            continue
        key, _, raw = line.rpartition(" ")
        try:
            value = float(raw)
        except ValueError:
            continue
        if key.startswith(_TTFT_BUCKET + "{"):
            le = key.partition('le="')[2].partition('"')[0]
            buckets.append((math.inf if le == "+Inf" else float(le), value))
        elif "{" not in key:
            values[key] = value
    buckets.sort()
    return values, buckets


def reported_device_kind(text: str) -> str | None:
    """The `kind` label of the engine's switchyard_engine_device_info sample (cpu | gpu), None if absent."""
    start = text.find(_DEVICE_INFO)
    if start < 0:
        return None
    labels = text[start + len(_DEVICE_INFO):text.find("}", start)]
    kind = labels.partition('kind="')[2].partition('"')[0]
    return kind if kind in ("cpu", "gpu") else None


def histogram_quantile(q: float, bounds: tuple[float, ...], counts: tuple[float, ...]) -> float | None:
    """The q-quantile of cumulative bucket counts, interpolating linearly inside the bucket (None if empty)."""
    if not counts or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    lower, below = 0.0, 0.0
    for bound, cum in zip(bounds, counts, strict=True):
        if cum >= rank:
            if math.isinf(bound):  # in the overflow bucket: the largest finite bound is all we know
                return lower
            inside = cum - below
            return lower + (bound - lower) * ((rank - below) / inside if inside > 0 else 1.0)
        lower, below = bound, cum
    return lower


class _Engine:
    """Scrape state of one engine: its URL, the latest load, and recent TTFT histogram snapshots."""

    __slots__ = ("busy", "device_kind", "engine_type", "failed", "has_metrics", "history", "load", "url")

    def __init__(self, url: str, engine_type: str = "switchyard", busy: Callable[[], float] | None = None) -> None:
        self.url = url
        self.engine_type = engine_type
        self.busy = busy  # foreign engines: the gateway's own cumulative busy seconds for engine_uptime
        self.has_metrics: bool | None = None  # llama.cpp: whether it serves /metrics (started with --metrics)
        self.failed = False  # the last scrape failed (a foreign engine's next success counts as a new process)
        self.load = UNKNOWN
        self.device_kind: str | None = None  # what the engine says it runs on (cpu | gpu); kept when stale
        self.history: deque[tuple[float, tuple[float, ...]]] = deque()

    def update(self, text: str, now: float, window_s: float) -> dict[str, float]:
        """Parse one scrape into `load`; returns its unlabelled samples."""
        values, buckets = parse_samples(text)
        self.device_kind = reported_device_kind(text) or self.device_kind
        bounds = tuple(b for b, _ in buckets)
        counts = tuple(c for _, c in buckets)
        if self.history and (len(self.history[-1][1]) != len(counts)
                             or any(c < p for c, p in zip(counts, self.history[-1][1], strict=True))):
            self.history.clear()  # the engine restarted: its counters began again
        self.history.append((now, counts))
        # Keep one snapshot at or before the window's start as the baseline.
        while len(self.history) >= 2 and self.history[1][0] <= now - window_s:
            self.history.popleft()
        p50 = p95 = None
        if counts and len(self.history) >= 2:
            base = self.history[0][1]
            delta = tuple(c - b for c, b in zip(counts, base, strict=True))
            p50, p95 = histogram_quantile(0.5, bounds, delta), histogram_quantile(0.95, bounds, delta)
        total = values.get(_P + "kv_blocks_total")
        used = values.get(_P + "kv_blocks_used")
        waiting = values.get(_P + "requests_waiting")
        running = values.get(_P + "requests_running")
        self.load = EngineLoad(
            known=True,
            waiting=None if waiting is None else int(waiting),
            running=None if running is None else int(running),
            kv_usage=used / total if used is not None and total else None,
            busy=values.get(_P + "busy_fraction"),
            ttft_p50_ms=None if p50 is None else p50 * 1000,
            ttft_p95_ms=None if p95 is None else p95 * 1000,
            observed_at=now,
        )
        return values


class EngineLoadMonitor:
    def __init__(self, interval_s: float = 0.5, ttft_window_s: float = 30.0, stale_after_s: float = 3.0,
                 timeout_s: float = 1.0, uptime: UptimeRecorder | None = None) -> None:
        self.interval_s = interval_s
        self.uptime = uptime  # records each engine's up and busy time from the same scrapes
        self.ttft_window_s = ttft_window_s
        self.stale_after_s = stale_after_s
        self.timeout_s = timeout_s
        self._engines: dict[str, _Engine] = {}
        self._client: httpx.AsyncClient | None = None
        self._task: asyncio.Task | None = None
        # vLLM / SGLang backends: their own metric names, and device time split over our requests (engine_scrape)
        self.foreign = ForeignEngines()

    def get(self, name: str) -> EngineLoad:
        """The engine's latest load, or UNKNOWN (never scraped, not answering, or stale). Request path: cheap."""
        engine = self._engines.get(name)
        if engine is None:
            return UNKNOWN
        load = engine.load
        if not load.known or time.monotonic() - load.observed_at > self.stale_after_s:
            return UNKNOWN
        return load

    def device_kind(self, name: str) -> str | None:
        """The device kind the engine reported on its last successful scrape (None: not reported yet)."""
        engine = self._engines.get(name)
        return engine.device_kind if engine is not None else None

    def configure(self, targets: dict[str, str], prices: dict[str, DevicePrice] | None = None,
                  engine_types: dict[str, str] | None = None,
                  busy: dict[str, Callable[[], float]] | None = None) -> None:
        """Scrape exactly these engines ({backend name: api_base}); starts the background task once.

        `prices`: what each engine costs, for the uptime recorder's rows (engines without one are not
        recorded). `engine_types`: each engine's policy `engine_type` (default switchyard). `busy`: for an
        engine that does not count its own busy time, the gateway's count of it (cumulative seconds)."""
        self.foreign.configure({n: t for n, t in (engine_types or {}).items() if n in targets})
        if self.uptime is not None:
            self.uptime.set_prices({n: p for n, p in (prices or {}).items() if n in targets})
        engines = {}
        for name, api_base in targets.items():
            url = metrics_url(api_base)
            kind = (engine_types or {}).get(name, "switchyard")
            counter = (busy or {}).get(name)
            current = self._engines.get(name)
            same = current is not None and current.url == url and current.engine_type == kind
            engines[name] = current if same else _Engine(url, kind, counter)
            engines[name].busy = counter
        self._engines = engines
        if engines and self._task is None:
            self._task = asyncio.create_task(self._run(), name="engine-load")

    async def scrape_once(self) -> None:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout_s)
        await asyncio.gather(*(self._scrape(name, e) for name, e in list(self._engines.items())))

    async def _scrape(self, name: str, engine: _Engine) -> None:
        assert self._client is not None
        if engine.engine_type == "llamacpp":
            await self._scrape_llamacpp(name, engine)
            return
        try:
            fetched_at = time.monotonic()
            response = await self._client.get(engine.url)
            response.raise_for_status()
            if self.foreign.handles(name):
                self._foreign_scraped(name, engine, response.text, fetched_at)
                return
            values = engine.update(response.text, time.monotonic(), self.ttft_window_s)
            if self.uptime is not None:
                if engine.device_kind is not None:
                    self.uptime.set_kind(name, engine.device_kind)
                self.uptime.observe(name, values.get(_P + "busy_seconds_total"),
                                    started_at=values.get(_P + "busy_seconds_created"))
        except (httpx.HTTPError, ValueError) as exc:
            if engine.load.known:
                log.info("engine %s load unknown (%s: %s)", name, type(exc).__name__, exc)
            engine.load = UNKNOWN
            SCRAPE_FAILURES.labels(name).inc()

    async def _scrape_llamacpp(self, name: str, engine: _Engine) -> None:
        """llama-server: load from its `llamacpp:` metrics when it serves them, else liveness from /health."""
        assert self._client is not None
        values: dict[str, float] = {}
        try:
            if engine.has_metrics is not False:
                response = await self._client.get(engine.url)
                if response.status_code in (404, 501):  # 501: started without --metrics
                    engine.has_metrics = False
                else:
                    response.raise_for_status()
                    engine.has_metrics = True
                    values = parse_llamacpp_metrics(response.text)
            if engine.has_metrics is False:
                (await self._client.get(engine_root(engine.url.removesuffix("/metrics")) + HEALTH_PATH)
                 ).raise_for_status()
        except httpx.HTTPError as exc:
            if engine.load.known:
                log.info("engine %s load unknown (%s: %s)", name, type(exc).__name__, exc)
            engine.load, engine.failed = UNKNOWN, True
            SCRAPE_FAILURES.labels(name).inc()
            return
        running, waiting = values.get("requests_processing"), values.get("requests_deferred")
        engine.load = EngineLoad(known=True, running=None if running is None else int(running),
                                 waiting=None if waiting is None else int(waiting), observed_at=time.monotonic())
        if self.uptime is not None and engine.busy is not None:
            # A failed check in between: the server may have restarted (our counter would not show it).
            self.uptime.observe(name, engine.busy(), new_process=engine.failed)
        engine.failed = False

    def _foreign_scraped(self, name: str, engine: _Engine, text: str, fetched_at: float) -> None:
        """A vLLM / SGLang engine's metrics: its load from its own gauges; its busy time, from engine_scrape's
        attribution (which settles the ledger rows waiting for it), into the uptime rows."""
        now = time.monotonic()
        scrape: Scrape = self.foreign.observe(name, text, fetched_at, now)
        attribution = self.foreign.get(name)
        engine.load = EngineLoad(
            known=True,
            waiting=None if scrape.waiting is None else int(scrape.waiting),
            running=None if scrape.running is None else int(scrape.running),
            kv_usage=scrape.kv_usage, busy=attribution.utilisation if attribution else None, observed_at=now)
        if attribution is not None:
            ATTRIBUTED.labels(name).set(attribution.attributed_s)
            UNATTRIBUTED.labels(name).set(attribution.unattributed_s)
        if self.uptime is not None and attribution is not None:
            self.uptime.observe(name, attribution.busy_total_s, started_at=scrape.created)

    async def _run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.scrape_once()
                self.foreign.expire(time.monotonic())
            except Exception:  # keep scraping whatever happens; routing just sees UNKNOWN
                log.exception("engine load scrape failed")
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    async def aclose(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        self.foreign.flush()  # rows still waiting for a scrape keep their estimates
        if self.uptime is not None:
            self.uptime.flush()
        if self._client is not None:
            await self._client.aclose()
            self._client = None
