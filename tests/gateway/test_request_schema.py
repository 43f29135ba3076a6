"""gateway/request_schema.py: OpenAI's request schema, the field path of the first problem, and what passes."""
from __future__ import annotations

import pytest

from gateway.admission import validate
from gateway.backends.base import UpstreamError
from gateway.backends.litellm_backend import LiteLLMBackend
from gateway.backends.resilience import BreakerRegistry, complete_with_fallbacks
from gateway.policy import BackendSpec
from gateway.testing.standin import run_standin, standin_stats
from openai_wire import APIError

U = [{"role": "user", "content": "hi"}]


def chat(**fields) -> dict:
    return {"model": "m", "messages": U, **fields}


VALID = [
    chat(),
    chat(temperature=0, top_p=1, n=2, max_tokens=5, max_completion_tokens=5, presence_penalty=-2,
         frequency_penalty=2, logprobs=True, top_logprobs=20, stop="x", seed=7, user="u", stream=True,
         stream_options={"include_usage": True}, parallel_tool_calls=False, service_tier="auto"),
    chat(temperature=None, stop=None, metadata={"reference": "r" * 5000, "team": "docs"}),  # reference is ours
    chat(unknown_vendor_field={"anything": [1]}, top_k=5),  # unknown top-level fields pass through
    chat(messages=[{"role": "developer", "content": "d"}, {"role": "system", "content": [{"type": "text", "text": "s"}]},
                   {"role": "user", "content": [{"type": "text", "text": "look"},
                                                {"type": "image_url", "image_url": {"url": "data:x", "detail": "low"}},
                                                {"type": "input_audio", "input_audio": {"data": "b64", "format": "wav"}},
                                                {"type": "file", "file": {"file_id": "f1"}}]},
                   {"role": "assistant", "content": None,
                    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                   {"role": "tool", "tool_call_id": "c1", "content": "42"},
                   {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
                   {"role": "function", "name": "f", "content": None}]),
    chat(tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"},
                                                 "strict": True}}],
         tool_choice={"type": "function", "function": {"name": "get_weather"}}),
    chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required"),
    chat(response_format={"type": "json_schema", "json_schema": {"name": "out", "schema": {"type": "object"},
                                                                  "strict": True}}),
    chat(response_format={"type": "json_object"}, logit_bias={"50256": -100, "11": 2.5}),
    {"model": "m", "prompt": "once upon"},
    {"model": "m", "prompt": ["a", "b"], "logprobs": 2, "echo": True, "best_of": 2, "suffix": "."},
    {"model": "m", "prompt": [1, 2, 3]},
    {"model": "m", "prompt": [[1, 2], [3]]},
]


@pytest.mark.parametrize("body", VALID)
def test_well_formed_requests_pass_unchanged(body):
    endpoint = "completions" if "prompt" in body else "chat"
    before = repr(body)
    assert validate(body, endpoint) is body and repr(body) == before


INVALID = [
    (chat(messages=[{"role": "user", "content": 5}]), "messages[0].content", "a string or an array"),
    (chat(messages=[{"role": "user"}]), "messages[0].content", "is required"),
    (chat(messages=[*U, {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     "messages[1].content[0].image_url.url", "is required"),
    (chat(messages=[{"role": "user", "content": [{"type": "video", "video": {}}]}]), "messages[0].content[0]",
     "'type' of text, image_url"),
    (chat(messages=[{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]),
     "messages[0].content[0]", "'type' of text"),
    (chat(messages=["hi"]), "messages[0]", "'role' of system, developer, user"),
    (chat(messages=[{"role": "assistant"}]), "messages[0].content", "without 'tool_calls'"),
    (chat(messages=[{"role": "tool", "content": "x"}]), "messages[0].tool_call_id", "is required"),
    (chat(messages=[{"role": "assistant", "tool_calls": [{"id": "1", "function": {"name": "f"}}]}]),
     "messages[0].tool_calls[0].type", "is required"),
    (chat(temperature=2.5), "temperature", "less than or equal to 2"),
    (chat(temperature=True), "temperature", "must be a number"),
    (chat(top_p=-0.1), "top_p", "greater than or equal to 0"),
    (chat(n=0), "n", "greater than or equal to 1"),
    (chat(max_tokens=0), "max_tokens", "greater than or equal to 1"),
    (chat(max_completion_tokens=1.5), "max_completion_tokens", "must be an integer"),
    (chat(presence_penalty=3), "presence_penalty", "less than or equal to 2"),
    (chat(frequency_penalty="1"), "frequency_penalty", "must be a number"),
    (chat(logprobs=1), "logprobs", "must be a boolean"),
    (chat(top_logprobs=21, logprobs=True), "top_logprobs", "less than or equal to 20"),
    (chat(top_logprobs=2), "top_logprobs", "requires 'logprobs': true"),
    (chat(stop=["1", "2", "3", "4", "5"]), "stop", "at most 4"),
    (chat(stop=5), "stop", "a string or an array"),
    (chat(seed="7"), "seed", "must be an integer"),
    (chat(stream="yes"), "stream", "must be a boolean"),
    (chat(stream_options=True), "stream_options", "must be an object"),
    (chat(response_format="json"), "response_format", "json_object or json_schema"),
    (chat(response_format={"type": "yaml"}), "response_format", "json_object or json_schema"),
    (chat(response_format={"type": "json_schema"}), "response_format.json_schema", "is required"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "has space"}}),
     "response_format.json_schema.name", "a-z"),
    (chat(tools={"type": "function"}), "tools", "must be an array"),
    (chat(tools=[{"type": "retrieval"}]), "tools[0].type", "must be 'function'"),
    (chat(tools=[{"type": "function", "function": {"description": "d"}}]), "tools[0].function.name", "required"),
    (chat(tool_choice="sometimes", tools=[{"type": "function", "function": {"name": "f"}}]), "tool_choice",
     "'none', 'auto' or 'required'"),
    (chat(tool_choice="required"), "tool_choice", "needs 'tools'"),
    (chat(tools=[{"type": "function", "function": {"name": "f"}}],
          tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice.function.name", "not in 'tools'"),
    (chat(parallel_tool_calls="no"), "parallel_tool_calls", "must be a boolean"),
    (chat(metadata={f"k{i}": "v" for i in range(17)}), "metadata", "at most 16"),
    (chat(metadata={"k" * 65: "v"}), "metadata", "at most 64"),
    (chat(metadata={"k": "v" * 513}), "metadata", "at most 512"),
    (chat(metadata={"k": 1}), "metadata", "must be strings"),
    (chat(metadata="tag"), "metadata", "must be an object"),
    (chat(user=42), "user", "must be a string"),
    (chat(logit_bias={"abc": 1}), "logit_bias", "token ids"),
    (chat(logit_bias={"1": 101}), "logit_bias", "-100 to 100"),
    (chat(service_tier=1), "service_tier", "must be a string"),
    ({"model": "m", "prompt": ""}, "prompt", "non-empty"),
    ({"model": "m", "prompt": [1, "a"]}, "prompt", "non-empty"),
    ({"model": "m", "prompt": "x", "logprobs": True}, "logprobs", "must be an integer"),
    ({"model": "m", "prompt": "x", "logprobs": 6}, "logprobs", "less than or equal to 5"),
    ({"model": "m", "prompt": "x", "echo": "y"}, "echo", "must be a boolean"),
    ({"model": "", "messages": U}, "model", "non-empty"),
    ({"model": "m", "messages": []}, "messages", "non-empty"),
]


@pytest.mark.parametrize("body, param, words", INVALID)
def test_each_problem_is_a_400_naming_the_field(body, param, words):
    endpoint = "completions" if "prompt" in body else "chat"
    with pytest.raises(APIError) as err:
        validate(body, endpoint)
    e = err.value
    assert (e.status, e.type, e.param) == (400, "invalid_request_error", param), e.message
    assert words in e.message
    assert "Input should" not in e.message and "pydantic" not in e.message.lower()


@pytest.mark.parametrize("fields", [
    {"messages": [{"role": "user", "content": 42}]},
    {"messages": U, "response_format": "json"},
])
async def test_litellm_refusing_a_request_before_sending_it_is_the_clients_fault(fields):
    """Past the schema (a gateway that did not check), litellm raises a TypeError while building the provider's
    request: a kind-"request" error — no retry, no fallback, no breaker verdict, nothing sent."""
    with run_standin() as first, run_standin() as second:
        specs = [BackendSpec(name=name, kind="litellm", model="openai/m", api_base=url, api_key_env=None,
                             max_retries=3, failure_threshold=1) for name, url in (("a", first), ("b", second))]
        chain = [LiteLLMBackend(spec) for spec in specs]
        breakers = BreakerRegistry()
        with pytest.raises(UpstreamError) as err:
            await complete_with_fallbacks(chain, {"model": "m", **fields}, "chat", breakers)
        e = err.value
        assert (e.kind, e.retryable, e.fallback, e.counts_against_backend, e.attempts) == (
            "request", False, False, False, 1)
        assert "litellm" not in (e.detail or "").lower() and "OpenAIException" not in (e.detail or "")
        assert standin_stats(first)["requests"] == 0 and standin_stats(second)["requests"] == 0
        assert breakers.states() == {"a": 0}


@pytest.mark.parametrize("dimensions", [65_537, 10**9])
def test_embedding_dimensions_past_any_model_are_a_400(dimensions):
    """A fuzzer's `dimensions: 10**9` reached the upstream (the stand-in allocated gigabytes): bounded now."""
    with pytest.raises(APIError) as info:
        validate({"model": "m", "input": "hi", "dimensions": dimensions}, "embeddings")
    assert info.value.status == 400 and info.value.param == "dimensions"


def test_embedding_dimensions_within_the_bound_pass():
    assert validate({"model": "m", "input": "hi", "dimensions": 3072}, "embeddings")["dimensions"] == 3072
