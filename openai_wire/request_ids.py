"""An `x-request-id` on every response of an ASGI app, and an OpenAI 500 body (never plain text) for an
exception that escapes it: both servers' edge (the engine uses it as it is; gateway/http_edge.py gives it the
gateway's ids, its error text and the hook that writes a ledger row).

A caller's id is kept when it is a plain token (the gateway's `req_…` follows a request into the engine's log);
anything else gets a fresh one. Pure ASGI: no body buffering, streams pass through.
"""
from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
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
        rid = scope[SCOPE_KEY] = sent.decode() if _TOKEN.match(sent) else "req_" + os.urandom(16).hex()
    return rid


# What a server says for an exception that escaped it, given the id the client sees.
ErrorBody = Callable[[str], APIError]
# on_error(scope, exc, started_at): told first, once (a server that logs its requests writes the row here); it
# must not raise (what it raises is logged and dropped). started_at: time.perf_counter() at arrival.
ErrorHook = Callable[[dict, BaseException, float], None]


def server_error(public_id: str) -> APIError:
    return APIError(500, f"Internal server error (request {public_id}); the server's log has the details.",
                    type="server_error", code="internal_error")


class RequestIdMiddleware:
    """Sets the one `x-request-id` a response carries (`public_id(scope)`: by default request_id above) and turns
    an exception that escapes the app into `error_body(id)`'s OpenAI body, after `on_error`. An exception in
    `quiet` (a client that left mid-upload) is logged at INFO and answered with nothing: nobody is listening."""

    def __init__(self, app: Any, *, public_id: Callable[[dict], str] = request_id,
                 error_body: ErrorBody = server_error, on_error: ErrorHook | None = None,
                 quiet: tuple[type[BaseException], ...] = ()) -> None:
        self.app = app
        self.public_id = public_id
        self.error_body = error_body
        self.on_error = on_error
        self.quiet = quiet

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started_at = time.perf_counter()
        rid = self.public_id(scope)
        id_header = rid.encode()
        started = False

        async def send_with_id(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = message.get("headers") or ()  # the one id the client sees, whatever a route set
                message["headers"] = [*(h for h in headers if h[0].lower() != HEADER), (HEADER, id_header)]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:  # the one place an unexpected error becomes an answer
            quiet = isinstance(exc, self.quiet)
            if quiet:
                log.info("client left %s %s before its request was read (%s)", scope.get("method"),
                         scope.get("path"), rid)
            else:
                log.error("unexpected error serving %s %s (%s)", scope.get("method"), scope.get("path"), rid,
                          exc_info=exc)
            if self.on_error is not None:
                try:
                    self.on_error(scope, exc, started_at)
                except Exception:
                    log.exception("recording the error of %s failed", rid)
            if started or quiet:
                return  # headers are gone (or nobody is listening): the server ends the connection
            from openai_wire.responses import error_response  # starlette glue, imported only when needed

            await error_response(self.error_body(rid))(scope, receive, send_with_id)
