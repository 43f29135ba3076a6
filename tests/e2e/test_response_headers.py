"""Issue 31 findings 9 and 11 (the header, metadata and param ones): every answer says what it cost, why and who
served it (`x-switchyard-cost-usd`, `x-switchyard-route-reason`, `x-switchyard-backend`; streams carry the cost
in the final usage chunk); a client's sane `X-Request-Id` is kept and never costs a ledger row; answers name
the route the client asked for; `/v1/models` says what each route can do; unknown fields are the same 400 on
every route kind; `param` paths are written OpenAI's way. The openai SDK against a real gateway and stand-ins."""
from __future__ import annotations

import httpx
import openai
import pytest

from gateway.testing.standin import run_standin, standin_control, standin_stats
from tests.e2e.conftest import MASTER_KEY, ledger_rows, run_gateway
from tests.e2e.policy_builder import engine, fixed, litellm, policy


def policy_text(ok: str) -> str:
    return policy(backends={"api": litellm(ok), "eng": engine(ok, gpu_hour_usd=2.0, max_retries=0)},
                  routes={"hosted": fixed("api"), "local": fixed("eng")})
MSG = [{"role": "user", "content": "hello there"}]
ROUTES = [("hosted", "api", "gpt-4o-mini"), ("local", "eng", "demo-model")]


@pytest.fixture
def gateway(tmp_path, monkeypatch):
    monkeypatch.setenv("STANDIN_API_KEY", "sk-standin")
    with run_standin(engine_extension=True) as ok, run_gateway(policy_text(ok), tmp_path) as running:
        running.ok_url = ok
        yield running


def sdk(gateway, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key=MASTER_KEY, max_retries=0, **kw)


def rows(gateway) -> list[dict]:
    gateway.call(gateway.gw.services.ledger.flush)
    return ledger_rows(gateway.config.database_url)


@pytest.mark.parametrize("route, backend, served", ROUTES)
def test_plain_answers_say_cost_reason_backend_and_the_route_asked_for(gateway, route, backend, served):
    reply = sdk(gateway).chat.completions.with_raw_response.create(model=route, messages=MSG, max_tokens=3)
    completion = reply.parse()
    assert completion.model == route  # not the upstream's name
    assert reply.headers["x-switchyard-backend"] == backend
    assert reply.headers["x-switchyard-route-reason"] == "fixed"
    cost = reply.headers["x-switchyard-cost-usd"]
    assert "e" not in cost and float(cost) > 0
    [row] = rows(gateway)
    assert row["served_model"] == served and row["backend"] == backend
    assert float(cost) == pytest.approx(row["cost_usd"], abs=1e-10)


@pytest.mark.parametrize("route, backend, served", ROUTES)
def test_streams_carry_backend_and_reason_headers_and_the_cost_in_the_usage_chunk(gateway, route, backend, served):
    reply = sdk(gateway).chat.completions.with_raw_response.create(
        model=route, messages=MSG, max_tokens=3, stream=True, stream_options={"include_usage": True})
    assert reply.headers["x-switchyard-backend"] == backend
    assert reply.headers["x-switchyard-route-reason"] == "fixed"
    chunks = list(reply.parse())
    assert {c.model for c in chunks} == {route}
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 3
    cost = usage.model_extra["cost_usd"]  # an extra field the SDK's model keeps, parsed without error
    [row] = rows(gateway)
    assert cost > 0 and cost == pytest.approx(row["cost_usd"], abs=1e-12)
    assert row["served_model"] == served


def test_error_answers_carry_what_is_known(gateway):
    client = sdk(gateway)
    with pytest.raises(openai.NotFoundError) as err:  # no route: nothing routed, nothing spent
        client.chat.completions.create(model="no-such-route", messages=MSG)
    headers = err.value.response.headers
    assert headers["x-switchyard-cost-usd"] == "0" and "x-switchyard-backend" not in headers
    assert "x-switchyard-route-reason" not in headers
    standin_control(gateway.ok_url, fail_next=1, fail_status=500)
    with pytest.raises(openai.InternalServerError) as err:  # routed and tried: the backend that failed
        client.chat.completions.create(model="local", messages=MSG, max_tokens=2)
    headers = err.value.response.headers
    assert (headers["x-switchyard-backend"], headers["x-switchyard-route-reason"]) == ("eng", "fixed")
    failed = rows(gateway)[-1]
    assert (failed["status"], failed["error_type"], failed["backend"]) == ("error", "upstream_http", "eng")


def test_a_sane_client_request_id_is_kept_and_a_reused_one_loses_no_row(gateway):
    client = sdk(gateway, default_headers={"X-Request-Id": "trace-42.a:b"})
    for _ in range(2):  # the same id twice: the ledger's request_id is unique, yet both rows are written
        reply = client.chat.completions.with_raw_response.create(model="local", messages=MSG, max_tokens=2)
        assert reply.headers["x-request-id"] == "trace-42.a:b"
    with pytest.raises(openai.NotFoundError) as err:  # errors echo it too
        client.chat.completions.create(model="no-such-route", messages=MSG)
    assert err.value.response.headers["x-request-id"] == "trace-42.a:b"
    ids = [r["request_id"] for r in rows(gateway)]
    assert len(ids) == 3 and len(set(ids)) == 3
    assert all(i.startswith("trace-42.a:b~") and len(i) == len("trace-42.a:b~") + 16 for i in ids)
    for bad in ("has space", "x" * 129, "semi;colon", ""):
        reply = httpx.post(f"{gateway.base_url}/chat/completions", headers={
            "authorization": f"Bearer {MASTER_KEY}", "x-request-id": bad},
            json={"model": "local", "messages": MSG, "max_tokens": 1}, timeout=30)
        assert reply.status_code == 200 and reply.headers["x-request-id"].startswith("req_"), bad
    long_id = "L" * 128  # kept in the header; the row keeps its first 47 characters
    reply = httpx.post(f"{gateway.base_url}/chat/completions", headers={
        "authorization": f"Bearer {MASTER_KEY}", "x-request-id": long_id},
        json={"model": "local", "messages": MSG, "max_tokens": 1}, timeout=30)
    assert reply.headers["x-request-id"] == long_id
    assert rows(gateway)[-1]["request_id"].startswith("L" * 47 + "~")


def test_models_say_context_length_and_capabilities(gateway):
    client = sdk(gateway)
    models = {m.id: m for m in client.models.list()}
    hosted, local = models["hosted"].model_extra, models["local"].model_extra
    assert hosted["context_length"] == 128000  # gpt-4o-mini's max_input_tokens in litellm's map
    assert {"chat", "completions", "responses", "tools", "json_schema", "vision"} <= set(hosted["capabilities"])
    assert "embeddings" not in hosted["capabilities"]
    assert local["context_length"] is None  # the policy does not size this engine
    assert {"chat", "tools", "json_mode", "json_schema"} <= set(local["capabilities"])
    assert not {"vision", "embeddings"} & set(local["capabilities"])
    assert client.models.retrieve("local").model_extra["capabilities"] == local["capabilities"]


@pytest.mark.parametrize("route", ["hosted", "local"])
def test_unknown_fields_are_the_same_400_on_every_route_kind(gateway, route):
    with pytest.raises(openai.BadRequestError) as err:
        sdk(gateway).chat.completions.create(model=route, messages=MSG, extra_body={"frobnicate": 1})
    assert (err.value.code, err.value.param) == ("unknown_parameter", "frobnicate")
    assert standin_stats(gateway.ok_url)["requests"] == 0
    # what OpenAI's API knows (per the SDK), and the engine's documented extensions, are not unknown
    reply = sdk(gateway).chat.completions.create(model=route, messages=MSG, max_tokens=2,
                                                 extra_body={"prompt_cache_key": "k", "top_k": 5})
    assert reply.choices[0].message.content
    [rejected, served] = rows(gateway)
    assert (rejected["status"], rejected["error_type"], rejected["requested_model"]) == (
        "rejected", "unknown_parameter", route)
    assert served["status"] == "ok"


@pytest.mark.parametrize("route", ["hosted", "local"])
def test_param_paths_are_written_openais_way(gateway, route):
    client = sdk(gateway)
    cases = [({"messages": [{"role": "user", "content": 42}]}, "messages[0].content"),
             ({"messages": MSG, "tools": [{"type": "function", "function": {"name": 5}}]}, "tools[0].function.name")]
    for fields, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=route, **fields)
        assert err.value.param == param


def test_the_engines_own_param_paths_are_written_openais_way():
    """The engine's validation errors (then hosted/openai_protocol.py's) had `messages.0.content.str`."""
    from pydantic import ValidationError

    from openai_wire.engine_requests import EngineChatRequest
    from openai_wire.request_errors import to_api_error

    cases = [({"messages": [{"role": "user", "content": 42}]}, "messages[0].content"),
             ({"messages": MSG, "tools": [{"type": "function", "function": {"name": 5}}]}, "tools[0].function.name")]
    for fields, param in cases:
        with pytest.raises(ValidationError) as err:
            EngineChatRequest.model_validate({"model": "m", **fields})
        assert to_api_error(err.value).param == param


@pytest.mark.parametrize("route", ["hosted", "local"])
def test_responses_api_streams_carry_the_cost_in_the_final_event(gateway, route):
    reply = sdk(gateway).responses.with_raw_response.create(model=route, input="hello there", max_output_tokens=16,
                                                            stream=True)
    assert reply.headers["x-switchyard-route-reason"] == "fixed"
    events = list(reply.parse())
    done = events[-1]
    assert done.type in ("response.completed", "response.incomplete") and done.response.model == route
    cost = done.response.usage.model_extra["cost_usd"]
    [row] = rows(gateway)
    assert cost > 0 and cost == pytest.approx(row["cost_usd"], abs=1e-12)
