"""The Responses API (`POST /v1/responses`) in terms of chat completions, for what speaks only chat.

The gateway routes, estimates and checks capabilities on a Responses request in its chat form (`to_chat`),
and engine backends serve it as a chat completion: the request goes out as a chat body, the completion
comes back as a Response object (`to_response`), and a chat stream is re-emitted as the Responses stream's
typed events (`stream_events`: response.created, response.output_item.added, response.content_part.added,
response.output_text.delta…, response.output_text.done, response.content_part.done,
response.output_item.done, response.completed — or response.incomplete when the token limit cut it short).
Text in, text out: the request has passed openai_wire/requests.py's ResponsesRequest, which refuses
what this translation cannot carry (built-in tools, images, `previous_response_id`).
"""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from openai_wire import chunk_text

# Stream events that end a response and carry its usage (the relay's tally reads them).
END_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})
_ROLES = {"developer": "system"}  # the engine's chat templates know system, not developer
_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


# ---------------------------------------------------------------- request


def to_chat(body: dict) -> dict:
    """A (validated) Responses request as the equivalent chat completions request."""
    messages: list[dict] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    items = body["input"]
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    else:
        for item in items:
            content = item["content"]
            if isinstance(content, list):  # input_text / output_text parts → chat text parts
                content = [{"type": "text", "text": part["text"]} for part in content]
            messages.append({"role": _ROLES.get(item["role"], item["role"]), "content": content})
    chat: dict[str, Any] = {"model": body["model"], "messages": messages}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for name in ("temperature", "top_p", "user", "metadata", "stream"):
        if body.get(name) is not None:
            chat[name] = body[name]
    fmt = (body.get("text") or {}).get("format") or {}
    if fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    return chat


# ---------------------------------------------------------------- response


def new_ids() -> tuple[str, str]:
    """A response id and its message item's id."""
    return "resp_" + uuid.uuid4().hex, "msg_" + uuid.uuid4().hex


def message_item(item_id: str, text: str | None, status: str) -> dict:
    """The one output item: an assistant message with one output_text part (none while in progress)."""
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def usage_of(chat_usage: dict | None) -> dict | None:
    """Chat `usage` as Responses usage."""
    if not chat_usage:
        return None
    prompt, completion = int(chat_usage.get("prompt_tokens") or 0), int(chat_usage.get("completion_tokens") or 0)
    cached = int((chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + completion}


def response_object(request: dict, response_id: str, created: int, model: str, *, status: str,
                    output: list[dict], usage: dict | None, finish_reason: str | None = None) -> dict:
    """A Response as OpenAI returns it, echoing the request's settings."""
    reason = _INCOMPLETE.get(finish_reason or "") if status == "incomplete" else None
    return {"id": response_id, "object": "response", "created_at": created, "status": status, "model": model,
            "output": output, "error": None, "incomplete_details": {"reason": reason} if reason else None,
            "instructions": request.get("instructions"), "max_output_tokens": request.get("max_output_tokens"),
            "metadata": request.get("metadata") or {}, "parallel_tool_calls": True,
            "previous_response_id": None, "store": False, "temperature": request.get("temperature"),
            "top_p": request.get("top_p"), "text": request.get("text") or {"format": {"type": "text"}},
            "tool_choice": "auto", "tools": [], "truncation": "disabled", "user": request.get("user"),
            "usage": usage}


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason in _INCOMPLETE else "completed"


def to_response(chat_body: dict, request: dict) -> dict:
    """A chat completion (plain) as the Response for `request`."""
    choices = chat_body.get("choices") or [{}]
    choice = choices[0]
    text = (choice.get("message") or {}).get("content") or ""
    finish = choice.get("finish_reason")
    response_id, item_id = new_ids()
    status = _status(finish)
    body = response_object(request, response_id, int(chat_body.get("created") or time.time()),
                           chat_body.get("model") or request["model"], status=status,
                           output=[message_item(item_id, text, "completed")], usage=usage_of(chat_body.get("usage")),
                           finish_reason=finish)
    if "switchyard" in chat_body:
        body["switchyard"] = chat_body["switchyard"]  # the engine's device time, for accounting (popped later)
    return body


def output_text(body: dict) -> str:
    """A Response's text: its messages' output_text parts joined (the SDK's `response.output_text`)."""
    return "".join(part.get("text") or "" for item in body.get("output") or () if item.get("type") == "message"
                   for part in item.get("content") or () if part.get("type") == "output_text")


# ---------------------------------------------------------------- stream


async def stream_events(chunks: AsyncIterator[dict], request: dict) -> AsyncIterator[dict]:
    """Chat completion chunks (ending with the usage chunk) as Responses stream events. Nothing is emitted
    before the first chunk arrives, so a backend that fails to start still falls back. Closing this closes
    `chunks`."""
    response_id, item_id = new_ids()
    created, model = int(time.time()), request["model"]
    part_at = {"item_id": item_id, "output_index": 0, "content_index": 0}
    seq = 0
    texts: list[str] = []
    finish: str | None = None
    usage: dict | None = None
    ext: dict | None = None

    def event(kind: str, **fields: Any) -> dict:
        nonlocal seq
        seq += 1
        return {"type": kind, "sequence_number": seq - 1, **fields}

    def response(status: str, output: list[dict], response_usage: dict | None) -> dict:
        return response_object(request, response_id, created, model, status=status, output=output,
                               usage=response_usage, finish_reason=finish)

    try:
        async for chunk in chunks:
            if seq == 0:
                model = chunk.get("model") or model
                yield event("response.created", response=response("in_progress", [], None))
                yield event("response.in_progress", response=response("in_progress", [], None))
                yield event("response.output_item.added", output_index=0,
                            item=message_item(item_id, None, "in_progress"))
                yield event("response.content_part.added", **part_at,
                            part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            for choice in chunk.get("choices") or ():
                finish = choice.get("finish_reason") or finish
            if chunk.get("usage"):
                usage = usage_of(chunk["usage"])
            if isinstance(chunk.get("switchyard"), dict):
                ext = chunk["switchyard"]
            text = chunk_text(chunk)
            if text:
                texts.append(text)
                yield event("response.output_text.delta", **part_at, delta=text, logprobs=[])
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()
    if seq == 0:
        return  # nothing arrived: the caller reports the empty stream
    text = "".join(texts)
    status = _status(finish)
    yield event("response.output_text.done", **part_at, text=text, logprobs=[])
    yield event("response.content_part.done", **part_at,
                part={"type": "output_text", "text": text, "annotations": [], "logprobs": []})
    item = message_item(item_id, text, "completed")
    yield event("response.output_item.done", output_index=0, item=item)
    last = event("response.completed" if status == "completed" else "response.incomplete",
                 response=response(status, [item], usage))
    if ext is not None:
        last["switchyard"] = ext  # the engine's device time, for the relay's tally (popped before the client)
    yield last
