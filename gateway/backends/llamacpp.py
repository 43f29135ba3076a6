"""`engine_type: llamacpp`: llama.cpp's `llama-server` as an engine backend, priced from its own `timings`.

llama-server answers the OpenAI API but none of our engine's extras: no `switchyard` object (device seconds,
utilisation) in its answers, no `switchyard_engine_*` metrics (its /metrics exists only with `--metrics`, under
`llamacpp:` names). What it does send, on every answer and on a stream's last chunk, is `timings`: `prompt_ms`
(prompt tokens it computed, the cached ones excluded), `predicted_ms` (generation), `cache_n` (prompt tokens
taken from its KV cache). So:

- device seconds: the span prompt_ms + predicted_ms, shared with the requests running beside it
  (gateway/backends/llamacpp_clock.py says why and how), written into the `switchyard` object the rest of the
  gateway already reads (the answer's, or the last chunk's) — the ledger, the workbook and the reports then
  work unchanged;
- utilisation: the busy fraction of the last 60 s as this gateway sees it (the same window as our engine's);
- cached prompt tokens: its usage's `prompt_tokens_details.cached_tokens`, else `timings.cache_n`; they took
  no device time (prompt_ms excludes them), so they are priced as cached by construction;
- slots: `total_slots` from its `/props`, read before the first request (and again until it answers), so
  requests queued behind busy slots are not counted as sharing the device;
- health and load (gateway/engine_load.py): `/health` for liveness, `llamacpp:requests_processing` /
  `requests_deferred` from /metrics when it was started with `--metrics`; busy time for `engine_uptime`
  from this backend's clock (`busy_seconds`).
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import aiohttp

from gateway.backends.base import Completion, Endpoint, Usage
from gateway.backends.engine_backend import EngineBackend
from gateway.backends.llamacpp_clock import SharedBusyClock

if TYPE_CHECKING:
    from gateway.policy import BackendSpec

log = logging.getLogger("switchyard.backends.llamacpp")

__all__ = ["HEALTH_PATH", "LlamaCppBackend", "engine_root", "parse_metrics", "timings_span_s"]

HEALTH_PATH = "/health"
PROPS_PATH = "/props"
METRIC_PREFIX = "llamacpp:"
UTILISATION_WINDOW_S = 60.0  # as our engine's busy_window_s
_PROPS_RETRY_S = 10.0
_PROPS_TIMEOUT_S = 2.0


def engine_root(api_base: str) -> str:
    """http://host:port/v1 → http://host:port (llama-server serves /health, /props and /metrics at its root)."""
    return api_base.rstrip("/").removesuffix("/v1")


def timings_span_s(timings: object) -> float | None:
    """Seconds llama-server worked on a request (prompt_ms + predicted_ms); None when absent or not numbers."""
    if not isinstance(timings, dict):
        return None
    total = 0.0
    for key in ("prompt_ms", "predicted_ms"):
        value = timings.get(key)
        if value is None:
            continue
        if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            return None
        total += float(value)
    return total / 1000.0 if "prompt_ms" in timings or "predicted_ms" in timings else None


def parse_metrics(text: str) -> dict[str, float]:
    """llama-server's `llamacpp:` samples by name without the prefix (they carry no labels)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(METRIC_PREFIX):
            continue
        key, _, raw = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            values[key[len(METRIC_PREFIX):]] = float(raw)
    return values


def _cache_n(timings: dict) -> int:
    value = timings.get("cache_n")
    return int(value) if isinstance(value, int | float) and value > 0 else 0


class LlamaCppBackend(EngineBackend):
    """An EngineBackend that turns llama-server's `timings` into our accounting (see the module docstring)."""

    def __init__(self, spec: BackendSpec, api_base: str | None = None):
        super().__init__(spec, api_base)
        self.clock = SharedBusyClock()
        self.root = engine_root(self.api_base)
        self._props_tried_at = -math.inf

    def busy_seconds(self) -> float:
        """Cumulative wall seconds this gateway had a request running on the engine (engine_uptime's busy time)."""
        return self.clock.busy_seconds()

    async def _learn_slots(self) -> None:
        """llama-server's parallel slots (-np), from /props; tried again every _PROPS_RETRY_S until it answers."""
        now = time.monotonic()
        if self.clock.slots is not None or now - self._props_tried_at < _PROPS_RETRY_S:
            return
        self._props_tried_at = now
        try:
            async with self._client().get(self.root + PROPS_PATH, headers=self._headers,
                                          timeout=aiohttp.ClientTimeout(total=_PROPS_TIMEOUT_S)) as resp:
                props = await resp.json(content_type=None) if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            log.info("%s: no slot count from %s%s (%s); requests in flight count as running", self.name,
                     self.root, PROPS_PATH, type(e).__name__)
            return
        slots = props.get("total_slots") if isinstance(props, dict) else None
        if isinstance(slots, int) and slots >= 1:
            self.clock.set_slots(slots)

    def _account(self, timings: dict, sent_at: float) -> dict | None:
        """The `switchyard` object for a request sent at `sent_at` whose timings just arrived."""
        span = timings_span_s(timings)
        if span is None:
            return None
        device_seconds = self.clock.share(sent_at, self.clock.now(), span)
        return {"device_seconds": round(device_seconds, 6),
                "utilisation": round(self.clock.busy_fraction(UTILISATION_WINDOW_S), 6)}

    async def complete(self, payload: dict, endpoint: Endpoint) -> Completion:
        if endpoint == "responses":  # served as chat: this method again, with endpoint "chat"
            return await super().complete(payload, endpoint)
        await self._learn_slots()
        sent_at = self.clock.start()
        try:
            done = await super().complete(payload, endpoint)
            timings = done.body.get("timings")
            if isinstance(timings, dict):
                ext = self._account(timings, sent_at)
                if ext is not None:
                    done.device_seconds, done.utilisation = ext["device_seconds"], ext["utilisation"]
                cached = _cache_n(timings)
                if cached and not done.usage.cached_prompt_tokens:
                    u = done.usage
                    done.usage = Usage(u.prompt_tokens, u.completion_tokens, min(cached, u.prompt_tokens))
            return done
        finally:
            self.clock.finish()

    async def _stream(self, payload: dict, endpoint: Endpoint) -> AsyncIterator[dict]:
        await self._learn_slots()
        sent_at = self.clock.start()
        try:
            async with contextlib.aclosing(super()._stream(payload, endpoint)) as chunks:
                async for chunk in chunks:
                    timings = chunk.get("timings")
                    if isinstance(timings, dict):  # the last chunk (and every one, with timings_per_token)
                        ext = self._account(timings, sent_at)
                        if ext is not None:
                            chunk["switchyard"] = ext
                        _cached_into_usage(chunk, _cache_n(timings))
                    yield chunk
        finally:
            self.clock.finish()


def _cached_into_usage(chunk: dict, cached: int) -> None:
    """timings.cache_n as the usage's cached_tokens when the usage does not say (older llama-server builds)."""
    usage = chunk.get("usage")
    if not cached or not isinstance(usage, dict):
        return
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and details.get("cached_tokens"):
        return
    prompt = usage.get("prompt_tokens")
    usage["prompt_tokens_details"] = {**(details if isinstance(details, dict) else {}),
                                      "cached_tokens": min(cached, prompt) if isinstance(prompt, int) else cached}
