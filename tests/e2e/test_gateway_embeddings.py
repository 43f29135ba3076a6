"""`POST /v1/embeddings` through a real gateway with the official openai SDK: litellm's aembedding against the
stand-in, priced at the model's input price and logged; engines (which serve no embeddings) refuse or escalate."""
from __future__ import annotations

import base64
import struct

import httpx
import openai
import pytest

from gateway.keys import create_key
from gateway.testing.standin import embedding_vector, standin_control, standin_stats
from tests.e2e.conftest import MASTER_KEY, ledger_rows, run_gateway, tiny_difficulty_model
from tests.e2e.policy_builder import difficulty, engine, litellm, policy


def policy_text(standin: str, model: object) -> str:
    return policy(backends={"embed": litellm(standin, model="openai/text-embedding-3-small"), "chat": litellm(standin),
                            "local": engine(standin, model="small", gpu_hour_usd=2.0),
                            "declared": engine(standin, model="embedder", gpu_hour_usd=2.0,
                                               capabilities={"embeddings": True})},
                  routes={"vectors": {"backend": "embed"}, "chatty": {"backend": "chat"},
                          "engine-only": {"backend": "local"}, "engine-embeds": {"backend": "declared"},
                          "auto": difficulty("local", "embed", model, backend="local")})
PRICE = 2e-8  # litellm's map: text-embedding-3-small, input_cost_per_token (output 0)


@pytest.fixture
def gateway(standin, tmp_path):
    tiny_difficulty_model(tmp_path / "m.npz")
    with run_gateway(policy_text(standin, tmp_path / "m.npz"), tmp_path) as running:
        yield running


def _rows(gateway, where: str = "1=1") -> list[dict]:
    gateway.call(gateway.gw.services.ledger.flush)
    return ledger_rows(gateway.config.database_url, where)


def test_embeddings_through_litellm_as_floats_and_base64(gateway, standin) -> None:
    client = openai.OpenAI(base_url=gateway.base_url, api_key=MASTER_KEY, max_retries=0)
    raw = client.embeddings.with_raw_response.create(model="vectors", input=["hello world", "b"], user="u-1")
    reply = raw.parse()
    assert raw.headers["x-switchyard-backend"] == "embed"
    # The SDK asks for base64 by default and decodes it: the stand-in's vectors, as float32.
    assert [d.index for d in reply.data] == [0, 1]
    for item, text in zip(reply.data, ["hello world", "b"], strict=True):
        assert item.embedding == pytest.approx(embedding_vector(text), abs=1e-6)
    assert reply.usage.prompt_tokens == 3 and reply.usage.total_tokens == 3
    sent = standin_stats(standin)["last_payload"]
    assert sent == {"model": "text-embedding-3-small", "input": ["hello world", "b"], "user": "u-1",
                    "encoding_format": "base64"}

    floats = client.embeddings.create(model="vectors", input="one two three four", encoding_format="float",
                                      dimensions=4)
    assert len(floats.data) == 1 and floats.data[0].embedding == pytest.approx(
        embedding_vector("one two three four", 4), abs=1e-6)
    assert standin_stats(standin)["last_payload"]["dimensions"] == 4

    tokens = client.embeddings.create(model="vectors", input=[[1, 2, 3], [4, 5]], encoding_format="float")
    assert [len(d.embedding) for d in tokens.data] == [8, 8] and tokens.usage.prompt_tokens == 5

    # On the wire, base64 is what OpenAI sends: little-endian float32.
    body = httpx.post(f"{gateway.base_url}/embeddings", headers={"authorization": f"Bearer {MASTER_KEY}"},
                      json={"model": "vectors", "input": "hi", "encoding_format": "base64"}).json()
    assert body["object"] == "list" and body["model"] == "vectors"  # the route asked for (served: the row)
    assert body["data"][0]["object"] == "embedding" and isinstance(body["data"][0]["embedding"], str)
    decoded = struct.unpack("<8f", base64.b64decode(body["data"][0]["embedding"]))
    assert list(decoded) == pytest.approx(embedding_vector("hi"), abs=1e-6)
    assert body["usage"] == {"prompt_tokens": 1, "total_tokens": 1}

    rows = _rows(gateway)
    assert [(r["endpoint"], r["route"], r["backend"], r["status"], r["prompt_tokens"], r["completion_tokens"])
            for r in rows] == [("embeddings", "vectors", "embed", "ok", n, 0) for n in (3, 4, 5, 1)]
    assert all(r["cost_basis"] == "api_price" and r["cost_usd"] == pytest.approx(r["prompt_tokens"] * PRICE)
               for r in rows)
    assert rows[0]["served_model"] == "text-embedding-3-small"


def test_backends_without_embeddings_refuse_or_escalate(gateway, standin) -> None:
    client = openai.OpenAI(base_url=gateway.base_url, api_key=MASTER_KEY, max_retries=0)
    for route, backend in (("engine-only", "local"), ("chatty", "chat")):
        with pytest.raises(openai.BadRequestError) as err:
            client.embeddings.create(model=route, input="hello")
        assert err.value.code == "unsupported_capability" and err.value.param == "model"
        assert f"served by '{backend}', which does not serve embeddings" in err.value.message
    assert standin_stats(standin)["embedding_requests"] == 0

    raw = client.embeddings.with_raw_response.create(model="auto", input="hello")  # the engine first: escalated
    assert raw.headers["x-switchyard-backend"] == "embed"
    raw = client.embeddings.with_raw_response.create(model="engine-embeds", input="hello")  # the policy says so
    assert raw.headers["x-switchyard-backend"] == "declared" and len(raw.parse().data[0].embedding) == 8
    assert standin_stats(standin)["embedding_requests"] == 2

    rows = _rows(gateway)
    assert [(r["route"], r["backend"], r["route_reason"], r["status"], r["http_status"]) for r in rows] == [
        ("engine-only", None, None, "rejected", 400), ("chatty", None, None, "rejected", 400),
        ("auto", "embed", "capability", "ok", 200), ("engine-embeds", "declared", "fixed", "ok", 200)]


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"),
    ({"input": ["x"] * 2049}, "input"),
    ({"input": ["ok", ""]}, "input"),
    ({"input": [1, "a"]}, "input"),
    ({}, "input"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "user": 7}, "user"),
    ({"input": "x", "stream": True}, "stream"),
    ({"input": "x", "model": ""}, "model"),
])
def test_a_malformed_request_is_a_400_naming_the_field(gateway, standin, body, param) -> None:
    reply = httpx.post(f"{gateway.base_url}/embeddings", headers={"authorization": f"Bearer {MASTER_KEY}"},
                       json={"model": "vectors", **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and f"'{param}'" in error["message"] and error["type"] == "invalid_request_error"
    assert standin_stats(standin)["embedding_requests"] == 0


def test_budgets_and_rate_limits_apply(gateway, standin) -> None:
    broke, _ = gateway.call(lambda: create_key(gateway.gw.db_engine, "team-a", budget_usd=1e-9))
    with pytest.raises(openai.RateLimitError) as err:
        openai.OpenAI(base_url=gateway.base_url, api_key=broke, max_retries=0).embeddings.create(
            model="vectors", input="hello world")
    assert err.value.code == "insufficient_quota"
    assert err.value.response.headers.get("x-should-retry") == "false"

    slow, _ = gateway.call(lambda: create_key(gateway.gw.db_engine, "team-b", rpm=1))
    client = openai.OpenAI(base_url=gateway.base_url, api_key=slow, max_retries=0)
    client.embeddings.create(model="vectors", input="hello")
    with pytest.raises(openai.RateLimitError) as err:
        client.embeddings.create(model="vectors", input="hello")
    assert err.value.code == "rate_limit_exceeded"
    assert standin_stats(standin)["embedding_requests"] == 1

    rows = _rows(gateway)
    assert [(r["team"], r["endpoint"], r["status"], r["error_type"]) for r in rows] == [
        ("team-a", "embeddings", "rejected", "insufficient_quota"), ("team-b", "embeddings", "ok", None),
        ("team-b", "embeddings", "rejected", "rate_limit_exceeded")]


def test_an_upstream_failure_is_retried_and_counted(gateway, standin) -> None:
    standin_control(standin, fail_next=1, fail_status=503)
    client = openai.OpenAI(base_url=gateway.base_url, api_key=MASTER_KEY, max_retries=0)
    assert len(client.embeddings.create(model="vectors", input="hello").data) == 1  # our retry loop
    [row] = _rows(gateway)
    assert row["attempts"] == 2 and row["status"] == "ok"
