"""Structured outputs and tools through the engine's HTTP server, with the official `openai` SDK and the real
SmolLM2 model (`switchyard engine serve` as a subprocess): `.parse()` with a pydantic model, tool calls with
tool_choice required / named / auto (plain and streamed, reassembled by the SDK), max_tokens cutting a JSON short
(finish_reason "length"); an over-long prompt refused with a 400 before queueing while a normal request and
/metrics still answer; streamed completions never carry `"text": null`."""
from __future__ import annotations

import json
import threading
import time

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from hosted.models import SMOLLM2_MODEL
from tests.hosted.serving_helpers import EngineProcess

openai = pytest.importorskip("openai")

MODEL = "smollm2"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}


@pytest.fixture(scope="module")
def server():
    proc = EngineProcess(SMOLLM2_MODEL, "--served-model-name", MODEL, "--max-num-seqs", "8",
                         "--kv-cache-gb", "0.25", "--max-model-len", "2048")
    yield proc
    assert proc.stop() == 0, proc.log


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population: int
    landmarks: list[str] = Field(min_length=1, max_length=3)


def test_sdk_parse_with_a_pydantic_model(client):
    done = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Tell me about Paris."}], response_format=City,
        temperature=0, max_tokens=200)
    choice = done.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)
    jsonschema.validate(json.loads(choice.message.content), City.model_json_schema())


def test_max_tokens_cutting_json_is_length(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me about Paris."}], max_tokens=5, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": City.model_json_schema()}})
    assert resp.choices[0].finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(resp.choices[0].message.content)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls(client, choice):
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather like in Rome?"}],
        tools=[WEATHER, ADD], tool_choice=choice, temperature=0, max_tokens=120)
    c = resp.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_named_choice_forces_that_function_and_history_renders(client):
    messages = [{"role": "user", "content": "What is 2 plus 3?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "5"},
                {"role": "user", "content": "And the weather in Oslo?"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, ADD], temperature=0,
                                          tool_choice={"type": "function", "function": {"name": "add"}},
                                          max_tokens=60)
    call = resp.choices[0].message.tool_calls[0]
    assert call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), ADD["function"]["parameters"])


def test_auto_gives_text_or_a_valid_call(client):
    for question in ("What is the weather in Madrid?", "Write one sentence about the sea."):
        resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                              tools=[WEATHER], tool_choice="auto", temperature=0, max_tokens=80)
        c = resp.choices[0]
        if c.message.tool_calls:
            assert c.finish_reason == "tool_calls"
            jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments),
                                WEATHER["function"]["parameters"])
        else:
            assert c.message.content and "<tool_call>" not in c.message.content


def test_streamed_tool_calls_reassemble_in_the_sdk(client):
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Lima, in celsius?"}],
              "tools": [WEATHER, ADD], "tool_choice": "required", "temperature": 0, "max_tokens": 120}
    plain = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    with client.chat.completions.stream(**kwargs) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    c = final.choices[0]
    assert c.finish_reason == "tool_calls"
    call = c.message.tool_calls[0]
    assert call.function.name == plain.function.name
    assert json.loads(call.function.arguments) == json.loads(plain.function.arguments)
    raw = list(client.chat.completions.create(**kwargs, stream=True))
    firsts = [tc for ch in raw for tc in (ch.choices[0].delta.tool_calls or []) if tc.id]
    assert len(firsts) == 1 and firsts[0].function.name == "get_weather" and firsts[0].index == 0
    frags = [tc.function.arguments for ch in raw for tc in (ch.choices[0].delta.tool_calls or []) if not tc.id]
    assert len(frags) > 1 and json.loads("".join(frags)) == json.loads(call.function.arguments)


def test_bad_tool_requests_are_400s(client):
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert err.value.body["param"] == "tool_choice.function.name"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=msgs, tool_choice="required")
    assert err.value.body["param"] == "tool_choice"


def test_streamed_completions_never_send_null_text(server):
    with httpx.stream("POST", server.base_url + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert texts and all(isinstance(t, str) for t in texts)
    assert chunks[-2]["choices"][0]["finish_reason"] is not None and chunks[-2]["choices"][0]["text"] == ""


def test_huge_prompt_is_refused_without_stalling_others(server, client):
    huge = "lorem ipsum dolor " * 1_200_000  # ~21 MB
    result: dict = {}

    def post_huge():
        t0 = time.monotonic()
        r = httpx.post(server.base_url + "/v1/chat/completions", timeout=120,
                       json={"model": MODEL, "messages": [{"role": "user", "content": huge}], "max_tokens": 4})
        result["status"], result["body"], result["seconds"] = r.status_code, r.json(), time.monotonic() - t0

    thread = threading.Thread(target=post_huge)
    thread.start()
    t0 = time.monotonic()
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    normal = time.monotonic() - t0
    m = httpx.get(server.base_url + "/metrics", timeout=30)
    thread.join(120)
    assert resp.choices[0].message.content is not None and m.status_code == 200
    assert result["status"] == 400, result
    assert result["body"]["error"]["code"] == "context_length_exceeded"
    assert result["body"]["error"]["param"] == "messages"
    assert normal < 30 and result["seconds"] < 30  # generous: the reported stall was 25-43 s
