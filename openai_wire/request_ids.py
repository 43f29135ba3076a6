"""An `x-request-id` on every response of an ASGI app, and an OpenAI 500 body (never plain text) for an
exception that escapes it: the engine server's edge (the gateway's own, which also writes ledger rows for such
errors, is gateway/http_edge.py).

A caller's id is kept when it is a plain token (the gateway's `req_…` follows a request into the engine's log);
anything else gets a fresh one. Pure ASGI: no body buffering, streams pass through.
"""
from __future__ import annotations

import logging
import re
import uuid
from typing import Any

from openai_wire import APIError

log = logging.getLogger("switchyard.http")

HEADER = b"x-request-id"
SCOPE_KEY = "switchyard.request_id"
_TOKEN = re.compile(rb"^[A-Za-z0-9._:-]{1,128}$")


def request_id(scope: dict) -> str:
    """This request's id (the caller's, when it sent a plain one; else a new `req_…`), fixed on first use."""
    rid = scope.get(SCOPE_KEY)
    if rid is None:
        sent = next((value for name, value in scope.get("headers") or () if name.lower() == HEADER), b"")
        rid = scope[SCOPE_KEY] = sent.decode() if _TOKEN.match(sent) else "req_" + uuid.uuid4().hex
    return rid


class RequestIdMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id(scope)
        started = False

        async def send_with_id(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = [(k, v) for k, v in message.get("headers") or () if k.lower() != HEADER]
                message["headers"] = [*headers, (HEADER, rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:  # the one place an unexpected error becomes an answer
            log.error("unexpected error serving %s %s (%s)", scope.get("method"), scope.get("path"), rid,
                      exc_info=exc)
            if started:
                return  # headers are gone: the server ends the connection
            from openai_wire.responses import error_response  # starlette glue, imported only when needed

            err = APIError(500, f"Internal server error (request {rid}); the server's log has the details.",
                           type="server_error", code="internal_error")
            await error_response(err)(scope, receive, send_with_id)
