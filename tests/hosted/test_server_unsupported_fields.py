"""Nothing is silently ignored: the engine answers a field it cannot honour with a 400 naming it."""
from __future__ import annotations

import pytest

from tests.hosted.serving_helpers import EngineProcess, build_tiny_chat_model

openai = pytest.importorskip("openai")
MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    proc = EngineProcess(build_tiny_chat_model(tmp_path_factory.mktemp("fields") / "tiny"), "--max-num-seqs", "4")
    yield openai.OpenAI(base_url=proc.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    assert proc.stop() == 0, proc.log


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"logit_bias": {"5": 10}}, "logit_bias", "logit_bias is not supported"),
    ({"functions": [{"name": "f", "parameters": {"type": "object"}}]}, "functions", "use `tools`"),
    ({"function_call": "auto"}, "function_call", "use `tool_choice`"),
    ({"modalities": ["text", "audio"]}, "modalities", "only text output"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "audio output"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction", "predicted outputs"),
    ({"web_search_options": {}}, "web_search_options", "web search"),
    ({"reasoning_effort": "high"}, "reasoning_effort", "does not reason"),
    ({"store": True}, "store", "does not store"),
    ({"service_tier": "flex"}, "service_tier", "one service tier"),
    ({"brand_new_option": 1}, "brand_new_option", "unknown field 'brand_new_option'"),
])
def test_fields_it_cannot_honour_are_a_400_naming_them(client, fields, param, says) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, extra_body=fields)
    assert err.value.body["param"] == param and says in err.value.body["message"]
    assert err.value.body["code"] == "unsupported_parameter"


def test_fields_that_ask_for_nothing_it_cannot_do_are_accepted(client) -> None:
    reply = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=2, user="u-1", metadata={"k": "v"}, store=False,
        service_tier="auto", modalities=["text"], logit_bias={})
    assert reply.usage.completion_tokens >= 1
    with pytest.raises(openai.BadRequestError, match="unknown field 'messages'"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body={"messages": MESSAGES})


def test_developer_is_the_system_prompt_and_the_legacy_function_role_is_refused(client) -> None:
    def answer(role: str):
        return client.chat.completions.create(
            model="tiny", max_tokens=6, temperature=0, logprobs=True,
            messages=[{"role": role, "content": "You answer tersely."}, {"role": "user", "content": "hello"}])

    developer, system = answer("developer"), answer("system")
    assert developer.usage.prompt_tokens == system.usage.prompt_tokens
    assert [t.token for t in developer.choices[0].logprobs.content] == [
        t.token for t in system.choices[0].logprobs.content]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", max_tokens=2, messages=[
            {"role": "user", "content": "hi"}, {"role": "function", "name": "f", "content": "{}"}])
    assert err.value.body["param"] == "messages[1].role" and "tool" in err.value.body["message"]
