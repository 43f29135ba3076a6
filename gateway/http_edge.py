"""What every HTTP response of the gateway gets, whatever answered it: an `x-request-id` header.

A pure ASGI middleware (no body buffering, streams pass through): the request path sets its own id (the
ledger's `request_id`); any other response — a 401, 404, 405, 413, /health — gets a fresh one here.
"""
from __future__ import annotations

import uuid
from typing import Any

_HEADER = b"x-request-id"


def new_request_id() -> str:
    return "req_" + uuid.uuid4().hex


class RequestIdMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = message.get("headers") or []
                if not any(name.lower() == _HEADER for name, _ in headers):
                    message["headers"] = [*headers, (_HEADER, new_request_id().encode())]
            await send(message)

        await self.app(scope, receive, send_with_id)
