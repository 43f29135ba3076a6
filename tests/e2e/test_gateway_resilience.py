"""Disconnecting clients, slow upstreams and live policy edits, against a real gateway."""
from __future__ import annotations

import time

import httpx
import openai
import pytest

from gateway.testing.standin import standin_control, standin_stats
from tests.e2e.conftest import MASTER_KEY, ledger_rows, run_gateway
from tests.e2e.policy_builder import engine, fixed, policy


def policy_text(standin: str, timeout: float) -> str:
    return policy(backends={"eng": engine(standin, gpu_hour_usd=3.6, timeout_s=timeout, max_retries=0)},
                  routes={"local": fixed("eng")})


@pytest.fixture
def gateway(standin, tmp_path):
    with run_gateway(policy_text(standin, 1.0), tmp_path) as running:
        yield running


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached in time")


def test_client_disconnect_mid_stream_cancels_upstream_and_logs_tokens_produced(gateway, standin):
    standin_control(standin, token_delay_ms=50)
    received = 0
    with httpx.Client(timeout=10) as http, http.stream("POST", gateway.base_url + "/chat/completions",
                     headers={"authorization": f"Bearer {MASTER_KEY}"},
                     json={"model": "local", "messages": [{"role": "user", "content": "long story"}],
                           "max_tokens": 200, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                received += 1
            if received == 5:
                break  # leaving the block closes the connection mid-stream
    wait_for(lambda: standin_stats(standin)["disconnects"] >= 1)
    stats = standin_stats(standin)
    assert stats["completed"] == 0  # the upstream never finished the 200-token answer
    gateway.call(gateway.gw.services.ledger.flush)
    wait_for(lambda: len(ledger_rows(gateway.config.database_url)) == 1)
    [row] = ledger_rows(gateway.config.database_url)
    assert row["status"] == "client_closed"
    assert received <= row["completion_tokens"] < 200


def test_upstream_timeout_is_504(gateway, standin):
    standin_control(standin, first_byte_delay_ms=3000)
    with pytest.raises(openai.APIStatusError) as err:
        openai.OpenAI(base_url=gateway.base_url, api_key=MASTER_KEY, max_retries=0).chat.completions.create(
            model="local", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert err.value.status_code == 504
    gateway.call(gateway.gw.services.ledger.flush)
    [row] = ledger_rows(gateway.config.database_url)
    assert row["status"] == "error" and row["error_type"] == "upstream_timeout"


def test_policy_edits_hot_reload_and_bad_edits_are_rejected(gateway, standin):
    client = openai.OpenAI(base_url=gateway.base_url, api_key=MASTER_KEY, max_retries=0)
    old_version = gateway.gw.services.policy_store.current.version
    path = gateway.config.policy_path
    path.write_text(path.read_text() + "  local2:\n    strategy: fixed\n    backend: eng\n")
    wait_for(lambda: gateway.gw.services.policy_store.current.version != old_version)
    assert sorted(m.id for m in client.models.list().data) == ["local", "local2"]
    good_version = gateway.gw.services.policy_store.current.version
    path.write_text(path.read_text() + "  broken:\n    strategy: fixed\n    backend: nowhere\n")
    time.sleep(1.5)
    assert gateway.gw.services.policy_store.current.version == good_version
    reply = client.chat.completions.create(model="local2", messages=[{"role": "user", "content": "x"}],
                                           max_tokens=2)
    assert reply.usage.completion_tokens == 2
    gateway.call(gateway.gw.services.ledger.flush)
    [row] = ledger_rows(gateway.config.database_url)
    assert row["policy_version"] == good_version


def test_client_gone_right_after_headers_is_still_accounted_and_cancelled(gateway, standin):
    import json
    import socket
    from urllib.parse import urlsplit

    standin_control(standin, token_delay_ms=50)
    url = urlsplit(gateway.base_url)
    body = json.dumps({"model": "local", "messages": [{"role": "user", "content": "x"}], "max_tokens": 100,
                       "stream": True}).encode()
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {MASTER_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        head = b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(1)
        assert head.startswith(b"HTTP/1.1 200")
    wait_for(lambda: standin_stats(standin)["disconnects"] >= 1)
    gateway.call(gateway.gw.services.ledger.flush)
    wait_for(lambda: len(ledger_rows(gateway.config.database_url)) == 1)
    [row] = ledger_rows(gateway.config.database_url)
    assert row["status"] == "client_closed" and row["completion_tokens"] < 100
    assert gateway.call(_in_flight) == 0


async def _in_flight() -> float:
    from gateway import metrics

    return metrics.IN_FLIGHT._value.get()
