"""OpenAI wire helpers that both servers (the gateway and the engine) speak, in one place.

Standard library only, so the engine can import it without importing the gateway (and the gateway
without importing torch): the error type and its body, SSE framing, the text of a chat message's
content, and watching an ASGI connection for the client going away. Starlette glue lives beside it in
`openai_wire.responses`.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

SSE_DONE = b"data: [DONE]\n\n"


class APIError(Exception):
    """An error answered with OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def sse_event(data: bytes) -> bytes:
    """One server-sent event carrying an already-serialised JSON payload."""
    return b"data: " + data + b"\n\n"


# ---------------------------------------------------------------- message text


def content_text(content: object) -> str:
    """The text of a message's `content`: a string as is; of a list of parts, the text parts joined by
    newlines (images, audio and files have none); None (a tool-call turn) is empty."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(part for part in (_part_text(p) for p in content) if part is not None)
    return str(content)


def _part_text(part: object) -> str | None:
    if isinstance(part, str):
        return part
    if isinstance(part, dict) and part.get("type") in (None, "text") and isinstance(part.get("text"), str):
        return part["text"]
    return None


def is_text_part(part: object) -> bool:
    return _part_text(part) is not None


def messages_text(messages: list) -> str:
    """Every message's text, one after another (system prompt and earlier turns included)."""
    return "\n".join(content_text(m.get("content")) for m in messages if isinstance(m, dict))


def answer_text(body: dict) -> str:
    """The first choice's text of a chat or completions response body ("" when there is none)."""
    choices = body.get("choices") or []
    first = choices[0] if choices else None
    if not isinstance(first, dict):
        return ""
    return (first.get("message") or {}).get("content") or first.get("text") or ""


def chunk_text(chunk: dict) -> str:
    """The text a streamed chunk adds, over all its choices (chat deltas or completions text)."""
    parts = []
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta")
        if isinstance(delta, dict):
            parts.append(delta.get("content") or "")
        elif "text" in choice:
            parts.append(choice.get("text") or "")
    return "".join(parts)


# ---------------------------------------------------------------- the client going away


class ClientClosed(Exception):
    """The client went away before the response was complete."""


async def wait_for_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    """Return when the ASGI connection reports `http.disconnect` (the request body already read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(receive: Callable[[], Awaitable[dict]], awaitable: Awaitable[T]) -> T:
    """Await `awaitable` in this task, but cancel it and raise ClientClosed if the client disconnects first.

    One watcher task per request (not two tasks and an asyncio.wait): this is on the gateway's hot path.
    """
    task = asyncio.current_task()
    assert task is not None
    closed = False

    async def watch() -> None:
        nonlocal closed
        await wait_for_disconnect(receive)
        closed = True
        task.cancel()

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        return await awaitable
    except asyncio.CancelledError:
        if closed:
            task.uncancel()
            raise ClientClosed() from None
        raise
    finally:
        watcher.cancel()
