"""Bearer-key authentication with a short-lived in-memory cache in front of the key table."""
from __future__ import annotations

import hmac
import time

from sqlalchemy.ext.asyncio import AsyncEngine

from gateway import errors
from gateway.keys import MASTER, KeyInfo, find_key, hash_key

_CACHE_TTL_S = 30.0  # a revoked key stops working within this long


class Authenticator:
    def __init__(self, engine: AsyncEngine | None, master_key: str | None) -> None:
        self._engine = engine
        self._master_hash = hash_key(master_key) if master_key else None
        self._cache: dict[str, tuple[KeyInfo | None, float]] = {}

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
        now = time.monotonic()
        cached = self._cache.get(key_hash)
        if cached is not None and cached[1] > now:
            info = cached[0]
        else:
            info = await find_key(self._engine, key_hash) if self._engine is not None else None
            if len(self._cache) > 100_000:  # unbounded growth under a key-guessing flood
                self._cache.clear()
            self._cache[key_hash] = (info, now + _CACHE_TTL_S)
        if info is None:
            raise errors.authentication("Incorrect API key provided.")
        return info
