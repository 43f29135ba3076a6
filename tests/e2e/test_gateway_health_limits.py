"""Issue 12, items 6 and 7 (gateway part): the body limit, /health and its gauge, budgets that fail fast,
x-request-id everywhere, clipped echoes, pass-through of metadata/user/developer, and client-closed plain
requests that keep their backend and cost. The real openai SDK against a real gateway and stand-ins."""
from __future__ import annotations

import time

import httpx
import openai
import pytest

from gateway.keys import create_key
from gateway.testing.standin import standin_control, standin_stats
from tests.e2e.conftest import MASTER_KEY, ledger_rows, run_gateway
from tests.e2e.policy_builder import dead, engine, fixed, litellm, policy


def policy_text(standin: str) -> str:
    api = litellm(standin, input_usd_per_mtok=10, output_usd_per_mtok=90, failure_threshold=1, max_retries=0)
    return policy(backends={"api": api, "eng": engine(standin, gpu_hour_usd=3.6, timeout_s=10), "dead": dead()},
                  routes={"hosted": fixed("api"), "local": fixed("eng"), "broken": fixed("dead")})


OK = [{"role": "user", "content": "one two three"}]


@pytest.fixture
def gateway(standin, tmp_path):
    with run_gateway(policy_text(standin), tmp_path) as running:
        yield running


def sdk(gateway, key: str = MASTER_KEY, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key=key, **kw)


def rows(gateway, where: str = "1=1") -> list[dict]:
    gateway.call(gateway.gw.services.ledger.flush)
    return ledger_rows(gateway.config.database_url, where)


def wait_for(predicate, timeout: float = 10.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("condition not reached in time")


# ---------------------------------------------------------------- the body limit


def test_a_20_mb_body_is_413_before_parsing_and_reaches_no_backend(gateway, standin):
    assert gateway.config.max_body_bytes == 8 * 1024 * 1024  # the default
    huge = "word " * (4 * 1024 * 1024)  # 20 MiB of prompt
    with pytest.raises(openai.APIStatusError) as err:
        sdk(gateway, max_retries=0).chat.completions.create(model="local", messages=[{"role": "user", "content": huge}])
    assert err.value.status_code == 413 and err.value.body["code"] == "request_too_large"
    assert err.value.response.headers["x-request-id"].startswith("req_")

    def chunks():  # no Content-Length: the running count stops it
        for _ in range(20):
            yield b"x" * (1024 * 1024)

    raw = httpx.post(gateway.base_url + "/chat/completions", content=chunks(), timeout=30,
                     headers={"authorization": f"Bearer {MASTER_KEY}", "content-type": "application/json"})
    assert raw.status_code == 413 and raw.json()["error"]["code"] == "request_too_large"
    assert standin_stats(standin)["requests"] == 0
    # and the gateway serves the next request normally
    assert sdk(gateway).chat.completions.create(model="local", messages=OK, max_tokens=2).usage.completion_tokens == 2
    assert [r["http_status"] for r in rows(gateway)] == [413, 413, 200]


def test_the_body_limit_is_configurable(standin, tmp_path, monkeypatch):
    monkeypatch.setenv("SWITCHYARD_MAX_BODY_BYTES", "2000")
    with run_gateway(policy_text(standin), tmp_path) as gateway:
        client = sdk(gateway, max_retries=0)
        assert client.chat.completions.create(model="local", messages=OK, max_tokens=1).usage.completion_tokens == 1
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(model="local", messages=[{"role": "user", "content": "x" * 2000}])
        assert err.value.status_code == 413 and "2000 bytes" in err.value.body["message"]


# ---------------------------------------------------------------- health


def test_health_reports_each_backend_and_degraded_routes_and_the_gauge_agrees(gateway, standin):
    def health() -> dict:
        return httpx.get(gateway.root + "/health").json()

    first = wait_for(lambda: (h := health())["backends"]["eng"] == "up" and h)
    assert first["backends"] == {"api": "up", "eng": "up", "dead": "down"}
    assert first["status"] == "degraded" and first["unserved_routes"] == ["broken"]
    # one 5xx opens api's breaker (failure_threshold 1): its route has no live backend now
    standin_control(standin, fail_next=1, fail_status=500)
    with pytest.raises(openai.InternalServerError):
        sdk(gateway, max_retries=0).chat.completions.create(model="hosted", messages=OK, max_tokens=1)
    response = httpx.get(gateway.root + "/health")
    assert response.status_code == 200  # degraded is still 200: the body says what is wrong
    after = response.json()
    assert after["backends"]["api"] == "circuit_open" and after["status"] == "degraded"
    assert sorted(after["unserved_routes"]) == ["broken", "hosted"]
    metrics = httpx.get(gateway.root + "/metrics").text
    assert 'switchyard_backend_up{backend="eng"} 1.0' in metrics
    assert 'switchyard_backend_up{backend="dead"} 0.0' in metrics
    assert 'switchyard_backend_up{backend="api"} 0.0' in metrics
    assert 'switchyard_backend_circuit_state{backend="api"} 1.0' in metrics


# ---------------------------------------------------------------- the small ones


def test_budget_exhaustion_fails_fast_with_the_sdks_default_retries(gateway):
    key, _ = gateway.call(lambda: create_key(gateway.gw.db_engine, "team-a", budget_usd=1e-9))
    started = time.perf_counter()
    with pytest.raises(openai.RateLimitError) as err:
        sdk(gateway, key).chat.completions.create(model="hosted", messages=OK, max_tokens=5)  # max_retries=2
    assert time.perf_counter() - started < 2
    assert err.value.body["code"] == "insufficient_quota"
    headers = err.value.response.headers
    assert headers["x-should-retry"] == "false" and "retry-after" not in headers
    assert len(rows(gateway)) == 1  # one request: the SDK did not retry


def test_a_rate_limit_keeps_an_accurate_retry_after(gateway):
    key, _ = gateway.call(lambda: create_key(gateway.gw.db_engine, "team-a", rpm=1))
    client = sdk(gateway, key, max_retries=0)
    client.chat.completions.create(model="hosted", messages=OK, max_tokens=1)
    with pytest.raises(openai.RateLimitError) as err:
        client.chat.completions.create(model="hosted", messages=OK, max_tokens=1)
    assert 55 <= int(err.value.response.headers["retry-after"]) <= 60
    assert "x-should-retry" not in err.value.response.headers


def test_every_response_carries_a_request_id(gateway):
    auth = {"authorization": f"Bearer {MASTER_KEY}"}
    answers = [
        httpx.post(gateway.base_url + "/chat/completions", json={"model": "local", "messages": OK}),  # 401
        httpx.post(gateway.base_url + "/chat/completions", headers=auth, json={"model": "nope", "messages": OK}),
        httpx.get(gateway.root + "/no/such/path"),  # 404
        httpx.get(gateway.base_url + "/chat/completions"),  # 405
        httpx.get(gateway.root + "/health"),
        httpx.get(gateway.base_url + "/models", headers=auth),
    ]
    assert [a.status_code for a in answers] == [401, 404, 404, 405, 200, 200]
    ids = [a.headers.get("x-request-id") for a in answers]
    assert all(i and i.startswith("req_") for i in ids) and len(set(ids)) == len(ids)


def test_a_huge_model_name_is_clipped_in_the_404_and_in_the_ledger(gateway):
    name = "m" * 100_000
    with pytest.raises(openai.NotFoundError) as err:
        sdk(gateway, max_retries=0).chat.completions.create(model=name, messages=OK)
    message = err.value.body["message"]
    assert len(message) < 400 and "m" * 63 + "…" in message and "m" * 65 not in message
    [row] = rows(gateway)
    assert len(row["requested_model"]) <= 256 and row["requested_model"].endswith("…")


def test_metadata_user_and_developer_reach_an_openai_compatible_provider(gateway, standin):
    messages = [{"role": "developer", "content": "Answer briefly.", "name": "house-rules"},
                {"role": "user", "content": "one two"}]
    client = sdk(gateway)
    client.chat.completions.create(model="hosted", messages=messages, metadata={"team": "docs", "ticket": "42"},
                                   user="user-7", max_tokens=2)
    seen = standin_stats(standin)["last_payload"]
    assert seen["messages"] == messages  # developer stays developer, with its name
    assert seen["metadata"] == {"team": "docs", "ticket": "42"} and seen["user"] == "user-7"
    stream = client.chat.completions.create(model="hosted", messages=messages, metadata={"team": "docs"},
                                            user="user-8", max_tokens=2, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "tok0 tok1"
    seen = standin_stats(standin)["last_payload"]
    assert seen["messages"] == messages and seen["metadata"] == {"team": "docs"} and seen["user"] == "user-8"
    # the engine path forwards the body as sent
    client.chat.completions.create(model="local", messages=messages, metadata={"team": "docs"}, user="u", max_tokens=1)
    seen = standin_stats(standin)["last_payload"]
    assert seen["messages"] == messages and seen["metadata"] == {"team": "docs"} and seen["user"] == "u"


def test_a_client_closed_plain_request_on_the_engine_keeps_backend_and_estimated_cost(gateway, standin):
    client = sdk(gateway, max_retries=0)
    client.chat.completions.create(model="local", messages=OK, max_tokens=4)  # the pool learns eng's rate
    standin_control(standin, first_byte_delay_ms=3000)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gateway.base_url + "/chat/completions", timeout=httpx.Timeout(10, read=0.5),
                   headers={"authorization": f"Bearer {MASTER_KEY}"},
                   json={"model": "local", "messages": OK, "max_tokens": 50})
    row = wait_for(lambda: rows(gateway, "status = 'client_closed'"))[0]
    assert row["backend"] == "eng" and row["error_type"] == "client_closed"
    assert row["prompt_tokens"] > 0 and row["gpu_seconds"] > 0 and row["cost_usd"] > 0
    assert row["cost_note"] == "device_seconds_estimated"
