"""Client API keys: generation, hashing, storage and lifecycle (create, list, update, rotate, revoke).

Only SHA-256 hashes are ever stored. A key is named by its public id (`key_…`) or by its plaintext (hashed
to find it). Limits are validated here, once, for the CLI and the admin API alike: finite and positive.
"""
from __future__ import annotations

import hashlib
import json
import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.ledger.models import ApiKey

KEY_PREFIX = "sk-sy-"
ID_PREFIX = "key_"
MAX_INT_LIMIT = 2**31 - 1  # rpm / tpm are INTEGER columns
MAX_BUDGET_USD = 1e12
MAX_TEAM_CHARS = 128  # the column's length
MAX_ROUTE_CHARS = 256  # a route name as the ledger stores it
MAX_ROUTES = 1000
UNSET: Any = object()  # update_key: "leave this field as it is" (None clears a limit)


class KeyInputError(ValueError):
    """A bad value or an impossible change: the message is one line, for the CLI and the admin API."""


class KeyNotFound(LookupError):
    pass


class KeyRevoked(RuntimeError):
    """The change needs a live key and this one is revoked."""


@dataclass(slots=True, frozen=True)
class KeyInfo:
    """What the request path needs to know about a key."""

    id: str
    team: str
    budget_usd: float | None = None
    rpm: int | None = None
    tpm: int | None = None
    is_admin: bool = False
    routes: tuple[str, ...] | None = None  # the routes this key may use; None: every route

    def allows(self, route: str) -> bool:
        return self.routes is None or route in self.routes


MASTER = KeyInfo(id="master", team="admin", is_admin=True)


@dataclass(slots=True, frozen=True)
class KeyRecord:
    """A stored key as operators see it (never its hash or plaintext)."""

    id: str
    team: str
    budget_usd: float | None
    rpm: int | None
    tpm: int | None
    routes: tuple[str, ...] | None
    is_admin: bool
    revoked: bool
    created_at: datetime
    revoked_at: datetime | None
    rotated_at: datetime | None
    updated_at: datetime | None


# ---------------------------------------------------------------- values


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _public_id(key_hash: str) -> str:
    return ID_PREFIX + key_hash[:12]


def check_budget(value: Any, name: str = "--budget-usd") -> float | None:
    """A finite, positive number of dollars (None: no budget). NaN, inf, 0 and negatives are refused."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise KeyInputError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0 or value > MAX_BUDGET_USD:
        raise KeyInputError(f"{name} must be a finite number above 0 and at most {MAX_BUDGET_USD:.0e}, got {value}")
    return float(value)


def check_limit(value: Any, name: str) -> int | None:
    """A whole number from 1 to 2^31-1 (None: no limit)."""
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise KeyInputError(f"{name} must be a whole number, got {value!r}")
    if not 1 <= value <= MAX_INT_LIMIT:
        raise KeyInputError(f"{name} must be from 1 to {MAX_INT_LIMIT}, got {value}")
    return value


def _check_text(value: str, name: str, limit: int) -> str:
    if any(ord(c) < 32 or ord(c) == 127 or 0xD800 <= ord(c) <= 0xDFFF for c in value):
        raise KeyInputError(f"{name} must not contain control characters")
    if len(value) > limit:
        raise KeyInputError(f"{name} must be at most {limit} characters, got {len(value)}")
    return value


def check_team(value: Any, name: str = "--team") -> str:
    if not isinstance(value, str) or not value.strip():
        raise KeyInputError(f"{name} must be a non-empty string")
    return _check_text(value.strip(), name, MAX_TEAM_CHARS)


def check_routes(value: Any, name: str = "--routes") -> tuple[str, ...] | None:
    """Route names (a list, or 'a,b' text): non-empty, no duplicates. None: every route."""
    if value is None:
        return None
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",")]
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise KeyInputError(f"{name} must be a list of route names")
    routes = tuple(dict.fromkeys(_check_text(v.strip(), f"{name} entry", MAX_ROUTE_CHARS) for v in value))
    if not routes or any(not r for r in routes):
        raise KeyInputError(f"{name} needs route names, e.g. 'gpt-4o-mini,auto' (empty names are not allowed)")
    if len(routes) > MAX_ROUTES:
        raise KeyInputError(f"{name} may name at most {MAX_ROUTES} routes")
    return routes


def _routes_column(routes: tuple[str, ...] | None) -> str | None:
    return None if routes is None else json.dumps(list(routes))


def _routes_of(column: str | None) -> tuple[str, ...] | None:
    return None if column is None else tuple(json.loads(column))


def _info(row) -> KeyInfo:
    return KeyInfo(id=row.id, team=row.team, budget_usd=row.budget_usd, rpm=row.rpm, tpm=row.tpm,
                   is_admin=bool(row.is_admin), routes=_routes_of(row.routes))


def _record(row) -> KeyRecord:
    return KeyRecord(id=row.id, team=row.team, budget_usd=row.budget_usd, rpm=row.rpm, tpm=row.tpm,
                     routes=_routes_of(row.routes), is_admin=bool(row.is_admin), revoked=bool(row.revoked),
                     created_at=row.created_at, revoked_at=row.revoked_at, rotated_at=row.rotated_at,
                     updated_at=row.updated_at)


# ---------------------------------------------------------------- storage


async def create_key(engine: AsyncEngine, team: str, *, budget_usd: float | None = None, rpm: int | None = None,
                     tpm: int | None = None, is_admin: bool = False,
                     routes: Sequence[str] | str | None = None) -> tuple[str, KeyInfo]:
    """Store a new key's hash; return the plaintext (shown once) and its info."""
    team = check_team(team)
    budget_usd = check_budget(budget_usd)
    rpm, tpm = check_limit(rpm, "--rpm"), check_limit(tpm, "--tpm")
    allowed = check_routes(routes)
    key = generate_key()
    key_hash = hash_key(key)
    key_id = _public_id(key_hash)
    async with engine.begin() as conn:
        await conn.execute(ApiKey.__table__.insert().values(
            id=key_id, key_hash=key_hash, team=team, budget_usd=budget_usd, rpm=rpm, tpm=tpm, is_admin=is_admin,
            revoked=False, created_at=datetime.now(UTC), routes=_routes_column(allowed)))
    return key, KeyInfo(id=key_id, team=team, budget_usd=budget_usd, rpm=rpm, tpm=tpm, is_admin=is_admin,
                        routes=allowed)


async def find_key(engine: AsyncEngine, key_hash: str) -> KeyInfo | None:
    async with engine.connect() as conn:
        result = await conn.execute(select(ApiKey).where(ApiKey.key_hash == key_hash, ApiKey.revoked.is_(False)))
        row = result.first()
    return _info(row) if row else None


async def has_admin_key(engine: AsyncEngine) -> bool:
    async with engine.connect() as conn:
        result = await conn.execute(select(ApiKey.id).where(ApiKey.is_admin.is_(True), ApiKey.revoked.is_(False)))
        return result.first() is not None


def _where(key_or_id: str):
    """A key's id (`key_…`) or its plaintext, as a WHERE clause."""
    key_or_id = key_or_id.strip()
    if key_or_id.startswith(ID_PREFIX):
        return ApiKey.id == key_or_id
    return ApiKey.key_hash == hash_key(key_or_id)


def _describe(key_or_id: str) -> str:
    """How an error names a key: its id as given, never a plaintext secret."""
    key_or_id = key_or_id.strip()
    if key_or_id.startswith(ID_PREFIX) and len(key_or_id) <= 64 and key_or_id.isprintable():
        return key_or_id
    return "the key given"


async def get_key(engine: AsyncEngine, key_or_id: str) -> KeyRecord:
    async with engine.connect() as conn:
        row = (await conn.execute(select(ApiKey).where(_where(key_or_id)))).first()
    if row is None:
        raise KeyNotFound(f"no key matches {_describe(key_or_id)}")
    return _record(row)


async def list_keys(engine: AsyncEngine) -> list[KeyRecord]:
    async with engine.connect() as conn:
        rows = (await conn.execute(select(ApiKey).order_by(ApiKey.created_at, ApiKey.id))).all()
    return [_record(row) for row in rows]


async def _change(engine: AsyncEngine, key_or_id: str, values: dict) -> KeyRecord:
    """Apply `values` to a live key in one statement that also checks it is live (a concurrent revoke wins)."""
    current = await get_key(engine, key_or_id)
    if current.revoked:
        raise KeyRevoked(f"key {current.id} is {'already ' if values.get('revoked') else ''}revoked"
                         f"{'' if values.get('revoked') else '; create a new key'}; nothing changed")
    async with engine.begin() as conn:
        result = await conn.execute(update(ApiKey).where(ApiKey.id == current.id, ApiKey.revoked.is_(False))
                                    .values(**values))
        if result.rowcount != 1:
            raise KeyRevoked(f"key {current.id} was revoked meanwhile; nothing changed")
    return await get_key(engine, current.id)


async def update_key(engine: AsyncEngine, key_or_id: str, *, budget_usd: Any = UNSET, rpm: Any = UNSET,
                     tpm: Any = UNSET, routes: Any = UNSET) -> KeyRecord:
    """Change a live key's limits or routes (UNSET: keep; None: remove the limit / allow every route)."""
    values: dict[str, Any] = {}
    if budget_usd is not UNSET:
        values["budget_usd"] = check_budget(budget_usd)
    if rpm is not UNSET:
        values["rpm"] = check_limit(rpm, "--rpm")
    if tpm is not UNSET:
        values["tpm"] = check_limit(tpm, "--tpm")
    if routes is not UNSET:
        values["routes"] = _routes_column(check_routes(routes))
    if not values:
        raise KeyInputError("nothing to update: give --budget-usd, --rpm, --tpm or --routes")
    values["updated_at"] = datetime.now(UTC)
    return await _change(engine, key_or_id, values)


async def revoke_key(engine: AsyncEngine, key_or_id: str) -> KeyRecord:
    """Revoke a live key; gateways refuse it once their auth cache revalidates (about a second)."""
    now = datetime.now(UTC)
    return await _change(engine, key_or_id, {"revoked": True, "revoked_at": now, "updated_at": now})


async def rotate_key(engine: AsyncEngine, key_or_id: str) -> tuple[str, KeyRecord]:
    """Give a live key a new secret; the old secret stops matching. The id (and so its spend, budget and
    ledger rows) and every setting stay as they were. Returns the new plaintext (shown once)."""
    key = generate_key()
    now = datetime.now(UTC)
    return key, await _change(engine, key_or_id, {"key_hash": hash_key(key), "rotated_at": now, "updated_at": now})
