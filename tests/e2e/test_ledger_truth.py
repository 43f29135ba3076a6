"""Issue 31 finding 7: the ledger classifies truthfully. A backend's refusal of the client's own request is
`status = client_error` with that backend, the upstream's error code and the requested model (not an
`error`/`upstream_http` row with no backend); rejected rows keep the model the body named; embeddings on a
difficulty route say `capability`, as the docs do. The openai SDK against a real gateway; the upstreams are the
stand-in and a refusing upstream that answers with an OpenAI error code."""
from __future__ import annotations

import openai
import pytest

from gateway.testing.standin import run_standin, standin_control, standin_stats
from tests.e2e.conftest import MASTER_KEY, ledger_rows, run_gateway, tiny_difficulty_model
from tests.e2e.refusing_upstream import refusing_upstream

POLICY = """
backends:
  api:
    kind: litellm
    model: openai/gpt-4o-mini
    api_base: {ok}
    api_key_env: STANDIN_API_KEY
  eng:
    kind: engine
    model: demo-model
    api_base: {ok}
  emb:
    kind: litellm
    model: openai/text-embedding-3-small
    api_base: {ok}
    api_key_env: STANDIN_API_KEY
  flaky:
    kind: engine
    model: demo-model
    api_base: {ok}
    failure_threshold: 1
    max_retries: 0
    cooldown_s: 60
  eng-refusing:
    kind: engine
    model: demo-model
    api_base: {refusing}
  api-refusing:
    kind: litellm
    model: openai/gpt-4o-mini
    api_base: {refusing}
    api_key_env: STANDIN_API_KEY
  api-refusing-nocode:
    kind: litellm
    model: openai/gpt-4o-mini
    api_base: {nocode}
    api_key_env: STANDIN_API_KEY
routes:
  hosted:
    strategy: fixed
    backend: api
  refused-eng:
    strategy: fixed
    backend: eng-refusing
    fallbacks: [eng]
  refused-api:
    strategy: fixed
    backend: api-refusing
    fallbacks: [api]
  refused-nocode:
    strategy: fixed
    backend: api-refusing-nocode
  flaky-route:
    strategy: fixed
    backend: flaky
  smart:
    strategy: difficulty
    easy: eng
    hard: emb
    threshold: 0.5
    model_path: {model}
"""
MSG = [{"role": "user", "content": "hello there"}]


@pytest.fixture
def gateway(tmp_path, monkeypatch):
    monkeypatch.setenv("STANDIN_API_KEY", "sk-standin")
    tiny_difficulty_model(tmp_path / "m.npz")
    with run_standin(engine_extension=True) as ok, refusing_upstream() as refusing, \
            refusing_upstream(status=422, code=None, param=None, message="unprocessable") as nocode:
        policy = POLICY.format(ok=ok, refusing=refusing, nocode=nocode, model=tmp_path / "m.npz")
        with run_gateway(policy, tmp_path) as running:
            running.ok_url = ok
            yield running


def sdk(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key=MASTER_KEY, max_retries=0)


def rows(gateway) -> list[dict]:
    gateway.call(gateway.gw.services.ledger.flush)
    return ledger_rows(gateway.config.database_url)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("route, backend", [("refused-eng", "eng-refusing"), ("refused-api", "api-refusing")])
def test_a_backends_refusal_of_the_clients_request_is_a_client_error_row(gateway, route, backend, stream):
    with pytest.raises(openai.BadRequestError) as err:
        sdk(gateway).chat.completions.create(model=route, messages=MSG, max_tokens=2, stream=stream)
    assert err.value.code == "context_length_exceeded" and err.value.param == "messages"
    assert err.value.response.headers["x-switchyard-backend"] == backend
    assert err.value.response.headers["x-switchyard-route-reason"] == "fixed"
    assert standin_stats(gateway.ok_url)["requests"] == 0  # the client's fault: no fallback
    [row] = rows(gateway)
    assert (row["status"], row["error_type"], row["http_status"]) == ("client_error", "context_length_exceeded", 400)
    assert (row["backend"], row["requested_model"], row["route"], row["attempts"]) == (backend, route, route, 1)
    assert row["cost_usd"] == 0 and bool(row["stream"]) is stream


def test_a_refusal_without_a_code_keeps_its_status(gateway):
    with pytest.raises(openai.UnprocessableEntityError):
        sdk(gateway).chat.completions.create(model="refused-nocode", messages=MSG, max_tokens=2)
    [row] = rows(gateway)
    assert (row["status"], row["error_type"], row["http_status"], row["backend"]) == (
        "client_error", "upstream_rejected_422", 422, "api-refusing-nocode")


def test_rejected_rows_keep_the_model_the_body_named(gateway):
    client = sdk(gateway)
    with pytest.raises(openai.BadRequestError):  # refused by the schema, after the model was read
        client.chat.completions.create(model="hosted", messages=MSG, temperature=7)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-route", messages=MSG)
    with pytest.raises(openai.BadRequestError):  # the model itself is what is wrong: nothing to keep
        client.chat.completions.create(model=42, messages=MSG)  # type: ignore[arg-type]
    got = [(r["status"], r["requested_model"], r["http_status"]) for r in rows(gateway)]
    assert got == [("rejected", "hosted", 400), ("rejected", "no-such-route", 404), ("rejected", "", 400)]


def test_embeddings_on_a_difficulty_route_say_capability(gateway):
    reply = sdk(gateway).embeddings.with_raw_response.create(model="smart", input="hello")
    assert reply.headers["x-switchyard-route-reason"] == "capability"
    assert reply.headers["x-switchyard-backend"] == "emb"
    [row] = rows(gateway)
    assert (row["status"], row["backend"], row["route_reason"], row["difficulty"]) == ("ok", "emb", "capability",
                                                                                        None)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_backend_failure_names_the_backend_and_an_open_circuit_says_circuit_open(gateway, stream):
    standin_control(gateway.ok_url, fail_next=1, fail_status=503)
    for _ in range(2):  # the 503 opens the breaker (failure_threshold 1); the second request tries nothing
        with pytest.raises(openai.APIStatusError):
            sdk(gateway).chat.completions.create(model="flaky-route", messages=MSG, max_tokens=2, stream=stream)
    assert standin_stats(gateway.ok_url)["requests"] == 1
    failed, open_ = rows(gateway)
    assert (failed["status"], failed["error_type"], failed["backend"], failed["http_status"]) == (
        "error", "upstream_http", "flaky", 502)
    assert (open_["status"], open_["error_type"], open_["backend"], open_["http_status"]) == (
        "error", "circuit_open", None, 503)
    assert open_["requested_model"] == "flaky-route"
