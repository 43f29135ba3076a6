"""`POST /v1/responses` through a real gateway with the official openai SDK (`client.responses.create`), plain and
streamed: litellm backends pass it to litellm's Responses support (the stand-in's /v1/responses), engine
backends get it as a chat completion and the gateway translates the answer back (gateway/responses_api.py)."""
from __future__ import annotations

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseCompletedEvent, ResponseTextDeltaEvent

from gateway.keys import create_key
from gateway.testing.standin import standin_stats
from tests.e2e.conftest import MASTER_KEY, ledger_rows, run_gateway
from tests.e2e.policy_builder import engine, litellm, policy
from tests.hosted.serving_helpers import build_tiny_chat_model


def policy_text(standin: str) -> str:
    return policy(backends={"api": litellm(standin, input_usd_per_mtok=10, output_usd_per_mtok=90),
                            "local": engine(standin, model="small", gpu_hour_usd=2.0)},
                  routes={"hosted": {"backend": "api"}, "engine": {"backend": "local"}})
TEXT16 = " ".join(f"tok{i}" for i in range(16))
EVENTS = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
          *["response.output_text.delta"] * 16, "response.output_text.done", "response.content_part.done",
          "response.output_item.done", "response.completed"]


@pytest.fixture
def gateway(standin, tmp_path):
    with run_gateway(policy_text(standin), tmp_path) as running:
        yield running


def _rows(gateway, where: str = "1=1") -> list[dict]:
    gateway.call(gateway.gw.services.ledger.flush)
    return ledger_rows(gateway.config.database_url, where)


def _client(gateway, key: str = MASTER_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key=key, max_retries=0)


@pytest.mark.parametrize(("route", "backend"), [("hosted", "api"), ("engine", "local")])
def test_a_plain_response_on_both_backend_kinds(gateway, standin, route, backend) -> None:
    client = _client(gateway)
    raw = client.responses.with_raw_response.create(model=route, input="one two three", instructions="be brief",
                                                    max_output_tokens=16, metadata={"team": "a"}, user="u-1")
    reply = raw.parse()
    assert raw.headers["x-switchyard-backend"] == backend
    assert isinstance(reply, Response) and reply.object == "response" and reply.id.startswith("resp_")
    assert reply.output_text == TEXT16
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    [item] = reply.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert item.content[0].type == "output_text" and item.content[0].annotations == []
    assert (reply.usage.input_tokens, reply.usage.output_tokens, reply.usage.total_tokens) == (5, 16, 21)
    assert reply.metadata == {"team": "a"} and reply.instructions == "be brief"

    stats = standin_stats(standin)
    sent = stats["last_payload"]
    if backend == "api":  # the Responses request itself, to the provider's /v1/responses
        assert stats["responses_requests"] == 1 and stats["chat_requests"] == 0
        assert sent == {"model": "gpt-4o-mini", "input": "one two three", "instructions": "be brief",
                        "max_output_tokens": 16, "metadata": {"team": "a"}, "user": "u-1"}
    else:  # translated to a chat completion
        assert stats["chat_requests"] == 1 and stats["responses_requests"] == 0
        assert sent["messages"] == [{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": "one two three"}]
        assert (sent["model"], sent["max_tokens"], sent["user"], sent["metadata"]) == ("small", 16, "u-1",
                                                                                       {"team": "a"})
        assert "input" not in sent and "instructions" not in sent

    done = client.responses.create(model=route, input="four five")
    assert done.status == "completed" and done.incomplete_details is None and done.output_text == TEXT16

    rows = _rows(gateway)
    assert [(r["endpoint"], r["route"], r["backend"], r["status"], r["prompt_tokens"], r["completion_tokens"],
             r["stream"]) for r in rows] == [("responses", route, backend, "ok", 5, 16, False),
                                             ("responses", route, backend, "ok", 2, 16, False)]
    if backend == "api":
        assert rows[0]["cost_basis"] == "api_price" and rows[0]["cost_usd"] == pytest.approx(5e-5 + 16 * 9e-5)
    else:
        assert rows[0]["cost_basis"] == "gpu_amortized" and rows[0]["gpu_seconds"] > 0 and rows[0]["cost_usd"] > 0


@pytest.mark.parametrize(("route", "backend"), [("hosted", "api"), ("engine", "local")])
def test_a_streamed_response_on_both_backend_kinds(gateway, standin, route, backend) -> None:
    client = _client(gateway)
    events = list(client.responses.create(model=route, input="one two three", stream=True))
    assert [e.type for e in events] == EVENTS
    assert [e.sequence_number for e in events] == list(range(len(EVENTS)))
    deltas = [e for e in events if isinstance(e, ResponseTextDeltaEvent)]
    assert "".join(d.delta for d in deltas) == TEXT16
    assert len({d.item_id for d in deltas}) == 1
    assert events[-4].text == TEXT16
    completed = events[-1]
    assert isinstance(completed, ResponseCompletedEvent) and completed.response.status == "completed"
    assert completed.response.output_text == TEXT16
    assert (completed.response.usage.input_tokens, completed.response.usage.output_tokens) == (3, 16)
    assert completed.response.id == events[0].response.id

    with httpx.stream("POST", f"{gateway.base_url}/responses", headers={"authorization": f"Bearer {MASTER_KEY}"},
                      json={"model": route, "input": "hi", "stream": True}) as wire:
        lines = [line for line in wire.iter_lines() if line]
    assert lines[0] == "event: response.created" and lines[1].startswith("data: {")
    assert "data: [DONE]" not in lines and "switchyard" not in "".join(lines)

    rows = _rows(gateway)
    assert [(r["endpoint"], r["backend"], r["status"], r["stream"], r["prompt_tokens"], r["completion_tokens"])
            for r in rows] == [("responses", backend, "ok", True, 3, 16), ("responses", backend, "ok", True, 1, 16)]
    assert all(r["cost_usd"] > 0 and r["ttft_ms"] is not None for r in rows)


def test_message_items_and_a_json_schema_reach_the_engine_as_chat(gateway, standin) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    _client(gateway).responses.create(
        model="engine", temperature=0.5, top_p=0.9,
        input=[{"role": "developer", "content": "rules"},
               {"role": "user", "content": [{"type": "input_text", "text": "hello"}]},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}]},
               {"role": "user", "content": "again"}],
        text={"format": {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}})
    sent = standin_stats(standin)["last_payload"]
    assert sent["messages"] == [{"role": "system", "content": "rules"},
                                {"role": "user", "content": [{"type": "text", "text": "hello"}]},
                                {"role": "assistant", "content": [{"type": "text", "text": "hi"}]},
                                {"role": "user", "content": "again"}]
    assert sent["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "thing", "schema": schema, "strict": True}}
    assert (sent["temperature"], sent["top_p"]) == (0.5, 0.9)


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no conversation state"),
    ({"conversation": "conv_1"}, "conversation", "keeps no conversation state"),
    ({"tools": [{"type": "web_search"}]}, "tools", "no built-in or function tools"),
    ({"background": True}, "background", "not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/cat.png"}]}]},
     "input[0].content[0]", "text input only"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input[0]", "only message items"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "must be"),
    ({"input": 7}, "input", "a string or an array of input items"),
    ({"input": []}, "input", "must not be empty"),
    ({"input": None}, "input", "a string or an array"),
    ({"max_output_tokens": 5}, "max_output_tokens", "greater than or equal to 16"),
    ({"temperature": 3}, "temperature", "less than or equal to 2"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "is required"),
    ({"stream": "yes"}, "stream", "must be a boolean"),
])
def test_a_malformed_or_unsupported_request_is_a_400_naming_the_field(gateway, standin, body, param, words) -> None:
    reply = httpx.post(f"{gateway.base_url}/responses", headers={"authorization": f"Bearer {MASTER_KEY}"},
                       json={"model": "hosted", "input": "hi", **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert standin_stats(standin)["requests"] == 0


def test_a_missing_input_through_the_sdk(gateway, standin) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        _client(gateway).responses.create(model="engine", input="hi", previous_response_id="resp_abc")
    assert err.value.param == "previous_response_id"
    assert "send the whole conversation in 'input'" in err.value.message


def test_budgets_and_rate_limits_apply(gateway, standin) -> None:
    broke, _ = gateway.call(lambda: create_key(gateway.gw.db_engine, "team-a", budget_usd=1e-6))
    for route in ("hosted", "engine"):
        with pytest.raises(openai.RateLimitError) as err:
            _client(gateway, broke).responses.create(model=route, input="hello world", max_output_tokens=100)
        assert err.value.code == "insufficient_quota"
    slow, _ = gateway.call(lambda: create_key(gateway.gw.db_engine, "team-b", rpm=1))
    _client(gateway, slow).responses.create(model="hosted", input="hello")
    with pytest.raises(openai.RateLimitError) as err:
        _client(gateway, slow).responses.create(model="hosted", input="hello", stream=True)
    assert err.value.code == "rate_limit_exceeded"
    assert standin_stats(standin)["requests"] == 1
    rows = _rows(gateway)
    assert [(r["endpoint"], r["status"], r["error_type"]) for r in rows] == [
        ("responses", "rejected", "insufficient_quota"), ("responses", "rejected", "insufficient_quota"),
        ("responses", "ok", None), ("responses", "rejected", "rate_limit_exceeded")]


# ---------------------------------------------------------------- the real engine

ENGINE_POLICY = """
backends:
  local:
    kind: engine
    launch: embedded
    model: tiny
    engine_model_path: {model_dir}
    engine_args: {{threads: 1, max-num-seqs: 4}}
    gpu_hour_usd: 2.0
routes:
  tiny: {{backend: local}}
"""


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


def test_the_real_engine_answers_responses_plain_and_streamed(tiny_model_dir, tmp_path) -> None:
    with run_gateway(ENGINE_POLICY.format(model_dir=tiny_model_dir), tmp_path) as gateway:
        client = _client(gateway)
        reply = client.responses.create(model="tiny", instructions="You are terse.", input="hello",
                                        max_output_tokens=16, temperature=0)
        assert reply.status in ("completed", "incomplete") and reply.model == "tiny"
        assert reply.usage.input_tokens > 5 and 1 <= reply.usage.output_tokens <= 16
        assert isinstance(reply.output_text, str)
        if reply.status == "incomplete":
            assert reply.usage.output_tokens == 16 and reply.incomplete_details.reason == "max_output_tokens"

        events = list(client.responses.create(model="tiny", instructions="You are terse.", input="hello",
                                              max_output_tokens=16, temperature=0, stream=True))
        kinds = [e.type for e in events]
        assert kinds[:4] == EVENTS[:4] and kinds[-1] in ("response.completed", "response.incomplete")
        final = events[-1].response
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text
        assert final.output_text == reply.output_text  # greedy: the same text both ways
        assert final.usage.output_tokens == reply.usage.output_tokens

        rows = _rows(gateway)
        assert [(r["endpoint"], r["backend"], r["status"], r["stream"]) for r in rows] == [
            ("responses", "local", "ok", False), ("responses", "local", "ok", True)]
        assert all(r["cost_basis"] == "gpu_amortized" and r["gpu_seconds"] > 0 for r in rows)
        assert rows[0]["completion_tokens"] == reply.usage.output_tokens
