"""Bearer-key authentication: an in-memory cache in front of the key table that stays fresh while the database
answers and keeps known keys working while it does not.

- Fresh: an entry is trusted for `fresh_s` (1 s) after the database last confirmed it, so a key revoked in the
  database is refused within about a second by every gateway process on it. An entry in use past half that age
  is revalidated in the background (traffic on a key never waits for the database); an idle key's next request
  waits for one lookup. Lookups of one key are de-duplicated: a burst of one uncached key makes one query.
- Stale while the database is unreachable: a key the cache knows keeps its last answer (revoked and unknown keys
  stay refused); a key it has never seen gets a 503 with Retry-After, never a 500.
- Bounded: unknown keys (a key-guessing flood) live in their own size-capped table, so they never push the
  known keys out, and a flood never grows memory without bound.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine

from gateway import errors
from gateway.keys import MASTER, KeyInfo, find_key, hash_key

log = logging.getLogger("switchyard.auth")

FRESH_S = 1.0  # a revoked key stops working within this long (plus one lookup)
LOOKUP_TIMEOUT_S = 3.0  # a lookup slower than this counts as "database unreachable" for the waiting request
RETRY_AFTER_S = 5  # what a client with a key we cannot check is told
MAX_KNOWN = 100_000  # keys the database confirmed (bounded by the key table; a cap all the same)
MAX_UNKNOWN = 10_000  # negative entries: unknown or revoked keys


@dataclass(slots=True)
class _Entry:
    info: KeyInfo | None  # None: unknown or revoked
    checked: float  # monotonic time the database last answered for this key
    tried: float  # monotonic time of the last lookup started (answered or not)


class Authenticator:
    def __init__(self, engine: AsyncEngine | None, master_key: str | None, *, fresh_s: float = FRESH_S,
                 lookup_timeout_s: float = LOOKUP_TIMEOUT_S, max_unknown: int = MAX_UNKNOWN,
                 lookup: Callable[[str], Awaitable[KeyInfo | None]] | None = None) -> None:
        self._master_hash = hash_key(master_key) if master_key else None
        self._lookup_fn = lookup or ((lambda key_hash: find_key(engine, key_hash)) if engine is not None else None)
        self._fresh_s = fresh_s
        self._refresh_s = fresh_s / 2
        self._lookup_timeout_s = lookup_timeout_s
        self._max_unknown = max_unknown
        self._known: dict[str, _Entry] = {}
        self._unknown: dict[str, _Entry] = {}
        self._inflight: dict[str, asyncio.Task[KeyInfo | None]] = {}
        self._down_since: float | None = None  # set while the database is unreachable
        self._probe: asyncio.Task[KeyInfo | None] | None = None  # the one lookup of a new key during an outage
        self.lookups = 0  # queries started (for tests and the hot-path measurement)

    @property
    def database_reachable(self) -> bool:
        return self._down_since is None

    async def authenticate_admin(self, authorization: str | None, needs_it: str) -> KeyInfo:
        """authenticate, then the 403 `admin_key_required` unless the key is the master or an admin key;
        `needs_it` says what does ("Managing keys", "The dashboard"…)."""
        info = await self.authenticate(authorization)
        if not info.is_admin:
            raise errors.APIError(403, f"{needs_it} needs the master key or an admin key; this key is not one.",
                           type="permission_error", code="admin_key_required")
        return info

    async def authenticate(self, authorization: str | None) -> KeyInfo:
        if not authorization:
            raise errors.authentication("Missing API key: send 'Authorization: Bearer <key>'.")
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise errors.authentication("Malformed Authorization header: expected 'Bearer <key>'.")
        key_hash = hash_key(token)
        if self._master_hash is not None and hmac.compare_digest(key_hash, self._master_hash):
            return MASTER
        return _admit(await self._resolve(key_hash))

    async def _resolve(self, key_hash: str) -> _Entry | None:
        """The cache entry to decide on; None: a key we cannot check now (the database is unreachable)."""
        now = time.monotonic()
        entry = self._known.get(key_hash) or self._unknown.get(key_hash)
        if entry is not None and now - entry.checked < self._fresh_s:
            if now - entry.checked >= self._refresh_s and key_hash not in self._inflight:
                self._lookup(key_hash)  # revalidate ahead of expiry: requests on a busy key never wait
            return entry
        if self._down_since is not None and entry is not None:
            # Unreachable: the last answer holds. One background retry per key per fresh_s notices the recovery.
            if now - entry.tried >= self._fresh_s and key_hash not in self._inflight:
                self._lookup(key_hash)
            return entry
        if self._lookup_fn is None:
            return _Entry(None, now, now)
        if self._down_since is not None and self._probe is not None and not self._probe.done():
            return None  # unreachable and already probing: a flood of new keys must not pile up connections
        task = self._inflight.get(key_hash) or self._lookup(key_hash)
        if self._down_since is not None:
            self._probe = task
        try:
            info = await asyncio.wait_for(asyncio.shield(task), self._lookup_timeout_s)
        except TimeoutError:
            self._mark_down(f"no answer in {self._lookup_timeout_s:.1f} s")
            return entry
        except Exception:  # noqa: BLE001 - unreachable or failing (_settle logged it): the last answer holds
            return entry
        return _Entry(info, now, now)

    def _lookup(self, key_hash: str) -> asyncio.Task[KeyInfo | None]:
        """Start the one lookup of this key (callers share it); its outcome updates the cache."""
        assert self._lookup_fn is not None
        self.lookups += 1
        now = time.monotonic()
        for table in (self._known, self._unknown):
            if key_hash in table:
                table[key_hash].tried = now
        task = asyncio.ensure_future(self._lookup_fn(key_hash))
        self._inflight[key_hash] = task
        task.add_done_callback(lambda done: self._settle(key_hash, done, now))
        return task

    def _settle(self, key_hash: str, task: asyncio.Task[KeyInfo | None], started: float) -> None:
        self._inflight.pop(key_hash, None)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self._mark_down(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
            return
        if self._down_since is not None:
            log.warning("key store answering again after %.1f s", time.monotonic() - self._down_since)
            self._down_since = None
        info = task.result()
        self._store(key_hash, _Entry(info, started, started))

    def _mark_down(self, reason: str) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning("key store unreachable (%s): known keys keep their last answer, new keys get 503 until "
                        "it answers again", reason)

    def _store(self, key_hash: str, entry: _Entry) -> None:
        if entry.info is None:
            self._known.pop(key_hash, None)
            table, cap = self._unknown, self._max_unknown
        else:
            self._unknown.pop(key_hash, None)
            table, cap = self._known, MAX_KNOWN
        table.pop(key_hash, None)  # re-inserted last: dicts keep insertion order, the oldest goes first
        while len(table) >= cap:
            del table[next(iter(table))]
        table[key_hash] = entry

    def forget(self, key_id: str) -> None:
        """Drop the key's cached entries (it was revoked, updated or rotated: gateway/shared_state.py announces it):
        its next request looks it up again."""
        for key_hash in [h for h, entry in self._known.items() if entry.info is not None and entry.info.id == key_id]:
            del self._known[key_hash]

    async def aclose(self) -> None:
        """Cancel lookups still in flight (at shutdown)."""
        tasks = list(self._inflight.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task


def _admit(entry: _Entry | None) -> KeyInfo:
    if entry is None:
        raise errors.APIError(503, "The gateway cannot check this API key right now (its key store is unreachable); "
                                   "retry shortly.", type="api_error", code="key_store_unavailable",
                              headers={"Retry-After": str(RETRY_AFTER_S)})
    if entry.info is None:
        raise errors.authentication("Incorrect API key provided.")
    return entry.info
