"""An engine fleet: one backend over several replicas (`api_bases:`), one replica picked per request.

Cache-aware balancing (the default, `balance.strategy: cache_aware`):
- The prompt is rendered as bytes (each chat message's JSON as sent, one after the other; a completion's prompt;
  a Responses request's instructions and input), so a conversation's next turn starts with the same bytes as
  the one before. It is cut into `block_bytes` blocks (64 bytes ~ 16 tokens) and each full block's hash is
  chained to the one before: block i's hash names the whole prefix up to it.
- Per replica the gateway remembers the chained hashes it sent there (an LRU of `blocks_per_replica`, entries
  expiring after `block_ttl_s`): the replica's KV cache, approximately.
- Each replica's cost for this request is the prompt tokens it would have to compute (not cached there) plus
  the tokens it is still computing for requests in flight; the cheapest serves. A conversation therefore stays
  on the replica holding its KV until that replica is behind by more than the conversation's whole history.
- Affinity is broken only past the policy's load thresholds (SGLang's rule): when the chosen replica has more
  than `balance_abs_threshold` requests in flight beyond the least loaded one and more than
  `balance_rel_threshold` times its count, the least loaded serves.
Load is what this gateway has in flight on each replica, or the replica's own running + waiting count (scraped
from its /metrics by the health probe, when fresh) if that is higher: other gateways' requests count too.

Health: every `health_interval_s` each replica's /metrics is fetched; a replica that does not answer is ejected
(no requests) and re-admitted when it answers again. A request that cannot connect ejects its replica at once;
other upstream failures eject it after the backend's `failure_threshold` in a row. The fallback loop's retry
(gateway/backends/resilience.py) then lands on another replica. With every replica ejected, all are tried.

Which replica served is set in a context variable (`replica_of`), read by the proxy for the
`x-switchyard-replica` header and the ledger's `replica` column: the replica's position in `api_bases`.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextvars import ContextVar
from typing import TYPE_CHECKING

import aiohttp
import orjson

from gateway.backends.base import Backend, Completion, Endpoint, UpstreamError
from gateway.backends.engine_backend import EngineBackend
from gateway.backends.engines import engine_backend, probe_url
from gateway.engine_load import parse_samples
from gateway.tasks import cancel_and_wait

if TYPE_CHECKING:
    from gateway.policy import BackendSpec

log = logging.getLogger("switchyard.fleet")

__all__ = ["FleetBackend", "PrefixIndex", "prompt_blocks", "replica_of", "serving"]

_BYTES_PER_TOKEN = 4  # for token estimates from bytes (what llm-d's approximate scorer assumes per character)
_PROBE_TIMEOUT_S = 1.0

# (backend name, replica label) of the replica picked last in this request's context.
_SERVED: ContextVar[tuple[str, str] | None] = ContextVar("switchyard_fleet_replica", default=None)


# The live fleets by backend name, for /health (gateway/health.py): a fleet is up while a replica is admitted.
_FLEETS: weakref.WeakValueDictionary[str, FleetBackend] = weakref.WeakValueDictionary()


def serving(backend: str) -> bool | None:
    """Whether fleet `backend` has a replica admitted; None when `backend` is not a live fleet."""
    fleet = _FLEETS.get(backend)
    return None if fleet is None else any(not r.ejected for r in fleet.replicas)


def replica_of(backend: str | None) -> str | None:
    """The replica of fleet `backend` that served this request (None: not a fleet, or another backend served)."""
    served = _SERVED.get()
    return served[1] if served is not None and served[0] == backend else None


def _rendered(payload: dict, endpoint: Endpoint) -> bytes:
    """The prompt as bytes whose prefixes are the conversation's earlier turns (see the module docstring)."""
    if endpoint in ("chat", "embeddings") and isinstance(payload.get("messages"), list):
        return b"".join(orjson.dumps(m) for m in payload["messages"])
    if endpoint == "responses":
        return orjson.dumps(payload.get("instructions")) + orjson.dumps(payload.get("input"))
    prompt = payload.get("prompt", payload.get("input"))
    return prompt.encode() if isinstance(prompt, str) else orjson.dumps(prompt)


def prompt_blocks(payload: dict, endpoint: Endpoint, block_bytes: int, max_blocks: int) -> tuple[list[int], int]:
    """(chained hashes of the prompt's full blocks, at most `max_blocks`; the prompt's size in bytes)."""
    data = _rendered(payload, endpoint)
    hashes: list[int] = []
    h = 0
    for start in range(0, min(len(data) // block_bytes, max_blocks) * block_bytes, block_bytes):
        h = hash((h, data[start:start + block_bytes]))
        hashes.append(h)
    return hashes, len(data)


class PrefixIndex:
    """One replica's remembered block hashes: an LRU bounded in entries, each entry expiring after `ttl_s`."""

    __slots__ = ("_entries", "capacity", "ttl_s")

    def __init__(self, capacity: int, ttl_s: float) -> None:
        self.capacity, self.ttl_s = capacity, ttl_s
        self._entries: OrderedDict[int, float] = OrderedDict()  # hash -> when last sent

    def __len__(self) -> int:
        return len(self._entries)

    def matched(self, hashes: list[int], now: float) -> int:
        """How many leading blocks of `hashes` this replica holds (unexpired)."""
        entries, oldest = self._entries, now - self.ttl_s
        n = 0
        for h in hashes:
            seen = entries.get(h)
            if seen is None or seen < oldest:
                break
            n += 1
        return n

    def add(self, hashes: list[int], now: float) -> None:
        entries = self._entries
        for h in hashes:
            entries[h] = now
            entries.move_to_end(h)
        oldest = now - self.ttl_s
        while entries and (len(entries) > self.capacity or next(iter(entries.values())) < oldest):
            entries.popitem(last=False)


class _Replica:
    __slots__ = ("backend", "ejected", "failures", "in_flight", "index", "label", "pending_tokens", "scraped",
                 "scraped_at", "served")

    def __init__(self, label: str, backend: EngineBackend, index: PrefixIndex) -> None:
        self.label, self.backend, self.index = label, backend, index
        self.in_flight = 0  # this gateway's requests on it
        self.pending_tokens = 0  # their prompt tokens not cached there (the prefill work still owed)
        self.scraped: int | None = None  # running + waiting, from its /metrics
        self.scraped_at = 0.0
        self.ejected = False
        self.failures = 0  # upstream failures in a row
        self.served = 0


class FleetBackend(Backend):
    """A `kind: engine` backend with `api_bases:`: one EngineBackend per replica, chosen per request."""

    def __init__(self, spec: BackendSpec) -> None:
        super().__init__(spec)
        from gateway.policy import BalanceSpec

        assert spec.api_bases, "a fleet needs api_bases"
        self.balance = spec.balance or BalanceSpec()
        b = self.balance
        self.replicas = [_Replica(str(i), engine_backend(spec, base), PrefixIndex(b.blocks_per_replica, b.block_ttl_s))
                         for i, base in enumerate(spec.api_bases)]
        self._turn = itertools.count()
        self._probe_task: asyncio.Task | None = None
        with contextlib.suppress(RuntimeError):  # built in the gateway's loop: probe from now on (else: first use)
            self._start_probing(asyncio.get_running_loop())
        _FLEETS[self.name] = self

    def _start_probing(self, loop: asyncio.AbstractEventLoop) -> None:
        self._probe_task = loop.create_task(self._probe_forever(), name=f"fleet-health-{self.name}")

    # ------------------------------------------------------------ choosing

    def load(self, r: _Replica, now: float) -> int:
        fresh = r.scraped is not None and now - r.scraped_at <= 2.5 * self.balance.health_interval_s
        return max(r.in_flight, r.scraped or 0) if fresh else r.in_flight

    def pick(self, payload: dict, endpoint: Endpoint) -> tuple[_Replica, list[int], int]:
        """(the replica to send to, the prompt's block hashes, the prompt tokens it will compute)."""
        if self._probe_task is None:
            self._start_probing(asyncio.get_running_loop())
        b, now = self.balance, time.monotonic()
        live = [r for r in self.replicas if not r.ejected] or self.replicas
        if b.strategy == "round_robin":
            r = live[next(self._turn) % len(live)]
            return r, [], 0
        loads = {r.label: self.load(r, now) for r in live}
        least = min(live, key=lambda r: (loads[r.label], r.pending_tokens, r.served))
        if b.strategy == "least_loaded":
            return least, [], 0
        hashes, size = prompt_blocks(payload, endpoint, b.block_bytes, b.max_blocks)
        prompt_tokens = size // _BYTES_PER_TOKEN
        block_tokens = b.block_bytes // _BYTES_PER_TOKEN
        uncached = {r.label: prompt_tokens - r.index.matched(hashes, now) * block_tokens for r in live}
        chosen = min(live, key=lambda r: (uncached[r.label] + r.pending_tokens, loads[r.label], r.served))
        if (loads[chosen.label] - loads[least.label] > b.balance_abs_threshold
                and loads[chosen.label] > b.balance_rel_threshold * loads[least.label]):
            chosen = least  # past the thresholds: load wins over the cache
        return chosen, hashes, max(uncached[chosen.label], 0)

    def _begin(self, payload: dict, endpoint: Endpoint) -> tuple[_Replica, int]:
        r, hashes, tokens = self.pick(payload, endpoint)
        if hashes:
            r.index.add(hashes, time.monotonic())
        r.in_flight += 1
        r.pending_tokens += tokens
        r.served += 1
        _SERVED.set((self.name, r.label))
        return r, tokens

    def _end(self, r: _Replica, tokens: int, error: BaseException | None) -> None:
        r.in_flight -= 1
        r.pending_tokens -= tokens
        if isinstance(error, UpstreamError):
            if error.kind == "connect":
                self._eject(r, "connection refused")
            elif error.counts_against_backend:
                r.failures += 1
                if r.failures >= self.spec.failure_threshold:
                    self._eject(r, f"{r.failures} failures in a row")
        elif error is None:
            r.failures = 0

    def _eject(self, r: _Replica, why: str) -> None:
        if not r.ejected and len(self.replicas) > 1:
            log.warning("fleet %s: replica %s (%s) ejected: %s", self.name, r.label, r.backend.api_base, why)
            r.ejected = True

    # ------------------------------------------------------------ serving

    async def complete(self, payload: dict, endpoint: Endpoint) -> Completion:
        r, tokens = self._begin(payload, endpoint)
        error: BaseException | None = None
        try:
            return await r.backend.complete(payload, endpoint)
        except BaseException as e:
            error = e
            raise
        finally:
            self._end(r, tokens, error)

    def stream(self, payload: dict, endpoint: Endpoint) -> AsyncIterator[dict]:
        return self._stream(payload, endpoint)

    async def _stream(self, payload: dict, endpoint: Endpoint) -> AsyncIterator[dict]:
        # Picked on the first read, in the reader's context (an unread generator's finally would never run).
        r, tokens = self._begin(payload, endpoint)
        inner = r.backend.stream(payload, endpoint)
        error: BaseException | None = None
        try:
            async for chunk in inner:
                yield chunk
        except BaseException as e:
            error = e
            raise
        finally:
            with contextlib.suppress(Exception):
                await inner.aclose()  # type: ignore[attr-defined]
            self._end(r, tokens, None if isinstance(error, GeneratorExit) else error)

    # ------------------------------------------------------------ health

    async def probe_once(self) -> None:
        await asyncio.gather(*(self._probe(r) for r in self.replicas))

    async def _probe(self, r: _Replica) -> None:
        try:
            async with r.backend._client().get(probe_url(r.backend),
                                               timeout=aiohttp.ClientTimeout(total=_PROBE_TIMEOUT_S)) as resp:
                text = await resp.text() if resp.status == 200 else ""
                alive = resp.status < 500
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
            alive, text = False, ""
        if not alive:
            r.scraped = None
            self._eject(r, "health check failed")
            return
        values, _ = parse_samples(text)
        running = values.get("switchyard_engine_requests_running")
        waiting = values.get("switchyard_engine_requests_waiting")
        if running is not None or waiting is not None:
            r.scraped, r.scraped_at = int((running or 0) + (waiting or 0)), time.monotonic()
        if r.ejected:
            log.warning("fleet %s: replica %s (%s) re-admitted", self.name, r.label, r.backend.api_base)
            r.ejected, r.failures = False, 0

    async def _probe_forever(self) -> None:
        while True:
            try:
                await self.probe_once()
            except Exception:  # keep probing whatever happens
                log.exception("fleet %s: health probe failed", self.name)
            await asyncio.sleep(self.balance.health_interval_s)

    def status(self) -> list[dict]:
        """Per replica: label, URL, ejected, in flight, remembered blocks, requests sent (for tests and /health)."""
        return [{"replica": r.label, "api_base": r.backend.api_base, "ejected": r.ejected, "in_flight": r.in_flight,
                 "blocks": len(r.index), "served": r.served} for r in self.replicas]

    async def aclose(self) -> None:
        if _FLEETS.get(self.name) is self:
            del _FLEETS[self.name]
        task, self._probe_task = self._probe_task, None
        await cancel_and_wait(task)
        for r in self.replicas:
            await r.backend.aclose()
