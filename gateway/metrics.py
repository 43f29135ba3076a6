"""Prometheus metrics of the gateway's request path (served at /metrics)."""
from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter("switchyard_requests_total", "Requests by route, backend and status",
                   ["route", "backend", "status"])
AUTH_FAILURES = Counter("switchyard_auth_failures_total", "Requests rejected for a missing or bad key")
LATENCY = Histogram("switchyard_request_latency_seconds", "End-to-end request latency", ["route", "backend"],
                    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
TTFT = Histogram("switchyard_ttft_seconds", "Time to first token (streamed) or to the response", ["route", "backend"],
                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
TOKENS = Counter("switchyard_tokens_total", "Tokens by backend and kind (prompt, cached_prompt, completion)",
                 ["backend", "kind"])
COST = Counter("switchyard_cost_usd_total", "Cost in USD by backend and basis", ["backend", "basis"])
IN_FLIGHT = Gauge("switchyard_requests_in_flight", "Requests being served now")
BREAKER_STATE = Gauge("switchyard_backend_circuit_state", "Circuit breaker: 0 closed, 1 open, 2 half-open",
                      ["backend"])
BACKEND_UP = Gauge("switchyard_backend_up", "1 when the backend is up, 0 when down or its circuit is open "
                   "(as /health reports it)", ["backend"])
POLICY_INFO = Gauge("switchyard_policy_version_info", "The live policy version (value 1)", ["version"])
POLICY_RELOAD_ERRORS = Counter("switchyard_policy_reload_errors_total", "Policy file changes not taken "
                               "(reason: invalid, missing); the last good policy keeps serving", ["reason"])
POLICY_RELOAD_FAILING = Gauge("switchyard_policy_reload_failing", "1 while the policy file on disk is invalid "
                              "or missing (the live policy is older than the file), else 0")
ENGINE_RESTARTS = Counter("switchyard_embedded_engine_restarts_total", "Embedded engine restarts", ["backend"])
LOOP_LAG = Histogram("switchyard_event_loop_lag_seconds", "How late the event loop wakes a 0.25 s timer "
                     "(anything blocking the request path shows here)",
                     buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5))
# Token demand per engine backend, for autoscalers (gateway/demand.py sets them; read when /metrics is rendered)
DEMAND_PROMPT_TOK_S = Gauge("switchyard_backend_prompt_tokens_per_second", "Prompt tokens/s this gateway sent the "
                            "engine backend, over its autoscale window", ["backend"])
DEMAND_OUTPUT_TOK_S = Gauge("switchyard_backend_output_tokens_per_second", "Output tokens/s the engine backend "
                            "produced for this gateway, over its autoscale window", ["backend"])
DEMAND_IN_FLIGHT_TOKENS = Gauge("switchyard_backend_in_flight_tokens", "Tokens of this gateway's requests in the "
                                "engine backend, averaged over the window (Little's Law: sum of tokens x seconds "
                                "in system / window)", ["backend"])
DESIRED_REPLICAS = Gauge("switchyard_backend_desired_replicas", "Engine replicas this gateway's output tokens/s "
                         "needs at the TTFT target (`switchyard report capacity`'s devices; NaN: cannot plan)",
                         ["backend"])
REPLICA_TARGET_TOK_S = Gauge("switchyard_backend_replica_target_tokens_per_second", "Output tokens/s one replica "
                             "is planned to carry: measured capacity at the TTFT target x target utilisation",
                             ["backend"])


_CHILDREN: dict[tuple, Any] = {}
_MAX_CHILDREN = 10_000  # label values come from policy names and fixed sets; a bound all the same


def child(metric: Any, *labels: str) -> Any:
    """`metric.labels(*labels)`, remembered: prometheus_client validates the values and takes a lock on every
    labels() call (a few us each, seven a request); the request path asks for the same few children every time.
    Only for metrics that are never cleared (a cleared metric's remembered children would count unseen)."""
    key = (metric, labels)
    found = _CHILDREN.get(key)
    if found is None:
        if len(_CHILDREN) >= _MAX_CHILDREN:
            _CHILDREN.clear()
        found = _CHILDREN[key] = metric.labels(*labels)
    return found


class InFlight:
    """One request's place in switchyard_requests_in_flight: counted when made, uncounted by the first `end()`
    (later calls do nothing), so however a request ends it is counted out exactly once."""

    __slots__ = ("_ended",)

    def __init__(self) -> None:
        self._ended = False
        IN_FLIGHT.inc()

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            IN_FLIGHT.dec()


async def watch_loop_lag(interval_s: float = 0.25) -> None:
    import asyncio
    import time

    while True:
        start = time.perf_counter()
        await asyncio.sleep(interval_s)
        LOOP_LAG.observe(max(0.0, time.perf_counter() - start - interval_s))
