"""Where a request's time goes on the gateway: per-stage spans, for the overhead benchmark.

Off unless the environment sets SWITCHYARD_STAGE_PROFILE=1 at start-up: then an outermost ASGI middleware
opens a span list per /v1 request (a context variable, so the request path marks stages without passing
anything around), the request path calls `mark(stage)` as each stage ends, and the master key can read the
summary at GET /admin/stage-profile (`?reset=1` clears it; the benchmark reads and resets it per target).
Off, `mark` is one global lookup and a falsy test: the request path pays nothing measurable.

A stage's time runs from the previous mark (or the request's arrival at the edge) to its own. The stages of
a plain (non-streamed) request, in order:

    edge      ASGI entry (outermost middleware) to the route handler
    auth      the key lookup (a cache hit, normally)
    body      read, parse, validate, unknown-field check
    route     the prompt view, routing's decision (difficulty scoring), the route's checks
    reserve   the budget reservation
    admit     rate limits, shadow sampling
    send      from admission to the upstream request handed to the HTTP client (chain, breakers, encoding)
    upstream  the HTTP exchange as the gateway sees it: the upstream's own time plus the HTTP client's work
              (compare with the upstream measured directly)
    dispatch  the rest of the backend call: parsing the answer; on a backend without its own send/upstream
              marks (litellm's provider path) the whole call lands here
    finish    cost, ledger row queued, answer headers, the body encoded
    respond   the handler's return to the last body byte handed to the server

`overhead` = every stage but `upstream`. Times are kept per route (the requested model), in microseconds,
up to MAX_SAMPLES per (route, stage); the summary gives count, mean, p50, p90 and p99.
"""
from __future__ import annotations

import contextvars
import os
import time
from collections import defaultdict
from typing import Any

ENV = "SWITCHYARD_STAGE_PROFILE"
ENABLED = os.environ.get(ENV, "").strip() not in ("", "0", "false", "no")
MAX_SAMPLES = 200_000
UPSTREAM = "upstream"

_current: contextvars.ContextVar[_Spans | None] = contextvars.ContextVar("switchyard_stage_spans", default=None)


class _Spans:
    __slots__ = ("last", "route", "stages")

    def __init__(self, now: int) -> None:
        self.last = now
        self.route = "none"
        self.stages: list[tuple[str, int]] = []

    def mark(self, stage: str, now: int) -> None:
        self.stages.append((stage, now - self.last))
        self.last = now


class _Store:
    def __init__(self) -> None:
        self.samples: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
        self.requests: dict[str, int] = defaultdict(int)

    def add(self, spans: _Spans) -> None:
        by_stage = self.samples[spans.route]
        total = 0
        for stage, ns in spans.stages:
            bucket = by_stage[stage]
            if len(bucket) < MAX_SAMPLES:
                bucket.append(ns)
            if stage != UPSTREAM:
                total += ns
        overhead = by_stage["overhead"]
        if len(overhead) < MAX_SAMPLES:
            overhead.append(total)
        self.requests[spans.route] += 1

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for route, stages in self.samples.items():
            out[route] = {"requests": self.requests[route],
                          "stages_us": {stage: _describe(values) for stage, values in stages.items()}}
        return out

    def reset(self) -> None:
        self.samples.clear()
        self.requests.clear()


STORE = _Store()


def _describe(values: list[int]) -> dict[str, float]:
    ordered = sorted(values)
    n = len(ordered)

    def pct(q: float) -> float:
        return ordered[min(n - 1, int(q * n))] / 1000

    return {"count": n, "mean": sum(ordered) / n / 1000, "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99)}


def mark(stage: str) -> None:
    """End `stage` of the current request (a no-op when profiling is off or outside a profiled request)."""
    if ENABLED:
        spans = _current.get()
        if spans is not None:
            spans.mark(stage, time.perf_counter_ns())


def set_route(route: str) -> None:
    if ENABLED:
        spans = _current.get()
        if spans is not None:
            spans.route = route


class StageProfileMiddleware:
    """Outermost: opens the spans of each POST /v1 request, closes them ('respond') with its last body byte."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or not scope.get("path", "").startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        spans = _Spans(time.perf_counter_ns())
        token = _current.set(spans)
        spans_done = False

        async def send_and_time(message: dict) -> None:
            nonlocal spans_done
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False) and not spans_done:
                spans_done = True
                spans.mark("respond", time.perf_counter_ns())
                STORE.add(spans)

        try:
            await self.app(scope, receive, send_and_time)
        finally:
            _current.reset(token)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.app, name)  # the app it wraps: `.state` and the rest
