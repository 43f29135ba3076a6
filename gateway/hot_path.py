"""The four POST endpoints every client call uses go straight to their handlers; the rest goes through Starlette.

Starlette's layers (its error and exception middleware, the router's match over every route, the per-route
request/response wrapper) cost ~60 us a request on the 2-core development machine, more than the gateway's own
admission work; for `POST /v1/chat/completions`, `/v1/completions`, `/v1/embeddings` and `/v1/responses` (exact
paths) none of them does anything but one: an exception the app has a handler for (`APIError`) is answered here by
that same handler, so errors read the same on both paths. Those requests get the same edge as every other
(`RequestIdMiddleware`: the x-request-id, an OpenAI 500 and a ledger row for an escaped error), a Starlette
`Request` whose `request.app` is the Starlette app, and nothing else. Every other request, the
lifespan included, is the Starlette app's; attributes (`state`, `router`…) are the Starlette app's too.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response

Handler = Callable[[Request], Awaitable[Response]]


class HotPathApp:
    def __init__(self, app: Starlette, handlers: dict[str, Handler],
                 edge: Callable[[Any], Any]) -> None:
        """`handlers`: exact path -> handler for POST; `edge`: wraps the direct dispatcher (the request-id
        middleware, configured as the Starlette app's own)."""
        self.app = app
        self._handlers = handlers
        self._direct = edge(self._dispatch)
        # the Starlette app's handlers keyed by exception class (its status-code handlers are the router's)
        self._on_error = {kind: handler for kind, handler in app.exception_handlers.items() if isinstance(kind, type)}
        self._handled = tuple(self._on_error)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self._handlers:
            await self._direct(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _dispatch(self, scope: dict, receive: Any, send: Any) -> None:
        scope["app"] = self.app  # what Starlette sets: request.app.state is the gateway's
        request = Request(scope, receive)
        try:  # free when nothing is raised (3.11's zero-cost try)
            response = await self._handlers[scope["path"]](request)
        except self._handled as exc:
            handler = next(self._on_error[kind] for kind in type(exc).__mro__ if kind in self._on_error)
            response = await handler(request, exc)
        await response(scope, receive, send)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.app, name)
