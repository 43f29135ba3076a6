"""openai_wire/requests.py, engine_requests.py and request_errors.py: one schema, the engine's extensions as
subclasses that never tighten an OpenAI field, and one converter to the API's 400."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from openai_wire import APIError
from openai_wire.engine_requests import (
    EXTENSION_FIELDS,
    EngineChatRequest,
    EngineCompletionRequest,
    template_dict,
)
from openai_wire.request_errors import parse, to_api_error
from openai_wire.requests import ChatRequest, CompletionRequest

MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("base, engine", [(ChatRequest, EngineChatRequest), (CompletionRequest, EngineCompletionRequest)])
def test_the_engine_holds_every_openai_field_to_the_gateways_rule(base, engine):
    """A subclass that redefined an OpenAI field could refuse what the gateway admitted: none is redefined."""
    for name, field in base.model_fields.items():
        assert engine.model_fields[name].annotation == field.annotation, name
        assert engine.model_fields[name].metadata == field.metadata, name
    assert set(engine.model_fields) - set(base.model_fields) <= EXTENSION_FIELDS


def test_unknown_fields_are_kept_for_the_engine_to_refuse_by_name():
    req = parse(EngineChatRequest, {"model": "m", "messages": MSG, "brand_new": 1, "top_k": 3})
    assert req.model_extra == {"brand_new": 1} and req.top_k == 3
    assert parse(EngineCompletionRequest, {"model": "m", "prompt": "x", "add_generation_prompt": False}).model_extra \
        == {"add_generation_prompt": False}  # a chat extension is unknown to completions


def test_a_message_reaches_the_template_as_sent_with_its_text_parts_joined():
    req = parse(EngineChatRequest, {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
         "reasoning_content": "kept"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "f", "arguments": "{}"}}]}]})
    user, assistant = (template_dict(m) for m in req.messages)
    assert user == {"role": "user", "content": "a\nb", "reasoning_content": "kept"}
    assert assistant == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


def test_an_empty_stop_string_is_ignored_not_refused():
    req = parse(EngineChatRequest, {"model": "m", "messages": MSG, "stop": ["", "END"]})
    assert req.stop_list == ["END"]


@pytest.mark.parametrize("body, param, code", [
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages[0].content[0]", None),
    ({"model": "m", "messages": MSG, "tools": [{"type": "function", "function": {"name": 5}}]},
     "tools[0].function.name", None),
    ({"model": "m", "messages": MSG, "top_logprobs": 1}, "top_logprobs", None),
    ({"model": "m", "prompt": ""}, "prompt", "empty_prompt"),
])
def test_one_converter_names_the_field(body, param, code):
    model = EngineCompletionRequest if "prompt" in body else EngineChatRequest
    with pytest.raises(ValidationError) as err:
        model.model_validate(body)
    api = to_api_error(err.value)
    assert (api.status, api.type, api.param, api.code) == (400, "invalid_request_error", param, code)
    assert api.message.startswith(f"Invalid request: '{param}' ") and "Input should" not in api.message


def test_a_body_that_is_not_an_object_is_a_400():
    with pytest.raises(APIError) as err:
        parse(EngineChatRequest, ["not", "an", "object"])
    assert err.value.status == 400 and err.value.param is None
