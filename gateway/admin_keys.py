"""The admin API for keys: `/admin/keys` (list, create) and `/admin/keys/{id}` (get, update, revoke, rotate).

Only the master key or an admin key may call it (401 without a valid key, 403 for a client key). Keys are named
by their public id in URLs, never by their secret (URLs end up in access logs). Bodies and errors follow the
OpenAI wire; docs/keys.md has the shapes. Values are checked by gateway/keys.py, as for the CLI.
"""
from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

import orjson
from sqlalchemy.exc import DBAPIError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway import errors, keys
from gateway.keys import KeyInfo, KeyInputError, KeyNotFound, KeyRecord, KeyRevoked
from openai_wire import APIError
from openai_wire.responses import error_response

log = logging.getLogger("switchyard.admin")

MAX_BODY_BYTES = 64 * 1024
_CREATE_FIELDS = frozenset({"team", "budget_usd", "rpm", "tpm", "routes", "admin"})
_UPDATE_FIELDS = frozenset({"budget_usd", "rpm", "tpm", "routes"})


def routes() -> list[Route]:
    return [
        Route("/admin/keys", list_keys, methods=["GET"]),
        Route("/admin/keys", create_key, methods=["POST"]),
        Route("/admin/keys/{key_id}", get_key, methods=["GET"]),
        Route("/admin/keys/{key_id}", update_key, methods=["PATCH"]),
        Route("/admin/keys/{key_id}", revoke_key, methods=["DELETE"]),
        Route("/admin/keys/{key_id}/rotate", rotate_key, methods=["POST"]),
    ]


# ---------------------------------------------------------------- shapes


def _unix(t: datetime | None) -> int | None:
    if t is None:
        return None
    return int((t if t.tzinfo else t.replace(tzinfo=UTC)).timestamp())  # SQLite hands back naive UTC


def key_object(record: KeyRecord, secret: str | None = None) -> dict[str, Any]:
    body = {"object": "api_key", "id": record.id, "team": record.team, "budget_usd": record.budget_usd,
            "rpm": record.rpm, "tpm": record.tpm, "routes": list(record.routes) if record.routes is not None else None,
            "admin": record.is_admin, "revoked": record.revoked, "created_at": _unix(record.created_at),
            "revoked_at": _unix(record.revoked_at), "rotated_at": _unix(record.rotated_at),
            "updated_at": _unix(record.updated_at)}
    if secret is not None:
        body["key"] = secret  # create and rotate only: shown once
    return body


def _json(payload: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


# ---------------------------------------------------------------- checks


async def _admin(request: Request) -> KeyInfo:
    return await request.app.state.services.auth.authenticate_admin(request.headers.get("authorization"),
                                                                    "Managing keys")


def _key_id(request: Request) -> str:
    key_id = request.path_params["key_id"]
    if key_id.startswith(keys.KEY_PREFIX):
        raise errors.invalid_request("Name a key by its id (key_…) in URLs, never by its secret: URLs are logged.",
                                     param="key_id", code="invalid_key_id")
    if not key_id.startswith(keys.ID_PREFIX):
        raise _not_found(key_id)
    return key_id


def _not_found(key_id: str) -> APIError:
    return APIError(404, f"No key with id '{errors.clip(key_id)}'.", type="invalid_request_error", param="key_id",
                    code="key_not_found")


async def _body(request: Request, allowed: frozenset[str]) -> dict[str, Any]:
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise errors.request_too_large(MAX_BODY_BYTES)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise errors.invalid_request("The body must be a JSON object.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise errors.invalid_request("The body must be a JSON object.", code="invalid_json")
    for name in body:
        if name not in allowed:
            raise errors.invalid_request(f"Unknown field '{errors.clip(name)}'; allowed: {', '.join(sorted(allowed))}.",
                                         param=errors.clip(name), code="unknown_parameter")
    return body


def _checked(body: dict[str, Any]) -> dict[str, Any]:
    """Each given field checked (null clears a limit or the routes list); a bad one is a 400 naming it."""
    checks = {"budget_usd": lambda v: keys.check_budget(v, "budget_usd"),
              "rpm": lambda v: keys.check_limit(v, "rpm"), "tpm": lambda v: keys.check_limit(v, "tpm"),
              "routes": _routes, "team": lambda v: keys.check_team(v, "team"), "admin": _flag}
    out = {}
    for name, value in body.items():
        try:
            out[name] = checks[name](value)
        except KeyInputError as exc:
            raise errors.invalid_request(str(exc), param=name, code="invalid_value") from None
    return out


def _routes(value: Any) -> tuple[str, ...] | None:
    if value is not None and not isinstance(value, list):
        raise KeyInputError("routes must be a list of route names, or null for every route")
    return keys.check_routes(value, "routes")


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise KeyInputError(f"admin must be true or false, got {value!r}")
    return value


async def _answer(request: Request, work) -> Response:
    """Run an endpoint's work; map every expected failure to an OpenAI error (the middleware adds the id; an
    APIError goes to the app's exception handler)."""
    try:
        actor = await _admin(request)
        return await work(actor, request.app.state.gw.db_engine)
    except KeyNotFound:
        return error_response(_not_found(request.path_params.get("key_id", "")))
    except KeyRevoked as exc:
        return error_response(APIError(409, f"{str(exc)[0].upper()}{str(exc)[1:]}.", type="invalid_request_error",
                                       param="key_id", code="key_revoked"))
    except KeyInputError as exc:
        return error_response(errors.invalid_request(str(exc), code="invalid_value"))
    except (DBAPIError, OSError) as exc:
        log.warning("admin keys: database unavailable: %s", type(exc).__name__)
        return error_response(APIError(503, "The key database is unavailable; retry shortly.", type="api_error",
                                       code="database_unavailable", headers={"Retry-After": "2"}))


# ---------------------------------------------------------------- endpoints


async def list_keys(request: Request) -> Response:
    """GET /admin/keys[?revoked=false]: every key, oldest first."""
    async def work(actor: KeyInfo, engine) -> Response:
        records = await keys.list_keys(engine)
        if request.query_params.get("revoked") == "false":
            records = [r for r in records if not r.revoked]
        return _json({"object": "list", "data": [key_object(r) for r in records]})

    return await _answer(request, work)


async def create_key(request: Request) -> Response:
    """POST /admin/keys {team, budget_usd?, rpm?, tpm?, routes?, admin?} -> 201, the key object with `key`."""
    async def work(actor: KeyInfo, engine) -> Response:
        body = _checked(await _body(request, _CREATE_FIELDS))
        if "team" not in body:
            raise errors.invalid_request("'team' is required.", param="team", code="missing_required_parameter")
        secret, info = await keys.create_key(engine, body["team"], budget_usd=body.get("budget_usd"),
                                             rpm=body.get("rpm"), tpm=body.get("tpm"), routes=body.get("routes"),
                                             is_admin=body.get("admin", False))
        log.info("admin %s created key %s (team %r, admin %s)", actor.id, info.id, info.team, info.is_admin)
        return _json(key_object(await keys.get_key(engine, info.id), secret), status=201)

    return await _answer(request, work)


async def get_key(request: Request) -> Response:
    async def work(actor: KeyInfo, engine) -> Response:
        return _json(key_object(await keys.get_key(engine, _key_id(request))))

    return await _answer(request, work)


async def update_key(request: Request) -> Response:
    """PATCH /admin/keys/{id} {budget_usd?, rpm?, tpm?, routes?}: null removes that limit (routes: every route)."""
    async def work(actor: KeyInfo, engine) -> Response:
        key_id = _key_id(request)
        body = _checked(await _body(request, _UPDATE_FIELDS))
        if not body:
            raise errors.invalid_request(f"Nothing to update: give any of {', '.join(sorted(_UPDATE_FIELDS))}.",
                                         code="missing_required_parameter")
        record = await keys.update_key(engine, key_id, **body)
        log.info("admin %s updated key %s: %s", actor.id, record.id, ", ".join(sorted(body)))
        return _json(key_object(record))

    return await _answer(request, work)


async def revoke_key(request: Request) -> Response:
    """DELETE /admin/keys/{id}: revoke; the key object comes back with `revoked: true`."""
    async def work(actor: KeyInfo, engine) -> Response:
        record = await keys.revoke_key(engine, _key_id(request))
        log.info("admin %s revoked key %s", actor.id, record.id)
        return _json(key_object(record))

    return await _answer(request, work)


async def rotate_key(request: Request) -> Response:
    """POST /admin/keys/{id}/rotate: a new secret (in `key`, shown once) for the same id and settings."""
    async def work(actor: KeyInfo, engine) -> Response:
        secret, record = await keys.rotate_key(engine, _key_id(request))
        log.info("admin %s rotated key %s", actor.id, record.id)
        return _json(key_object(record, secret))

    return await _answer(request, work)
