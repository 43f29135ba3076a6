"""Keys, budgets and rate limits, enforced under concurrency against a real gateway."""
from __future__ import annotations

import asyncio

import openai
import pytest

from gateway.keys import create_key
from tests.e2e.conftest import ledger_rows, run_gateway
from tests.e2e.policy_builder import fixed, litellm, policy


# Every request costs exactly $0.001: 10 prompt words at $10/Mtok + 10 completion tokens at $90/Mtok.
def policy_text(standin: str) -> str:
    return policy(backends={"api": litellm(standin, input_usd_per_mtok=10, output_usd_per_mtok=90)},
                  routes={"priced": fixed("api")})
PROMPT = "one two three four five six seven eight nine ten"


@pytest.fixture
def gateway(standin, tmp_path):
    with run_gateway(policy_text(standin), tmp_path) as running:
        yield running


def make_key(gateway, **limits) -> str:
    key, _ = gateway.call(lambda: create_key(gateway.gw.db_engine, "team-a", **limits))
    return key


async def _fire(base_url: str, key: str, n: int) -> list:
    client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)

    async def one():
        try:
            return await client.chat.completions.create(
                model="priced", messages=[{"role": "user", "content": PROMPT}], max_tokens=10)
        except openai.APIStatusError as exc:
            return exc

    results = await asyncio.gather(*(one() for _ in range(n)))
    await client.close()
    return results


def test_concurrent_requests_cannot_overspend_a_budget(gateway):
    budget = 0.05  # covers 50 requests at $0.001 each
    key = make_key(gateway, budget_usd=budget)
    results = asyncio.run(_fire(gateway.base_url, key, 200))
    served = [r for r in results if not isinstance(r, Exception)]
    refused = [r for r in results if isinstance(r, Exception)]
    assert served, "some requests must be served"
    assert all(isinstance(r, openai.RateLimitError) for r in refused)
    # issue 12: a spent budget is final: no Retry-After for the SDK to sleep on, and x-should-retry: false
    assert all(r.response.headers.get("retry-after") is None for r in refused)
    assert all(r.response.headers.get("x-should-retry") == "false" for r in refused)
    assert all(r.body["code"] == "insufficient_quota" for r in refused)
    gateway.call(gateway.gw.services.ledger.flush)
    rows = ledger_rows(gateway.config.database_url, "status = 'ok'")
    spent = sum(r["cost_usd"] for r in rows)
    assert len(rows) == len(served) <= 50
    assert spent == pytest.approx(0.001 * len(served))
    assert spent <= budget + 1e-12


def test_rpm_limit_returns_429_with_retry_after(gateway):
    key = make_key(gateway, rpm=5)
    results = asyncio.run(_fire(gateway.base_url, key, 8))
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(refused) == 3
    assert int(refused[0].response.headers["retry-after"]) >= 1
    assert refused[0].body["code"] == "rate_limit_exceeded"


def test_tpm_limit_counts_actual_tokens(gateway):
    key = make_key(gateway, tpm=50)  # each request uses 10 prompt + 10 completion tokens
    client = openai.OpenAI(base_url=gateway.base_url, api_key=key, max_retries=0)
    served = 0
    with pytest.raises(openai.RateLimitError):
        for _ in range(10):
            client.chat.completions.create(model="priced", messages=[{"role": "user", "content": PROMPT}],
                                           max_tokens=10)
            served += 1
    assert 2 <= served <= 3


def test_keys_from_the_table_authenticate_and_are_attributed(gateway):
    key = make_key(gateway)
    openai.OpenAI(base_url=gateway.base_url, api_key=key, max_retries=0).chat.completions.create(
        model="priced", messages=[{"role": "user", "content": PROMPT}], max_tokens=10)
    gateway.call(gateway.gw.services.ledger.flush)
    [row] = ledger_rows(gateway.config.database_url)
    assert row["team"] == "team-a" and row["api_key_id"].startswith("key_")
