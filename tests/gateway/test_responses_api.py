"""The Responses API in terms of chat completions (gateway/responses_api.py): request, response and stream."""
from __future__ import annotations

import asyncio

from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from gateway import responses_api

REQUEST = {"model": "r", "instructions": "be brief", "max_output_tokens": 32, "temperature": 0.2,
           "input": [{"role": "developer", "content": "rules"},
                     {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text",
                                                                                        "text": "b"}]}],
           "text": {"format": {"type": "json_object"}}}


def _chunk(text: str | None = None, finish: str | None = None, usage: dict | None = None) -> dict:
    choices = [] if usage else [{"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}]
    out = {"id": "c", "object": "chat.completion.chunk", "model": "small", "choices": choices}
    if usage:
        out["usage"] = usage
        out["switchyard"] = {"device_seconds": 0.1, "utilisation": 0.5}
    return out


def test_a_request_becomes_a_chat_body() -> None:
    chat = responses_api.to_chat(REQUEST)
    assert chat == {"model": "r", "max_tokens": 32, "temperature": 0.2, "response_format": {"type": "json_object"},
                    "messages": [{"role": "system", "content": "be brief"}, {"role": "system", "content": "rules"},
                                 {"role": "user", "content": [{"type": "text", "text": "a"},
                                                              {"type": "text", "text": "b"}]}]}


def test_a_completion_becomes_a_response_the_sdk_parses() -> None:
    body = responses_api.to_response(
        {"id": "c", "created": 5, "model": "small", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "length"}],
         "usage": {"prompt_tokens": 3, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 1}}},
        REQUEST)
    parsed = Response.model_validate(body)
    assert parsed.output_text == "hi" and parsed.status == "incomplete"
    assert parsed.incomplete_details.reason == "max_output_tokens" and parsed.created_at == 5
    assert (parsed.usage.input_tokens, parsed.usage.output_tokens, parsed.usage.total_tokens) == (3, 2, 5)
    assert parsed.usage.input_tokens_details.cached_tokens == 1 and parsed.instructions == "be brief"


def test_a_chat_stream_becomes_typed_events() -> None:
    async def chunks():
        yield _chunk("he")
        yield _chunk("llo")
        yield _chunk(finish="stop")
        yield _chunk(usage={"prompt_tokens": 4, "completion_tokens": 2})

    async def collect():
        return [e async for e in responses_api.stream_events(chunks(), REQUEST)]

    events = asyncio.run(collect())
    adapter = TypeAdapter(ResponseStreamEvent)
    typed = [adapter.validate_python({k: v for k, v in e.items() if k != "switchyard"}) for e in events]
    assert [e.type for e in typed] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in typed] == list(range(10))
    assert typed[-1].response.output_text == "hello" and typed[-1].response.usage.output_tokens == 2
    assert events[-1]["switchyard"] == {"device_seconds": 0.1, "utilisation": 0.5}  # for the relay's tally


def test_an_empty_stream_emits_nothing_and_closes_its_source() -> None:
    closed = []

    class Empty:
        def __aiter__(self):
            return self

        async def __anext__(self):
            raise StopAsyncIteration

        async def aclose(self):
            closed.append(True)

    async def collect():
        return [e async for e in responses_api.stream_events(Empty(), REQUEST)]

    assert asyncio.run(collect()) == [] and closed == [True]
