"""Capability routing through a real gateway: a request never reaches a backend that cannot serve it."""
from __future__ import annotations

import openai
import pytest

from tests.e2e.conftest import MASTER_KEY, ledger_rows, run_gateway, tiny_difficulty_model
from tests.e2e.policy_builder import engine, litellm, policy


def policy_text(standin: str, model: object) -> str:
    return policy(backends={"local": engine(standin, model="small", gpu_hour_usd=2.0),
                            "api": litellm(standin, model="openai/gpt-4o", input_usd_per_mtok=10,
                                           output_usd_per_mtok=90)},
                  routes={"auto": {"strategy": "difficulty", "easy": "local", "hard": "api", "threshold": 0.5,
                                   "model_path": str(model)},
                          "engine-only": {"backend": "local"}})
IMAGE = [{"role": "user", "content": [{"type": "text", "text": "say hi 1"},
                                      {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]


@pytest.fixture
def gateway(standin, tmp_path):
    tiny_difficulty_model(tmp_path / "m.npz")
    with run_gateway(policy_text(standin, tmp_path / "m.npz"), tmp_path) as running:
        yield running


def test_an_image_for_an_engine_escalates_or_is_refused(gateway) -> None:
    client = openai.OpenAI(base_url=gateway.base_url, api_key=MASTER_KEY, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model="auto", messages=IMAGE, max_tokens=3)
    assert raw.headers["x-switchyard-backend"] == "api"  # easy by score, but the engine has no vision
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="engine-only", messages=IMAGE, max_tokens=3)
    assert err.value.code == "unsupported_capability" and "does not support images" in err.value.message
    gateway.call(gateway.gw.services.ledger.flush)
    rows = ledger_rows(gateway.config.database_url)
    assert [(r["route"], r["backend"], r["route_reason"], r["status"], r["http_status"]) for r in rows] == [
        ("auto", "api", "capability", "ok", 200), ("engine-only", None, None, "rejected", 400)]
    assert rows[0]["difficulty"] < 0.5  # it was easy: only the capability sent it to the API
