"""Clients that leave a stream mid-way, against a real gateway on 127.0.0.1 relaying a litellm backend's stream
(litellm buffers the upstream's chunks, so reading the next one often does not suspend): the relay stops within
about a second of each client leaving (the upstream connection is closed, the row says client_closed, the
budget reservation is released), and a client streaming beside them is served normally.

Before the fix, a relay with chunks already buffered never yielded to the event loop: it kept writing to the
closed socket (asyncio logged "socket.send() raised exception." per write), the disconnect was noticed seconds
later, and every other stream on the gateway waited behind it."""
from __future__ import annotations

import asyncio
import logging
import time

import httpx
import pytest

from gateway.keys import create_key
from gateway.testing.standin import standin_control, standin_stats
from tests.e2e.conftest import MASTER_KEY, ledger_rows, run_gateway
from tests.e2e.policy_builder import fixed, litellm, policy


def policy_text(standin: str) -> str:
    return policy(backends={"api": litellm(standin, input_usd_per_mtok=1, output_usd_per_mtok=2, max_retries=0)},
                  routes={"chat": fixed("api")})
LEAVERS = 6


@pytest.fixture
def gateway(standin, tmp_path):
    with run_gateway(policy_text(standin), tmp_path) as running:
        yield running


async def _leave_after(url: str, key: str, lines: int) -> float:
    """Stream an n=4 answer of 3,000 tokens, leave after `lines` lines; when it left (monotonic)."""
    body = {"model": "chat", "stream": True, "n": 4, "max_tokens": 3000,
            "messages": [{"role": "user", "content": "a long story"}]}
    async with httpx.AsyncClient(timeout=30) as http, http.stream(
            "POST", url, json=body, headers={"authorization": f"Bearer {key}"}) as response:
        assert response.status_code == 200
        got = 0
        async for _ in response.aiter_lines():
            got += 1
            if got >= lines:
                break
    return time.monotonic()


async def _stay(url: str) -> list[str]:
    body = {"model": "chat", "stream": True, "max_tokens": 40, "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(timeout=30) as http, http.stream(
            "POST", url, json=body, headers={"authorization": f"Bearer {MASTER_KEY}"}) as response:
        assert response.status_code == 200
        return [line async for line in response.aiter_lines() if line.startswith("data: ")]


def test_leaving_clients_stop_their_relays_promptly_and_others_are_unaffected(gateway, standin, caplog):
    caplog.set_level(logging.WARNING, logger="asyncio")
    url = gateway.base_url + "/chat/completions"
    key, info = gateway.call(lambda: create_key(gateway.gw.db_engine, "leavers", budget_usd=100.0))
    alone = asyncio.run(_stay(url))  # warm-up: litellm's tokenizer loads on its first stream
    assert alone[-1] == "data: [DONE]"
    standin_control(standin, token_delay_ms=1, reset=True)

    async def scenario() -> tuple[list[str], list[int]]:
        stayer = asyncio.ensure_future(_stay(url))
        await asyncio.gather(*(_leave_after(url, key, 12) for _ in range(LEAVERS)))
        seen = []
        for _ in range(60):  # how many upstream streams the gateway closed, each 50 ms after the last client left
            seen.append(standin_stats(standin)["disconnects"])
            if seen[-1] >= LEAVERS:
                break
            await asyncio.sleep(0.05)
        return await stayer, seen

    stayed, seen = asyncio.run(scenario())
    closed_after = (len(seen) - 1) * 0.05
    print(f"upstream streams closed {closed_after:.2f} s after the last of {LEAVERS} clients left "
          f"(disconnects seen every 50 ms: {seen})")
    assert seen[-1] == LEAVERS, f"the upstream streams were still open 3 s after their clients left: {seen}"
    assert closed_after <= 1.0
    assert stayed[-1] == "data: [DONE]" and len(stayed) == len(alone)  # as whole as when it ran alone

    gateway.call(gateway.gw.services.ledger.flush)
    rows = ledger_rows(gateway.config.database_url, "api_key_id = :k", {"k": info.id})
    assert len(rows) == LEAVERS and {r["status"] for r in rows} == {"client_closed"}
    # Each client read 12 lines: the relay stopped soon after (not after the backlog litellm had buffered).
    print("tokens relayed per leaving client:", sorted(r["completion_tokens"] for r in rows))
    assert all(0 < r["completion_tokens"] < 4 * 300 for r in rows)
    assert gateway.gw.services.budgets.reserved(info.id) == 0.0
    assert not [r for r in caplog.records if "socket.send() raised" in r.getMessage()]
