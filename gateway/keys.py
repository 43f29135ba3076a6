"""Client API keys: generation, hashing and storage. Only SHA-256 hashes are ever stored."""
from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.ledger.models import ApiKey

KEY_PREFIX = "sk-sy-"


@dataclass(slots=True, frozen=True)
class KeyInfo:
    """What the request path needs to know about a key."""

    id: str
    team: str
    budget_usd: float | None = None
    rpm: int | None = None
    tpm: int | None = None
    is_admin: bool = False


MASTER = KeyInfo(id="master", team="admin", is_admin=True)


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _public_id(key_hash: str) -> str:
    return "key_" + key_hash[:12]


async def create_key(engine: AsyncEngine, team: str, *, budget_usd: float | None = None, rpm: int | None = None,
                     tpm: int | None = None, is_admin: bool = False) -> tuple[str, KeyInfo]:
    """Store a new key's hash; return the plaintext (shown once) and its info."""
    if not team.strip():
        raise ValueError("--team must not be empty")
    for name, value in (("--budget-usd", budget_usd), ("--rpm", rpm), ("--tpm", tpm)):
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    key = generate_key()
    key_hash = hash_key(key)
    row = ApiKey(id=_public_id(key_hash), key_hash=key_hash, team=team, budget_usd=budget_usd, rpm=rpm, tpm=tpm,
                 is_admin=is_admin, revoked=False, created_at=datetime.now(UTC))
    async with engine.begin() as conn:
        await conn.execute(ApiKey.__table__.insert().values(**_row_values(row)))
    return key, _info(row)


def _row_values(row: ApiKey) -> dict:
    return {c.name: getattr(row, c.name) for c in ApiKey.__table__.columns}


def _info(row) -> KeyInfo:
    return KeyInfo(id=row.id, team=row.team, budget_usd=row.budget_usd, rpm=row.rpm, tpm=row.tpm,
                   is_admin=bool(row.is_admin))


async def find_key(engine: AsyncEngine, key_hash: str) -> KeyInfo | None:
    async with engine.connect() as conn:
        result = await conn.execute(select(ApiKey).where(ApiKey.key_hash == key_hash, ApiKey.revoked.is_(False)))
        row = result.first()
    return _info(row) if row else None


async def has_admin_key(engine: AsyncEngine) -> bool:
    async with engine.connect() as conn:
        result = await conn.execute(select(ApiKey.id).where(ApiKey.is_admin.is_(True), ApiKey.revoked.is_(False)))
        return result.first() is not None
