"""The clients apps build on OpenAI — the openai SDK, langchain-openai, instructor and litellm as a client —
against both backend kinds through the real gateway: a litellm backend (the stand-in upstream, whose received
payload is checked field by field) and a real embedded engine (constrained decoding makes tool calls and
structured outputs parse on a random-weight model: the schemas below only admit enums and booleans)."""
from __future__ import annotations

import asyncio
from typing import Literal

import openai
import pytest
from pydantic import BaseModel

from gateway.testing.standin import standin_stats
from tests.e2e.conftest import MASTER_KEY, ledger_rows, run_gateway
from tests.e2e.policy_builder import litellm, policy
from tests.hosted.serving_helpers import build_tiny_chat_model


def policy_text(standin: str, model_dir: object) -> str:
    embedded = {"kind": "engine", "launch": "embedded", "model": "tiny", "engine_model_path": str(model_dir),
                "engine_args": {"threads": 1, "max-num-seqs": 8}, "gpu_hour_usd": 2.0}
    return policy(backends={"api": litellm(standin), "emb": litellm(standin, model="openai/text-embedding-3-small"),
                            "local": embedded},
                  routes={"via-api": {"backend": "api"}, "via-engine": {"backend": "local"},
                          "embed": {"backend": "emb"}})
ASK = [{"role": "user", "content": "What is the capital of France?"}]


class Capital(BaseModel):
    capital: Literal["Paris", "Rome", "Madrid"]
    sure: bool


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def standin():
    from gateway.testing.standin import run_standin

    with run_standin(engine_extension=True) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def gateway(standin, tmp_path_factory):
    import os

    os.environ["STANDIN_API_KEY"] = "sk-standin"
    # a long context: tool definitions and schemas take hundreds of this tokenizer's small tokens
    model_dir = build_tiny_chat_model(tmp_path_factory.mktemp("compat-model"), max_position_embeddings=4096)
    with run_gateway(policy_text(standin, model_dir), tmp_path_factory.mktemp("compat")) as gw:
        yield gw


def sdk(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key=MASTER_KEY, max_retries=0, timeout=60)


# ------------------------------------------------------------------------------------------------ openai SDK

@pytest.mark.parametrize("route", ["via-api", "via-engine"])
def test_openai_sdk_sync_async_stream_raw(gateway, route) -> None:
    client = sdk(gateway)
    plain = client.chat.completions.create(model=route, messages=ASK, max_tokens=4, temperature=0)
    assert plain.choices[0].message.content and plain.usage.completion_tokens >= 1
    streamed = list(client.chat.completions.create(model=route, messages=ASK, max_tokens=4, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    assert streamed[-1].usage is not None and streamed[-1].usage.completion_tokens >= 1
    raw = client.chat.completions.with_raw_response.create(model=route, messages=ASK, max_tokens=2)
    assert raw.headers["x-request-id"].startswith("req_") and raw.parse().id

    async def run() -> str:
        async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key=MASTER_KEY, max_retries=0) as aclient:
            reply = await aclient.chat.completions.create(model=route, messages=ASK, max_tokens=3)
            return reply.choices[0].message.content

    assert asyncio.run(run())
    assert client.models.retrieve(route).id == route
    response = client.responses.create(model=route, input="What is the capital of France?", max_output_tokens=16)
    assert response.output_text and response.usage.output_tokens >= 1


def test_openai_sdk_parse_and_tools_on_the_engine(gateway) -> None:
    client = sdk(gateway)
    parsed = client.chat.completions.parse(model="via-engine", messages=ASK, response_format=Capital, max_tokens=300)
    assert isinstance(parsed.choices[0].message.parsed, Capital)
    call = client.chat.completions.create(model="via-engine", messages=ASK, tools=[WEATHER_TOOL], max_tokens=300,
                                          tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [tool_call] = call.choices[0].message.tool_calls
    assert tool_call.function.name == "get_weather" and call.choices[0].finish_reason == "tool_calls"
    import json

    assert set(json.loads(tool_call.function.arguments)) == {"city", "unit"}


def test_openai_sdk_on_the_api_path_forwards_tools_and_formats(gateway, standin) -> None:
    client = sdk(gateway)
    client.chat.completions.create(model="via-api", messages=ASK, tools=[WEATHER_TOOL], tool_choice="required",
                                   response_format={"type": "json_object"}, max_tokens=4, seed=7, user="u-1")
    seen = standin_stats(standin)["last_payload"]
    assert seen["tools"] == [WEATHER_TOOL] and seen["tool_choice"] == "required"
    assert seen["response_format"] == {"type": "json_object"} and seen["seed"] == 7 and seen["user"] == "u-1"
    embedded = client.embeddings.create(model="embed", input=["one", "two"])
    assert len(embedded.data) == 2 and embedded.usage.prompt_tokens >= 2
    with pytest.raises(openai.BadRequestError) as err:  # the engine has no embeddings: a clear 400
        client.embeddings.create(model="via-engine", input="one")
    assert err.value.code == "unsupported_capability"


# ------------------------------------------------------------------------------------------- langchain-openai

@pytest.mark.parametrize("route", ["via-api", "via-engine"])
def test_langchain_invoke_and_stream(gateway, route) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=route, base_url=gateway.base_url, api_key=MASTER_KEY, max_retries=0, max_tokens=4)
    reply = llm.invoke("What is the capital of France?")
    assert reply.content and reply.usage_metadata["output_tokens"] >= 1
    pieces = [chunk.content for chunk in llm.stream("What is the capital of France?")]
    assert "".join(pieces)


def test_langchain_tools_and_structured_output_on_the_engine(gateway) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="via-engine", base_url=gateway.base_url, api_key=MASTER_KEY, max_retries=0,
                     max_tokens=300)
    message = llm.bind_tools([WEATHER_TOOL], tool_choice="get_weather").invoke("Weather in Paris?")
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city", "unit"}
    answer = llm.with_structured_output(Capital).invoke("What is the capital of France?")
    assert isinstance(answer, Capital)


def test_langchain_bind_tools_on_the_api_path_reaches_the_provider(gateway, standin) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="via-api", base_url=gateway.base_url, api_key=MASTER_KEY, max_retries=0, max_tokens=4)
    llm.bind_tools([WEATHER_TOOL]).invoke("Weather in Paris?")
    seen = standin_stats(standin)["last_payload"]
    assert [t["function"]["name"] for t in seen["tools"]] == ["get_weather"]


# ------------------------------------------------------------------------------------------------- instructor

@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_on_the_engine(gateway, mode) -> None:
    import instructor

    client = instructor.from_openai(sdk(gateway), mode=getattr(instructor.Mode, mode))
    answer = client.chat.completions.create(model="via-engine", response_model=Capital, messages=ASK,
                                            max_tokens=300, max_retries=0)
    assert isinstance(answer, Capital)


# ------------------------------------------------------------------------------------------- litellm as a client

@pytest.mark.parametrize("route", ["via-api", "via-engine"])
def test_litellm_as_a_client(gateway, route) -> None:
    import litellm

    kwargs = {"model": f"openai/{route}", "api_base": gateway.base_url, "api_key": MASTER_KEY, "messages": ASK,
                  "max_tokens": 4, "num_retries": 0}
    reply = litellm.completion(**kwargs)
    assert reply.choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in litellm.completion(stream=True, **kwargs))
    assert streamed
    assert asyncio.run(litellm.acompletion(**kwargs)).choices[0].message.content


def test_every_request_was_logged(gateway) -> None:
    gateway.call(gateway.gw.services.ledger.flush)
    rows = ledger_rows(gateway.config.database_url)
    assert {r["endpoint"] for r in rows} >= {"chat.completions", "responses", "embeddings"}
    assert {r["backend"] for r in rows if r["status"] == "ok"} == {"api", "emb", "local"}
