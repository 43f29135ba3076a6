"""The `fallback` and `budget` route reasons, through a real gateway with stand-in backends."""
from __future__ import annotations

import openai
import pytest

from gateway.keys import create_key
from tests.e2e.conftest import MASTER_KEY, ledger_rows, run_gateway, tiny_difficulty_model
from tests.e2e.policy_builder import dead, difficulty, engine, litellm, policy


def policy_text(standin: str, model: object) -> str:
    return policy(backends={"local": engine(standin, model="small", gpu_hour_usd=2.0, reserve_usd_per_mtok=1),
                            "api": litellm(standin, model="openai/gpt-4o", input_usd_per_mtok=10,
                                           output_usd_per_mtok=90),
                            "dead": dead()},
                  routes={"thrifty": difficulty("local", "api", model, budget_downgrade=True),
                          "plain": difficulty("local", "api", model),
                          "broken-easy": difficulty("dead", "api", model)})
HARD = "prove the statement number 7"
EASY = "say hi 7"


@pytest.fixture
def gateway(standin, tmp_path):
    tiny_difficulty_model(tmp_path / "m.npz")
    with run_gateway(policy_text(standin, tmp_path / "m.npz"),
                     tmp_path) as running:
        yield running


def test_a_key_that_cannot_afford_hard_is_served_by_easy_where_the_route_allows(gateway) -> None:
    # Worst case on `api` for this request: ~12 prompt tokens at $10/M + 10 completion tokens at $90/M ≈ $0.001;
    # on `local`: 22 tokens at the $1/M reservation rate ≈ $0.00002. The key has $0.0005.
    key, _ = gateway.call(lambda: create_key(gateway.gw.db_engine, "team-a", budget_usd=0.0005))
    client = openai.OpenAI(base_url=gateway.base_url, api_key=key, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="thrifty", messages=[{"role": "user", "content": HARD}], max_tokens=10)
    assert raw.headers["x-switchyard-backend"] == "local"
    with pytest.raises(openai.RateLimitError, match="Budget exceeded"):
        client.chat.completions.create(model="plain", messages=[{"role": "user", "content": HARD}], max_tokens=10)
    gateway.call(gateway.gw.services.ledger.flush)
    rows = ledger_rows(gateway.config.database_url)
    assert [(r["route"], r["backend"], r["route_reason"], r["status"]) for r in rows] == [
        ("thrifty", "local", "budget", "ok"), ("plain", None, "difficulty_hard", "rejected")]
    assert rows[0]["difficulty"] >= 0.5 and 0 < rows[0]["cost_usd"] < 0.0005


def test_served_by_a_later_backend_is_logged_as_fallback(gateway) -> None:
    client = openai.OpenAI(base_url=gateway.base_url, api_key=MASTER_KEY, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="broken-easy", messages=[{"role": "user", "content": EASY}], max_tokens=3)
    assert raw.headers["x-switchyard-backend"] == "api"  # easy by score, its engine is down, hard answered
    gateway.call(gateway.gw.services.ledger.flush)
    [row] = ledger_rows(gateway.config.database_url)
    assert (row["backend"], row["route_reason"], row["attempts"]) == ("api", "fallback", 2)
    assert row["difficulty"] < 0.5 and row["threshold"] == 0.5
