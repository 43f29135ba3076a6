"""Issue 12, items 1 and 2: a client's bad request is that client's 400 on every backend kind — never retried,
never sent to a fallback, never counted against a breaker — and the next well-formed request from another
key is served at once. The real openai SDK against the real gateway; stand-ins are the upstreams."""
from __future__ import annotations

import time

import openai
import pytest

from gateway.keys import create_key
from gateway.testing.standin import run_standin, standin_control, standin_stats
from tests.e2e.conftest import MASTER_KEY, ledger_rows, run_gateway

# `hosted` is a litellm backend, `local` an engine backend; each route falls back to `spare`, which must never
# see a request the client got wrong. failure_threshold: 1 — one failure counted against a backend opens it.
POLICY = """
backends:
  api:
    kind: litellm
    model: openai/gpt-4o-mini
    api_base: {api}
    api_key_env: STANDIN_API_KEY
    failure_threshold: 1
    max_retries: 2
    retry_backoff_s: 0.01
  eng:
    kind: engine
    model: demo-model
    api_base: {eng}
    failure_threshold: 1
    max_retries: 2
    retry_backoff_s: 0.01
  spare:
    kind: engine
    model: demo-model
    api_base: {spare}
routes:
  hosted:
    strategy: fixed
    backend: api
    fallbacks: [spare]
  local:
    strategy: fixed
    backend: eng
    fallbacks: [spare]
"""

OK = [{"role": "user", "content": "hello there"}]
# (extra request fields, the param the 400 must name)
MALFORMED = [
    ({"messages": [{"role": "user", "content": 42}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].image_url.url"),
    ({"messages": OK, "response_format": "json"}, "response_format"),
    ({"messages": [{"role": "system", "content": "be brief"}, {"role": "user"}]}, "messages[1].content"),
    ({"messages": [{"role": "robot", "content": "beep"}]}, "messages[0]"),
    ({"messages": [*OK, {"role": "tool", "content": "42"}]}, "messages[1].tool_call_id"),
    ({"messages": OK, "temperature": 7}, "temperature"),
    ({"messages": OK, "top_p": "high"}, "top_p"),
    ({"messages": OK, "n": 0}, "n"),
    ({"messages": OK, "max_tokens": 0}, "max_tokens"),
    ({"messages": OK, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": OK, "logprobs": "yes"}, "logprobs"),
    ({"messages": OK, "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema.name"),
    ({"messages": OK, "tools": [{"type": "function", "function": {"name": "get_weather"}}],
      "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice.function.name"),
    ({"messages": OK, "metadata": {"k": "v" * 513}}, "metadata"),
    ({"messages": OK, "logit_bias": {"hello": 5}}, "logit_bias"),
]


@pytest.fixture
def upstreams():
    with run_standin() as api, run_standin(engine_extension=True) as eng, \
            run_standin(engine_extension=True) as spare:
        yield {"api": api, "eng": eng, "spare": spare}


@pytest.fixture
def gateway(upstreams, tmp_path, monkeypatch):
    monkeypatch.setenv("STANDIN_API_KEY", "sk-standin")
    with run_gateway(POLICY.format(**upstreams), tmp_path) as running:
        yield running


def sdk(gateway, key: str = MASTER_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key=key)  # the SDK's default retries (2): none may happen


@pytest.fixture
def other_key(gateway) -> str:
    """Another client's key, made before the test's requests (so no ledger write races the key's INSERT)."""
    key, _ = gateway.call(lambda: create_key(gateway.gw.db_engine, "team-b"))
    return key


def requests_seen(upstreams) -> dict[str, int]:
    return {name: standin_stats(url)["requests"] for name, url in upstreams.items()}


@pytest.mark.parametrize("route", ["hosted", "local"])
def test_malformed_requests_are_the_same_400_on_both_backend_kinds_and_reach_no_backend(gateway, upstreams, route,
                                                                                         other_key):
    client = sdk(gateway)
    for fields, param in MALFORMED:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=route, **fields)
        body = err.value.body
        assert err.value.status_code == 400 and body["param"] == param, (fields, body)
        assert body["type"] == "invalid_request_error" and param in body["message"]
        assert "litellm" not in body["message"].lower() and "pydantic" not in body["message"].lower()
        assert err.value.response.headers.get("x-request-id", "").startswith("req_")
    assert requests_seen(upstreams) == {"api": 0, "eng": 0, "spare": 0}
    # another key, at once: served by the route's own backend (no circuit open, no fallback)
    started = time.perf_counter()
    reply = sdk(gateway, other_key).chat.completions.with_raw_response.create(
        model=route, messages=OK, max_tokens=3)
    assert time.perf_counter() - started < 2
    assert reply.headers["x-switchyard-backend"] == ("api" if route == "hosted" else "eng")
    assert reply.parse().choices[0].message.content == "tok0 tok1 tok2"
    assert gateway.gw.services.breakers.states() == {("api" if route == "hosted" else "eng"): 0}
    gateway.call(gateway.gw.services.ledger.flush)
    rows = ledger_rows(gateway.config.database_url)
    assert [r["status"] for r in rows] == ["rejected"] * len(MALFORMED) + ["ok"]
    assert all(r["http_status"] == 400 and r["backend"] is None for r in rows[:-1])


def test_the_same_request_is_rejected_alike_on_both_kinds(gateway):
    """Before issue 12 a user message without content was a 400 on the engine and a 200 through litellm."""
    errors = {}
    for route in ("hosted", "local"):
        with pytest.raises(openai.BadRequestError) as err:
            sdk(gateway).chat.completions.create(model=route, messages=[{"role": "user"}])
        errors[route] = err.value.body
    assert errors["hosted"] == errors["local"]


@pytest.mark.parametrize("route, backend", [("hosted", "api"), ("local", "eng")])
@pytest.mark.parametrize("status", [400, 404, 413, 422])
def test_an_upstream_4xx_is_the_clients_and_never_retried_nor_failed_over(gateway, upstreams, route, backend,
                                                                           status, other_key):
    standin_control(upstreams[backend], fail_next=1, fail_status=status)
    if status == 404:
        # a provider's 404 is our misconfigured model name: 502, tried on the fallback, not counted
        reply = sdk(gateway).chat.completions.with_raw_response.create(model=route, messages=OK, max_tokens=2)
        assert reply.headers["x-switchyard-backend"] == "spare"
    else:
        with pytest.raises(openai.APIStatusError) as err:
            sdk(gateway).chat.completions.create(model=route, messages=OK, max_tokens=2)
        assert err.value.status_code == status
        message = err.value.body["message"]
        assert f"standin: injected {status}" in message  # the upstream's words, quoted
        assert "litellm" not in message.lower() and "OpenAIException" not in message
        assert standin_stats(upstreams["spare"])["requests"] == 0  # no fallback
    assert standin_stats(upstreams[backend])["requests"] == 1  # no retry
    assert gateway.gw.services.breakers.states()[backend] == 0
    reply = sdk(gateway, other_key).chat.completions.with_raw_response.create(
        model=route, messages=OK, max_tokens=2)
    assert reply.headers["x-switchyard-backend"] == backend


@pytest.mark.parametrize("route, backend", [("hosted", "api"), ("local", "eng")])
@pytest.mark.parametrize("status", [401, 403])
def test_a_provider_refusing_our_credentials_is_a_502_that_opens_no_breaker(gateway, upstreams, route, backend,
                                                                             status, other_key):
    standin_control(upstreams[backend], fail_next=1, fail_status=status)
    standin_control(upstreams["spare"], fail_next=1, fail_status=status)
    with pytest.raises(openai.APIStatusError) as err:
        sdk(gateway).chat.completions.create(model=route, messages=OK, max_tokens=2)
    assert err.value.status_code == 502 and err.value.body["code"] == "backend_misconfigured"
    assert err.value.response.headers["x-should-retry"] == "false"  # the SDK did not retry it either
    assert "not a problem with your request" in err.value.body["message"]
    assert standin_stats(upstreams[backend])["requests"] == 1  # not retried (it would not heal)
    states = gateway.gw.services.breakers.states()
    assert states[backend] == 0 and states["spare"] == 0
    reply = sdk(gateway, other_key).chat.completions.with_raw_response.create(
        model=route, messages=OK, max_tokens=2)
    assert reply.headers["x-switchyard-backend"] == backend


def test_5xx_still_counts_against_the_breaker(gateway, upstreams):
    standin_control(upstreams["api"], fail_next=1, fail_status=500)
    reply = sdk(gateway).chat.completions.with_raw_response.create(model="hosted", messages=OK, max_tokens=2)
    assert reply.headers["x-switchyard-backend"] == "spare"  # failure_threshold 1: api's breaker opened
    assert gateway.gw.services.breakers.states()["api"] == 1
