"""Retries with backoff, ordered fallbacks and per-backend circuit breakers.

A backend is tried with retries on retryable failures (408, 409, 429, 5xx, timeouts, connection errors);
when it gives up, the next backend in the route's chain is tried. 401/403/404 mean the backend is
misconfigured (key, model name): no retry there, but the next backend is tried. A bad request (any other
4xx, or one refused before it was sent) is returned at once without retry or fallback: the request is at
fault, not the backend, and would fail everywhere. A circuit breaker per backend stops sending traffic
after `failure_threshold` consecutive failures, then lets one probe through after `cooldown_s`; only
connection failures, timeouts, malformed answers and 5xx count as failures (`counts_against_backend`) —
a client's bad request, our bad key and an upstream's "busy" (409/429) never open it.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from enum import IntEnum
from typing import TYPE_CHECKING, TypeVar

from gateway.backends import translate
from gateway.backends.base import Backend, Completion, Endpoint, UpstreamError

if TYPE_CHECKING:
    from gateway.policy import BackendSpec

log = logging.getLogger("switchyard.backends")

MAX_RETRY_AFTER_S = 2.0  # honour an upstream's Retry-After up to this; longer → move on to the next backend
MAX_BACKOFF_S = 5.0

T = TypeVar("T")


class BreakerState(IntEnum):  # values are what /metrics exports
    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


class CircuitBreaker:
    """closed → open after `failure_threshold` consecutive failures → after `cooldown_s`, one probe
    (half-open) → closed on success, open again on failure."""

    __slots__ = ("_clock", "_probe_in_flight", "_state", "cooldown_s", "failure_threshold", "failures",
                 "name", "opened_at", "times_opened")

    def __init__(self, name: str, failure_threshold: int = 3, cooldown_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        self.name = name
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self.failures = 0
        self.opened_at = 0.0
        self.times_opened = 0
        self._state = BreakerState.CLOSED
        self._probe_in_flight = False
        self._clock = clock

    @property
    def state(self) -> BreakerState:
        """The state as /metrics should show it: an open breaker past its cooldown reads half-open."""
        if self._state is BreakerState.OPEN and self._clock() - self.opened_at >= self.cooldown_s:
            return BreakerState.HALF_OPEN
        return self._state

    def allow(self) -> bool:
        """May a request go to this backend now? In half-open state only one (the probe) may."""
        if self._state is BreakerState.CLOSED:
            return True
        if self._state is BreakerState.OPEN:
            if self._clock() - self.opened_at < self.cooldown_s:
                return False
            self._state = BreakerState.HALF_OPEN
        if self._probe_in_flight:
            return False
        self._probe_in_flight = True
        return True

    def retry_in(self) -> float:
        """Seconds until an open breaker lets a probe through (0 when it would now)."""
        if self._state is not BreakerState.OPEN:
            return 0.0
        return max(self.cooldown_s - (self._clock() - self.opened_at), 0.0)

    def record_success(self) -> None:
        self._state = BreakerState.CLOSED
        self.failures = 0
        self._probe_in_flight = False

    def record_failure(self) -> None:
        self.failures += 1
        if self._state is BreakerState.HALF_OPEN or (
                self._state is BreakerState.CLOSED and self.failures >= self.failure_threshold):
            self._open()
        self._probe_in_flight = False

    def release(self) -> None:
        """A probe ended without a verdict (e.g. the client went away): let another request probe."""
        self._probe_in_flight = False

    @property
    def accepting(self) -> bool:
        return self._state is BreakerState.CLOSED

    def _open(self) -> None:
        self._state = BreakerState.OPEN
        self.opened_at = self._clock()
        self.times_opened += 1


class BreakerRegistry:
    """Breakers keyed by backend name. Lives as long as the gateway, so state survives policy reloads."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._breakers: dict[str, CircuitBreaker] = {}
        self._clock = clock

    def get(self, spec: BackendSpec) -> CircuitBreaker:
        b = self._breakers.get(spec.name)
        if b is None:
            b = self._breakers[spec.name] = CircuitBreaker(spec.name, spec.failure_threshold, spec.cooldown_s,
                                                           self._clock)
        else:  # a reload may have changed the settings; keep the state
            b.failure_threshold = spec.failure_threshold
            b.cooldown_s = spec.cooldown_s
        return b

    def states(self) -> dict[str, int]:
        """{backend: 0 closed | 1 open | 2 half-open}, for /metrics."""
        return {name: int(b.state) for name, b in self._breakers.items()}

    def __getitem__(self, name: str) -> CircuitBreaker:
        return self._breakers[name]

    def __contains__(self, name: str) -> bool:
        return name in self._breakers


def backoff_delay(spec: BackendSpec, retry: int, retry_after: float | None) -> float | None:
    """Seconds to wait before retry number `retry` (0-based); None: don't retry this backend."""
    if retry_after is not None:
        return retry_after if retry_after <= min(MAX_RETRY_AFTER_S, spec.timeout_s) else None
    base = min(spec.retry_backoff_s * (2 ** retry), MAX_BACKOFF_S)
    return base * (0.5 + random.random())  # jitter: concurrent retries don't arrive in lockstep


def _all_unavailable(chain: list[Backend], breakers: BreakerRegistry, attempts: int) -> UpstreamError:
    names = ", ".join(b.name for b in chain)
    err = UpstreamError(f"no backend available: circuit open for {names}", kind="circuit_open", retryable=True)
    err.attempts = attempts
    err.retry_after = min((breakers.get(b.spec).retry_in() for b in chain), default=0.0)
    return err


async def _with_fallbacks(chain: list[Backend], breakers: BreakerRegistry,
                          attempt: Callable[[Backend], Awaitable[T]],
                          attempted: list[Backend] | None = None) -> tuple[T, Backend, int]:
    """The one retry/fallback loop: `attempt(backend)` makes one try at one backend.

    Returns (its result, the backend that gave it, attempts made); raises the last UpstreamError if all fail.
    `attempted`, when given, gets each backend as its attempt starts (the last one is the backend at work
    when the caller cancels, e.g. because the client left).
    """
    attempts = 0
    last: UpstreamError | None = None
    for backend in chain:
        breaker = breakers.get(backend.spec)
        if not breaker.allow():
            continue
        retry = 0
        while True:
            attempts += 1
            if attempted is not None:
                attempted.append(backend)
            try:
                result = await attempt(backend)
            except UpstreamError as e:
                e.backend = e.backend or backend.name
                e.attempts = attempts
                if e.status in (401, 403):  # our credentials refused: the operator must act (text redacted)
                    log.warning("backend %s refused the gateway's credentials (%d): %s", backend.name, e.status,
                                e.detail or e.message)
                if not e.fallback:
                    if e.kind == "request":
                        breaker.release()  # never sent: no verdict on the backend
                    else:
                        breaker.record_success()  # the backend answered; the request is what's wrong
                    raise
                if e.counts_against_backend:
                    breaker.record_failure()
                else:
                    breaker.release()  # misconfigured (401/403/404) or busy (409/429): not an outage
                last = e
                delay = _retry_delay(backend.spec, breaker, e, retry)
                if delay is None:
                    break  # this backend is done with: try the next one
                retry += 1
                await asyncio.sleep(delay)
                continue
            except BaseException:
                breaker.release()  # cancelled (client gone) or a bug: no verdict on the backend
                raise
            breaker.record_success()
            return result, backend, attempts
    if last is None:
        raise _all_unavailable(chain, breakers, attempts)
    last.attempts = attempts
    raise last


def _retry_delay(spec: BackendSpec, breaker: CircuitBreaker, e: UpstreamError, retry: int) -> float | None:
    """Seconds before trying the same backend again after `e`; None: move on (bad key or model name, retries
    used up, or the breaker has opened)."""
    if not e.retryable or retry >= spec.max_retries or not breaker.accepting:
        return None
    return backoff_delay(spec, retry, e.retry_after)


async def complete_with_fallbacks(chain: list[Backend], payload: dict, endpoint: Endpoint,
                                  breakers: BreakerRegistry, attempted: list[Backend] | None = None,
                                  ) -> tuple[Completion, Backend, int]:
    """(completion, the backend that served it, attempts made). Raises the last UpstreamError if all fail."""
    return await _with_fallbacks(chain, breakers, lambda backend: translate.complete(backend, payload, endpoint),
                                 attempted)


class FallbackStream:
    """The stream of the backend that answered: its first chunk (already read), then the rest.

    A mid-stream failure propagates (no fallback once the client has output) and counts against the
    backend's breaker. `aclose()` closes the upstream stream even if iteration never started.
    """

    __slots__ = ("_breaker", "_first", "_inner")

    def __init__(self, first: dict, inner: AsyncIterator[dict], breaker: CircuitBreaker):
        self._first: dict | None = first
        self._inner = inner
        self._breaker = breaker

    def __aiter__(self) -> FallbackStream:
        return self

    async def __anext__(self) -> dict:
        if self._first is not None:
            chunk, self._first = self._first, None
            return chunk
        try:
            return await self._inner.__anext__()
        except UpstreamError as e:
            if e.counts_against_backend:
                self._breaker.record_failure()
            raise

    @property
    def served_as(self) -> str | None:
        """"chat" when a completions or Responses stream is served as a chat stream (backends/translate.py)."""
        return getattr(self._inner, "served_as", None)

    async def aclose(self) -> None:
        self._first = None
        await self._inner.aclose()  # type: ignore[attr-defined]


async def open_stream_with_fallbacks(chain: list[Backend], payload: dict, endpoint: Endpoint,
                                     breakers: BreakerRegistry, attempted: list[Backend] | None = None,
                                     ) -> tuple[Backend, FallbackStream, int]:
    """Like complete_with_fallbacks for streams: a backend counts as working once it yields its first chunk.

    Returns (backend, stream, attempts); the caller must `aclose()` the stream when done or on disconnect.
    """
    (first, inner), backend, attempts = await _with_fallbacks(
        chain, breakers, lambda backend: _first_chunk(backend, payload, endpoint), attempted)
    return backend, FallbackStream(first, inner, breakers[backend.name]), attempts


async def _first_chunk(backend: Backend, payload: dict, endpoint: Endpoint) -> tuple[dict, AsyncIterator[dict]]:
    """One stream attempt: open the stream and read its first chunk (the stream is closed if that fails)."""
    inner = translate.stream(backend, payload, endpoint)  # completions/Responses as chat where the backend lacks them
    try:
        try:
            first = await inner.__anext__()
        except StopAsyncIteration:
            raise UpstreamError(f"{backend.name}: stream ended before its first chunk", kind="protocol",
                                retryable=True, backend=backend.name) from None
    except BaseException:
        await inner.aclose()  # type: ignore[attr-defined]
        raise
    return first, inner
