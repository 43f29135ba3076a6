"""The gateway as apps see it: the official openai SDK against a real gateway and a stand-in upstream."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from gateway.testing.standin import standin_control
from tests.e2e.conftest import MASTER_KEY, ledger_rows, run_gateway
from tests.e2e.policy_builder import dead, engine, fixed, litellm, policy


def policy_text(standin: str) -> str:
    return policy(backends={"eng": engine(standin, gpu_hour_usd=3.6, gpus=1), "api": litellm(standin),
                            "dead": dead()},
                  routes={"local": fixed("eng", counterfactual="api"), "gpt-4o-mini": fixed("api"),
                          "failover": fixed("dead", fallbacks=["eng"], counterfactual="api"),
                          "audited": fixed("eng", log_prompts=True)})


@pytest.fixture
def gateway(standin, tmp_path):
    with run_gateway(policy_text(standin), tmp_path) as running:
        yield running


def client(gateway, key: str = MASTER_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key=key, max_retries=0)


def flushed_rows(gateway, where: str = "1=1", params: dict | None = None) -> list[dict]:
    gateway.call(gateway.gw.services.ledger.flush)
    return ledger_rows(gateway.config.database_url, where, params)


def test_chat_plain_on_engine_backend_is_logged_with_amortised_cost(gateway):
    reply = client(gateway).chat.completions.create(
        model="local", messages=[{"role": "user", "content": "hello there"}], max_tokens=5)
    assert reply.choices[0].message.content
    assert reply.usage.completion_tokens == 5
    [row] = flushed_rows(gateway)
    assert row["status"] == "ok"
    assert row["requested_model"] == "local" and row["route"] == "local" and row["backend"] == "eng"
    assert row["completion_tokens"] == 5 and row["prompt_tokens"] == reply.usage.prompt_tokens
    assert row["cost_basis"] == "gpu_amortized"
    assert row["gpu_seconds"] is not None and row["gpu_seconds"] > 0
    assert row["cost_usd"] > 0
    assert row["counterfactual_cost_usd"] is not None and row["counterfactual_cost_usd"] > 0
    assert row["policy_version"] == gateway.gw.services.policy_store.current.version
    assert row["latency_ms"] > 0 and row["ttft_ms"] > 0


def test_chat_on_litellm_backend_is_priced_from_the_price_map(gateway):
    import litellm

    reply = client(gateway).chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "one two three"}], max_tokens=7)
    assert reply.usage.completion_tokens == 7
    [row] = flushed_rows(gateway)
    prices = litellm.model_cost["gpt-4o-mini"]
    expected = (row["prompt_tokens"] * prices["input_cost_per_token"]
                + row["completion_tokens"] * prices["output_cost_per_token"])
    assert row["cost_basis"] == "api_price"
    assert row["cost_usd"] == pytest.approx(expected, rel=1e-6)
    assert row["gpu_seconds"] is None


def test_streaming_relays_chunks_and_usage(gateway):
    stream = client(gateway).chat.completions.create(
        model="local", messages=[{"role": "user", "content": "stream please"}], max_tokens=6, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0].usage.completion_tokens == 6
    [row] = flushed_rows(gateway)
    assert row["status"] == "ok" and row["completion_tokens"] == 6 and row["cost_usd"] > 0


def test_streaming_without_include_usage_sends_no_usage_chunk_but_still_accounts(gateway):
    stream = client(gateway).chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True)
    chunks = list(stream)
    assert all(c.usage is None for c in chunks)
    [row] = flushed_rows(gateway)
    assert row["completion_tokens"] == 4 and row["cost_usd"] > 0


async def test_async_client_concurrent_requests(gateway):
    aclient = openai.AsyncOpenAI(base_url=gateway.base_url, api_key=MASTER_KEY, max_retries=0)
    replies = await asyncio.gather(*(aclient.chat.completions.create(
        model="local", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=3) for i in range(20)))
    assert all(r.usage.completion_tokens == 3 for r in replies)
    await aclient.close()
    rows = await asyncio.to_thread(flushed_rows, gateway)
    assert len(rows) == 20 and len({r["request_id"] for r in rows}) == 20


def test_completions_endpoint(gateway):
    reply = client(gateway).completions.create(model="local", prompt="Once upon a time", max_tokens=4)
    assert reply.choices[0].text
    [row] = flushed_rows(gateway)
    assert row["completion_tokens"] == 4


def test_models_lists_policy_routes(gateway):
    models = client(gateway).models.list()
    assert sorted(m.id for m in models.data) == ["audited", "failover", "gpt-4o-mini", "local"]


def test_errors_use_openai_bodies_and_status_codes(gateway):
    with pytest.raises(openai.AuthenticationError) as err:
        client(gateway, key="sk-wrong").chat.completions.create(
            model="local", messages=[{"role": "user", "content": "x"}])
    assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as err:
        client(gateway).chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert "nope" in err.value.body["message"] and err.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as err:
        client(gateway).chat.completions.create(model="local", messages=[])
    assert err.value.body["param"] == "messages"
    raw = httpx.post(gateway.base_url + "/chat/completions", content=b"{not json",
                     headers={"authorization": f"Bearer {MASTER_KEY}"})
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    rows = flushed_rows(gateway)
    assert [r["status"] for r in rows] == ["rejected"] * 3  # the bad key is not logged


def test_fallback_when_primary_is_down(gateway):
    reply = client(gateway).chat.completions.create(
        model="failover", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert reply.usage.completion_tokens == 2
    [row] = flushed_rows(gateway)
    assert row["backend"] == "eng" and row["status"] == "ok"


def test_upstream_failure_is_502_and_logged(gateway, standin):
    standin_control(standin, fail_next=50, fail_status=500)
    with pytest.raises(openai.InternalServerError) as err:
        client(gateway).chat.completions.create(model="local", messages=[{"role": "user", "content": "x"}])
    assert err.value.status_code == 502
    [row] = flushed_rows(gateway)
    assert row["status"] == "error"


def test_prompt_and_completion_text_are_stored_only_when_the_route_opts_in(gateway):
    import sqlalchemy as sa

    from gateway import db

    c = client(gateway)
    c.chat.completions.create(model="local", messages=[{"role": "user", "content": "secret one"}], max_tokens=2)
    c.chat.completions.create(model="audited", messages=[{"role": "user", "content": "secret two"}], max_tokens=2)
    list(c.chat.completions.create(model="audited", messages=[{"role": "user", "content": "secret three"}],
                                   max_tokens=3, stream=True))
    gateway.call(gateway.gw.services.ledger.flush)
    engine = sa.create_engine(db.sync_url(gateway.config.database_url))
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT route, prompt_text, completion_text FROM requests ORDER BY id")).all()
    engine.dispose()
    assert rows[0] == ("local", None, None)
    assert rows[1][1] == "secret two" and rows[1][2] == "tok0 tok1"
    assert rows[2][1] == "secret three" and rows[2][2] == "tok0 tok1 tok2"
