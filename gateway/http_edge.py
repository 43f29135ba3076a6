"""What every HTTP response of the gateway gets, whatever answered it: an `x-request-id` header, and never a
plain-text 500.

A pure ASGI middleware (no body buffering, streams pass through). It gives each request its id before anything
else runs (`request_id_of(scope)`: the request path uses it for the ledger's `request_id`). An exception that
escapes any route becomes an OpenAI-shaped 500 whose message names the request id; `on_error` (the app's) is
told first, so a /v1 request still gets its ledger row.

A client's own `X-Request-Id` is kept when it is a sane token (`CLIENT_ID`: 1-128 of `A-Za-z0-9._:-`): the
response's `x-request-id` echoes it, and the ledger row's `request_id` is it (its first 47 characters) plus `~`
and 16 random hex digits — the ledger's request_id is unique and a client may reuse an id, so no row is ever
refused for it; `WHERE request_id LIKE 'my-id~%'` finds the rows. Any other value is replaced by the gateway's
own `req_<32 hex>`, which is then the header and the row's id alike.
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

from starlette.requests import ClientDisconnect

from openai_wire import APIError, request_ids

_HEADER = b"x-request-id"
REQUEST_ID_KEY = "switchyard.request_id"  # scope key: this request's id (the ledger row's)
PUBLIC_ID_KEY = "switchyard.public_request_id"  # scope key: the id the client sees (its own, when sane)
CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_ROW_PREFIX = 47  # + "~" + 16 hex digits: the ledger's 64-character request_id
RECORD_KEY = "switchyard.record"  # scope key: the request path's ledger record so far (for on_error's row)

# on_error(scope, request_id, exc, started): called once for an exception that escaped the app (started: the
# request's time.perf_counter() at arrival). It must not raise (what it raises is logged and dropped).
ErrorHook = Callable[[dict, str, BaseException, float], None]


def new_request_id() -> str:
    return "req_" + os.urandom(16).hex()  # uuid4's 128 random bits without building a UUID (~6 us -> ~1 us)


def request_id_of(scope: dict) -> str:
    """This request's id, the ledger row's: the one the middleware gave it (made here on first use)."""
    request_id = scope.get(REQUEST_ID_KEY)
    if request_id is None:
        _assign(scope)
        request_id = scope[REQUEST_ID_KEY]
    return request_id


def public_id_of(scope: dict) -> str:
    """The id the client sees in `x-request-id`: its own when it sent a sane one, else request_id_of."""
    if PUBLIC_ID_KEY not in scope:
        _assign(scope)
    return scope[PUBLIC_ID_KEY]


def _assign(scope: dict) -> None:
    client = None
    for name, value in scope.get("headers") or ():
        if name.lower() == _HEADER:
            client = value.decode("latin-1")
            break
    if client is not None and CLIENT_ID.fullmatch(client):
        scope[PUBLIC_ID_KEY] = client
        scope[REQUEST_ID_KEY] = f"{client[:_ROW_PREFIX]}~{os.urandom(8).hex()}"
    else:
        scope[PUBLIC_ID_KEY] = scope[REQUEST_ID_KEY] = new_request_id()


def internal_error(request_id: str) -> APIError:
    return APIError(500, f"Internal gateway error (request {request_id}); the gateway's log has the details.",
                    type="api_error", code="internal_error")


class RequestIdMiddleware(request_ids.RequestIdMiddleware):
    """openai_wire's edge with the gateway's ids (the client's own when sane), its error text, and `on_error`
    (the app's, which writes the ledger row) told the row's request id."""

    def __init__(self, app: Any, on_error: ErrorHook | None = None) -> None:
        hook = None if on_error is None else (
            lambda scope, exc, started_at: on_error(scope, request_id_of(scope), exc, started_at))
        super().__init__(app, public_id=public_id_of, error_body=internal_error, on_error=hook,
                         quiet=(ClientDisconnect,))
