"""Engine fleets (gateway/fleet.py): the real gateway in front of three stand-in engines with a prefix cache.

A conversation stays on the replica holding its KV (header and ledger say which), the policy's load thresholds
break that affinity, a dead replica is ejected and re-admitted by the health checks.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from urllib.parse import urlparse

import httpx
import openai
import pytest

from gateway.testing.standin import run_standin, standin_stats
from tests.e2e.conftest import MASTER_KEY, ledger_rows, run_gateway

POLICY = """
backends:
  fleet:
    kind: engine
    model: demo-model
    api_bases: [{a}, {b}, {c}]
    gpu_hour_usd: 3.6
    retry_backoff_s: 0.05
{balance}
routes:
  chat:
    strategy: fixed
    backend: fleet
"""

SYSTEM = "You are a careful assistant for the shipping desk. " * 40  # ~400 words shared by every conversation


def _policy(urls: list[str], balance: str = "") -> str:
    return POLICY.format(a=urls[0], b=urls[1], c=urls[2], balance=balance)


def _client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key=MASTER_KEY, max_retries=0, timeout=30)


def _ask(client: openai.OpenAI, messages: list[dict], stream: bool = False) -> tuple[str, str, str]:
    """(replica header, answer text, request id)."""
    if stream:
        with client.chat.completions.with_streaming_response.create(model="chat", messages=messages,
                                                                     stream=True) as raw:
            text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
            return raw.headers["x-switchyard-replica"], text, raw.headers["x-request-id"]
    raw = client.chat.completions.with_raw_response.create(model="chat", messages=messages)
    return raw.headers["x-switchyard-replica"], raw.parse().choices[0].message.content, raw.headers["x-request-id"]


def _conversation(client: openai.OpenAI, topic: str, turns: int, stream_last: bool = False,
                  system: str = SYSTEM) -> list[tuple[str, str]]:
    """Send `turns` turns of one conversation (each resends the history); [(replica, request id)] per turn."""
    messages = [{"role": "system", "content": system}]
    served = []
    for t in range(turns):
        messages.append({"role": "user", "content": f"question {t} about {topic}: " + "details " * 30})
        replica, answer, rid = _ask(client, messages, stream=stream_last and t == turns - 1)
        messages.append({"role": "assistant", "content": answer})
        served.append((replica, rid))
    return served


@pytest.fixture
def engines():
    """Three stand-in engines with the prefix-cache model (fast prefill: the tests do not measure time)."""
    with ExitStack() as stack:
        yield [stack.enter_context(run_standin(engine_extension=True, prefill_ms_per_token=0.01))
               for _ in range(3)]


def test_conversations_stick_to_their_replica_and_the_ledger_says_which(engines, tmp_path: Path) -> None:
    with run_gateway(_policy(engines), tmp_path) as gateway:
        client = _client(gateway)
        # Each with its own system prompt: no prefix in common, so idle replicas take new conversations.
        conversations = {topic: _conversation(client, topic, 3, stream_last=True, system=f"{topic} desk. {SYSTEM}")
                         for topic in ("invoices", "customs", "pallets")}
        gateway.call(gateway.gw.services.ledger.flush)
        rows = {r["request_id"]: r for r in ledger_rows(gateway.config.database_url)}
    for topic, served in conversations.items():
        replicas = {replica for replica, _ in served}
        assert len(replicas) == 1, f"{topic} moved between replicas: {served}"
        for t, (replica, rid) in enumerate(served):
            row = rows[rid]
            assert row["replica"] == replica and row["backend"] == "fleet" and row["status"] == "ok"
            if t:  # the history was sent to this replica before: its KV (the stand-in's cache) holds it
                assert row["cached_prompt_tokens"] > 0.5 * row["prompt_tokens"]
    # Nothing in common, nothing in flight: three conversations, three replicas.
    assert {served[0][0] for served in conversations.values()} == {"0", "1", "2"}
    hit = [standin_stats(url) for url in engines]
    assert sum(s["cached_tokens"] for s in hit) > 0.5 * sum(s["prompt_tokens"] for s in hit)


def test_load_past_the_threshold_breaks_affinity(tmp_path: Path) -> None:
    balance = "    balance: {balance_abs_threshold: 1, balance_rel_threshold: 1.5}"
    with ExitStack() as stack:
        urls = [stack.enter_context(run_standin(engine_extension=True, prefill_ms_per_token=0.01,
                                                first_byte_delay_ms=3000)) for _ in range(3)]
        with run_gateway(_policy(urls, balance), tmp_path) as gateway:
            client = _client(gateway)
            first = _conversation(client, "invoices", 1)[0][0]
            messages = [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": "question 0 about invoices: " + "details " * 30}]
            with ThreadPoolExecutor(4) as pool:  # four at once: the holder is loaded past the threshold
                served = list(pool.map(lambda _: _ask(client, messages)[0], range(4)))
    # Two go to the replica holding the prefix (1 in flight beyond the idlest is not past the threshold); then it
    # is 2 ahead (past 1, and above 1.5x): the rest go to the least loaded replicas.
    assert served.count(first) == 2, served
    assert set(served) == {"0", "1", "2"}


def test_default_thresholds_keep_affinity_under_the_same_load(tmp_path: Path) -> None:
    with ExitStack() as stack:
        urls = [stack.enter_context(run_standin(engine_extension=True, prefill_ms_per_token=0.01,
                                                first_byte_delay_ms=3000)) for _ in range(3)]
        with run_gateway(_policy(urls), tmp_path) as gateway:
            client = _client(gateway)
            first = _conversation(client, "invoices", 1)[0][0]
            messages = [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": "question 0 about invoices: " + "details " * 30}]
            with ThreadPoolExecutor(4) as pool:
                served = list(pool.map(lambda _: _ask(client, messages)[0], range(4)))
    assert served == [first] * 4  # SGLang's defaults (64 requests, 1.5x): four in flight keep the cache


def test_a_dead_replica_is_ejected_and_readmitted(tmp_path: Path) -> None:
    balance = "    balance: {health_interval_s: 0.2}"
    with ExitStack() as stack:
        urls = [stack.enter_context(run_standin(engine_extension=True, prefill_ms_per_token=0.01))
                for _ in range(2)]
        dead_stack = ExitStack()
        urls.append(dead_stack.enter_context(run_standin(engine_extension=True, prefill_ms_per_token=0.01)))
        with run_gateway(_policy(urls, balance), tmp_path) as gateway:
            client = _client(gateway)
            fleet = gateway.gw.services.pool.get("fleet")
            histories = {}
            for topic in ("invoices", "customs", "pallets"):
                messages = [{"role": "system", "content": f"{topic} desk. {SYSTEM}"},
                            {"role": "user", "content": f"first question about {topic}"}]
                replica, answer, _ = _ask(client, messages)
                histories[replica] = messages + [{"role": "assistant", "content": answer},
                                                 {"role": "user", "content": "and then?"}]
            assert set(histories) == {"0", "1", "2"}
            dead_stack.close()  # replica 2's engine goes away
            # Its conversation's next turn goes there (its KV), cannot connect, and is served by another replica.
            moved, _, moved_id = _ask(client, histories["2"])
            assert moved != "2"
            assert fleet.status()[2]["ejected"]
            others = [_ask(client, histories[r])[0] for r in ("0", "1")]
            assert others == ["0", "1"]
            health = httpx.get(gateway.root + "/health", timeout=10).json()
            assert health["backends"]["fleet"] == "up" and health["status"] == "ok"  # two of three serve
            # Back on the same port: the health check admits it again, and new conversations reach it.
            port = urlparse(urls[2]).port
            with run_standin(port=port, engine_extension=True, prefill_ms_per_token=0.01):
                assert _wait(lambda: not fleet.status()[2]["ejected"])
                again = [_ask(client, [{"role": "user", "content": f"new topic {i}"}])[0] for i in range(6)]
                assert "2" in again
            gateway.call(gateway.gw.services.ledger.flush)
            row = ledger_rows(gateway.config.database_url, "request_id = :r", {"r": moved_id})[0]
    assert row["status"] == "ok" and row["replica"] == moved and row["attempts"] == 2


def _wait(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False
