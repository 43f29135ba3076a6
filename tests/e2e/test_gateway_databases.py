"""The ledger through the whole gateway, on SQLite and PostgreSQL: shutdown flushes every row."""
from __future__ import annotations

import asyncio

import openai

from tests.e2e.conftest import MASTER_KEY, ledger_rows, run_gateway
from tests.e2e.policy_builder import engine, fixed, litellm, policy


def policy_text(standin: str) -> str:
    return policy(backends={"eng": engine(standin, gpu_hour_usd=3.6), "api": litellm(standin)},
                  routes={"local": fixed("eng", counterfactual="api")})


async def _traffic(base_url: str) -> int:
    client = openai.AsyncOpenAI(base_url=base_url, api_key=MASTER_KEY, max_retries=0)

    async def plain(i: int):
        return await client.chat.completions.create(model="local", messages=[{"role": "user", "content": f"q {i}"}],
                                                    max_tokens=3)

    async def streamed(i: int):
        stream = await client.completions.create(model="local", prompt=f"p {i}", max_tokens=5, stream=True)
        return [chunk async for chunk in stream]

    results = await asyncio.gather(*(plain(i) for i in range(30)), *(streamed(i) for i in range(5)))
    await client.close()
    assert all(r.usage.completion_tokens == 3 for r in results[:30])
    assert all("".join(c.choices[0].text for c in chunks if c.choices) for chunks in results[30:])
    return len(results)


def test_every_request_is_in_the_ledger_after_a_graceful_shutdown(db_url, standin, tmp_path):
    with run_gateway(policy_text(standin), tmp_path, database_url=db_url) as gateway:
        sent = asyncio.run(_traffic(gateway.base_url))
        version = gateway.gw.services.policy_store.current.version
    # No explicit flush: leaving the context shuts the gateway down, which must drain the writer.
    rows = ledger_rows(db_url)
    assert len(rows) == sent == 35
    assert len({r["request_id"] for r in rows}) == 35
    assert all(r["status"] == "ok" and r["policy_version"] == version for r in rows)
    assert sum(1 for r in rows if r["completion_tokens"] == 5) == 5
    assert all(r["cost_basis"] == "gpu_amortized" and r["counterfactual_cost_usd"] > 0 for r in rows)
