"""A bug anywhere in the gateway is an OpenAI-shaped 500 with the request id, never plain text, and a /v1 request
it ends still gets its ledger row. The fault is real: a part of the running gateway that raises."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.e2e.conftest import MASTER_KEY, ledger_rows, run_gateway
from tests.e2e.policy_builder import one_engine_route


class _Broken:
    """Stands in for a part of the gateway whose every use raises (a bug, not a refused request)."""

    def __getattr__(self, name: str):
        raise RuntimeError(f"injected fault: {name}")


@pytest.fixture
def gateway(standin, tmp_path):
    with run_gateway(one_engine_route(standin), tmp_path) as running:
        services = running.gw.services
        real = {name: getattr(services, name) for name in ("auth", "limiter", "policy_store")}
        try:
            yield running
        finally:  # the real parts back, so the gateway shuts down as it should
            for name, part in real.items():
                setattr(services, name, part)


def _assert_openai_500(response: httpx.Response) -> str:
    assert response.status_code == 500
    assert response.headers["content-type"].startswith("application/json")
    request_id = response.headers["x-request-id"]
    error = response.json()["error"]
    assert error["type"] == "api_error" and error["code"] == "internal_error"
    assert request_id in error["message"]
    return request_id


def test_an_unexpected_error_on_a_v1_post_is_an_openai_500_with_its_request_id_and_a_row(gateway):
    services = gateway.gw.services
    services.limiter = _Broken()  # raises after auth and routing, before any reservation
    client = openai.OpenAI(base_url=gateway.base_url, api_key=MASTER_KEY, max_retries=0)
    with pytest.raises(openai.InternalServerError) as err:
        client.chat.completions.create(model="local", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    response = err.value.response
    request_id = _assert_openai_500(response)
    assert err.value.body["code"] == "internal_error"
    gateway.call(services.ledger.flush)
    [row] = ledger_rows(gateway.config.database_url)
    assert row["request_id"] == request_id
    assert (row["status"], row["error_type"], row["http_status"]) == ("error", "internal", 500)
    assert row["api_key_id"] == "master" and row["requested_model"] == "local" and row["route"] == "local"
    assert row["endpoint"] == "chat.completions" and row["latency_ms"] is not None


def test_an_unexpected_error_on_any_other_route_is_an_openai_500(gateway):
    services = gateway.gw.services
    services.policy_store = _Broken()
    with httpx.Client(base_url=gateway.root, timeout=10) as http:
        for method, path in (("GET", "/health"), ("GET", "/v1/models"), ("GET", "/metrics")):
            response = http.request(method, path, headers={"authorization": f"Bearer {MASTER_KEY}"})
            _assert_openai_500(response)
        # A /v1 POST that fails before its key is known still gets a row (no key, the endpoint, the error).
        services.auth = _Broken()
        response = http.post("/v1/embeddings", json={"model": "local", "input": "x"},
                              headers={"authorization": f"Bearer {MASTER_KEY}"})
        request_id = _assert_openai_500(response)
    gateway.call(services.ledger.flush)
    [row] = ledger_rows(gateway.config.database_url)
    assert row["request_id"] == request_id and row["endpoint"] == "embeddings"
    assert (row["status"], row["error_type"], row["api_key_id"]) == ("error", "internal", None)
