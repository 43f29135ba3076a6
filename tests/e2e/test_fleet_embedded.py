"""`launch: embedded` with `replicas: N`: the gateway starts N real engines and balances them as one fleet."""
from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.e2e.conftest import MASTER_KEY, ledger_rows, run_gateway
from tests.hosted.serving_helpers import build_tiny_chat_model

POLICY = """
backends:
  local:
    kind: engine
    launch: embedded
    replicas: 2
    balance: {{health_interval_s: 0.5}}
    model: tiny
    engine_model_path: {model_dir}
    engine_args: {{threads: 1, max-num-seqs: 4}}
    gpu_hour_usd: 2.0
routes:
  tiny:
    strategy: fixed
    backend: local
"""


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-chat")
    build_tiny_chat_model(directory)
    return directory


def test_two_embedded_replicas_each_keep_their_conversation(tiny_model_dir, tmp_path) -> None:
    with run_gateway(POLICY.format(model_dir=tiny_model_dir), tmp_path) as gateway:
        processes = gateway.gw.embedded.processes()
        assert set(processes) == {"local/0", "local/1"}
        assert len({p.pid for p in processes.values()}) == 2 and len({p.port for p in processes.values()}) == 2
        fleet = gateway.gw.services.pool.get("local")
        deadline = time.monotonic() + 10  # a replica probed while it was still starting is admitted on the next probe
        while any(r["ejected"] for r in fleet.status()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [r["api_base"] for r in fleet.status()] == [processes[f"local/{i}"].base_url for i in (0, 1)]
        client = openai.OpenAI(base_url=gateway.base_url, api_key=MASTER_KEY, max_retries=0, timeout=60)
        served = {}
        for topic in ("invoices", "customs"):
            messages = [{"role": "system", "content": f"{topic}: you are a terse assistant. " * 12},
                        {"role": "user", "content": "hello"}]
            turns = []
            for _ in range(2):
                raw = client.chat.completions.with_raw_response.create(model="tiny", messages=messages, max_tokens=4)
                reply = raw.parse()
                turns.append((raw.headers["x-switchyard-replica"], raw.headers["x-request-id"], reply))
                messages += [{"role": "assistant", "content": reply.choices[0].message.content or "ok"},
                             {"role": "user", "content": "and then?"}]
            served[topic] = turns
        health = httpx.get(gateway.root + "/health", timeout=10).json()
        gateway.call(gateway.gw.services.ledger.flush)
        rows = {r["request_id"]: r for r in ledger_rows(gateway.config.database_url)}
    assert {turns[0][0] for turns in served.values()} == {"0", "1"}  # one conversation per idle replica
    for turns in served.values():
        assert turns[0][0] == turns[1][0]  # the second turn went where its KV is ...
        assert turns[1][2].usage.prompt_tokens_details.cached_tokens > 0  # ... and the engine's cache served it
        assert all(rows[rid]["replica"] == replica and rows[rid]["backend"] == "local" for replica, rid, _ in turns)
    assert health["backends"]["local"] == "up"
    assert {health["engines"][n]["state"] for n in ("local/0", "local/1")} == {"up"}
