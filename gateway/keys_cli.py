"""The handlers of `switchyard keys create | list | update | rotate | revoke`.

Each reads its flags, calls gateway/keys.py, prints, and returns the exit code: 0 done, 1 the key or the
database said no (unknown key, revoked key, unreachable database), 2 a bad value. An error is one line on
stderr and nothing is changed. Plaintext keys are printed only by create and rotate, once, as the last line;
hashes never.

update, rotate and revoke then announce the key's id on Redis when a Redis URL is configured (`--redis-url` or
SWITCHYARD_REDIS_URL, the one the gateways share): every replica drops the key from its cache at once. Without
Redis (or when it does not answer) the change still reaches every replica within about a second: each rereads a
key in use from the database once it is a second old (gateway/auth.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.keys import UNSET, KeyInputError, KeyNotFound, KeyRecord, KeyRevoked


def _number(text: str | None, name: str, kind: type) -> Any:
    """A flag's text as `kind`; 'none' clears the limit (update only); UNSET when the flag is absent."""
    if text is None:
        return UNSET
    if text.strip().lower() == "none":
        return None
    try:
        return kind(text)
    except ValueError:
        raise KeyInputError(f"{name} must be a {'number' if kind is float else 'whole number'}, got {text!r}") \
            from None


def _run(args: argparse.Namespace, work: Callable[[Any], Awaitable[int]]) -> int:
    """Migrate the database, run `work(engine)`, and turn failures into one-line errors."""
    from gateway import db, settings

    url = settings.database_url(getattr(args, "database_url", None))

    async def go() -> int:
        engine = db.create_engine(url)
        try:
            return await work(engine)
        finally:
            await engine.dispose()

    command = f"switchyard keys {args.keys_command}"
    try:
        db.upgrade(url)
        return asyncio.run(go())
    except KeyInputError as exc:
        print(f"{command}: error: {exc}", file=sys.stderr)
        return 2
    except (KeyNotFound, KeyRevoked) as exc:
        print(f"{command}: error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - a database failure is a clear one-line CLI error
        print(f"{command}: failed on {db.redact_url(url)}: {type(exc).__name__}: {str(exc).splitlines()[0]}",
              file=sys.stderr)
        return 1


def _announce(args: argparse.Namespace, key_id: str) -> None:
    """Tell the gateway replicas sharing the Redis that the key changed (best effort: the database holds it)."""
    from gateway import settings
    from gateway.shared_state import _redact, publish_key_change

    try:
        url = settings.redis_url(getattr(args, "redis_url", None))
    except ValueError as exc:
        print(f"switchyard keys {args.keys_command}: warning: not announced on Redis: {exc}", file=sys.stderr)
        return
    if url is None:
        return
    try:
        heard = publish_key_change(url, key_id)
    except Exception as exc:  # noqa: BLE001 - the change is stored; replicas reread it within about a second
        print(f"switchyard keys {args.keys_command}: warning: could not announce it on {_redact(url)} "
              f"({type(exc).__name__}); gateways still apply it within about a second", file=sys.stderr)
        return
    print(f"Announced to {heard} gateway replica{'' if heard == 1 else 's'} on Redis.")


def _limits(record: KeyRecord) -> str:
    parts = [f"{k}={v}" for k, v in (("budget_usd", record.budget_usd), ("rpm", record.rpm), ("tpm", record.tpm))
             if v is not None]
    parts.append("routes=" + (",".join(record.routes) if record.routes is not None else "all"))
    return ", ".join(parts)


def _as_dict(record: KeyRecord) -> dict:
    def iso(t):
        return t.isoformat() if t is not None else None

    return {"id": record.id, "team": record.team, "budget_usd": record.budget_usd, "rpm": record.rpm,
            "tpm": record.tpm, "routes": list(record.routes) if record.routes is not None else None,
            "admin": record.is_admin, "revoked": record.revoked, "created_at": iso(record.created_at),
            "revoked_at": iso(record.revoked_at), "rotated_at": iso(record.rotated_at),
            "updated_at": iso(record.updated_at)}


def keys_create(args: argparse.Namespace) -> int:
    """`switchyard keys create --team T …`: store a new key's hash and print the key, once, as the last line."""
    from gateway.keys import create_key, get_key

    async def work(engine) -> int:
        budget, rpm, tpm = (_number(args.budget_usd, "--budget-usd", float), _number(args.rpm, "--rpm", int),
                            _number(args.tpm, "--tpm", int))
        key, info = await create_key(engine, args.team, budget_usd=None if budget is UNSET else budget,
                                     rpm=None if rpm is UNSET else rpm, tpm=None if tpm is UNSET else tpm,
                                     is_admin=args.admin, routes=args.routes)
        record = await get_key(engine, info.id)
        kind = "admin key" if info.is_admin else "key"
        print(f"Created {kind} {info.id} for team '{info.team}' ({_limits(record)}). "
              "It is shown once; store it now:")
        print(key)
        return 0

    return _run(args, work)


def keys_list(args: argparse.Namespace) -> int:
    """`switchyard keys list`: every key's id, team, limits, routes and state; never a hash or a plaintext."""
    from gateway.keys import list_keys

    async def work(engine) -> int:
        records = await list_keys(engine)
        if not args.all:
            records = [r for r in records if not r.revoked]
        if args.json:
            print(json.dumps([_as_dict(r) for r in records], indent=2))
            return 0
        header = ("id", "team", "budget_usd", "rpm", "tpm", "routes", "admin", "revoked", "created")
        rows = [header] + [(r.id, r.team, _text(r.budget_usd), _text(r.rpm), _text(r.tpm),
                            ",".join(r.routes) if r.routes is not None else "all", "yes" if r.is_admin else "no",
                            r.revoked_at.strftime("%Y-%m-%d %H:%M") if r.revoked_at else ("yes" if r.revoked else "no"),
                            r.created_at.strftime("%Y-%m-%d %H:%M")) for r in records]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        for row in rows:
            print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
        if not records:
            print("(no keys)" if args.all else "(no live keys; --all shows revoked ones)")
        return 0

    return _run(args, work)


def _text(value: Any) -> str:
    return "-" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def keys_update(args: argparse.Namespace) -> int:
    """`switchyard keys update KEY_OR_ID [--budget-usd X|none] [--rpm N|none] [--tpm N|none] [--routes R,…]`."""
    from gateway.keys import update_key

    async def work(engine) -> int:
        routes = None if args.all_routes else (UNSET if args.routes is None else args.routes)
        record = await update_key(engine, args.key, budget_usd=_number(args.budget_usd, "--budget-usd", float),
                                  rpm=_number(args.rpm, "--rpm", int), tpm=_number(args.tpm, "--tpm", int),
                                  routes=routes)
        print(f"Updated key {record.id} ({_limits(record)}); gateways apply it within about a second.")
        _announce(args, record.id)
        return 0

    return _run(args, work)


def keys_revoke(args: argparse.Namespace) -> int:
    """`switchyard keys revoke KEY_OR_ID`."""
    from gateway.keys import revoke_key

    async def work(engine) -> int:
        record = await revoke_key(engine, args.key)
        print(f"Revoked key {record.id} (team '{record.team}'); gateways refuse it within about a second.",
              flush=True)
        _announce(args, record.id)
        return 0

    return _run(args, work)


def keys_rotate(args: argparse.Namespace) -> int:
    """`switchyard keys rotate KEY_OR_ID`: a new secret for the same key; prints it once, as the last line."""
    from gateway.keys import rotate_key

    async def work(engine) -> int:
        key, record = await rotate_key(engine, args.key)
        print(f"Rotated key {record.id} ({_limits(record)}): the old secret stops working within about a "
              "second.")
        _announce(args, record.id)
        print("The new one is shown once; store it now:")
        print(key)
        return 0

    return _run(args, work)
