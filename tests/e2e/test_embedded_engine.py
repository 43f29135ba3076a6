"""`launch: embedded`: the gateway starts the real engine as a supervised child and routes around it when it dies."""
from __future__ import annotations

import os
import signal
import time

import openai
import pytest

from tests.e2e.conftest import MASTER_KEY, ledger_rows, run_gateway
from tests.hosted.serving_helpers import build_tiny_chat_model

POLICY = """
backends:
  local:
    kind: engine
    launch: embedded
    model: tiny
    engine_model_path: {model_dir}
    engine_args: {{threads: 1, max-num-seqs: 8}}
    gpu_hour_usd: 2.0
    failure_threshold: 100
  spare:
    kind: engine
    model: spare
    api_base: {standin}
routes:
  tiny:
    strategy: fixed
    backend: local
    fallbacks: [spare]
"""


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-chat")
    build_tiny_chat_model(directory)
    return directory


def test_embedded_engine_serves_and_is_restarted_when_it_dies(tiny_model_dir, standin, tmp_path):
    with run_gateway(POLICY.format(model_dir=tiny_model_dir, standin=standin), tmp_path) as gateway:
        client = openai.OpenAI(base_url=gateway.base_url, api_key=MASTER_KEY, max_retries=0)
        messages = [{"role": "system", "content": "You are a terse assistant. " * 12},
                    {"role": "user", "content": "hello"}]

        def ask():
            raw = client.chat.completions.with_raw_response.create(model="tiny", messages=messages, max_tokens=4)
            return raw.headers["x-switchyard-backend"], raw.parse()

        backend, reply = ask()
        assert backend == "local" and reply.usage.completion_tokens >= 1
        backend, reply = ask()  # same long prefix: served from the engine's prefix cache
        assert backend == "local" and reply.usage.prompt_tokens_details.cached_tokens > 0

        process = gateway.gw.embedded.processes()["local"]
        os.kill(process.pid, signal.SIGKILL)
        time.sleep(0.3)
        backend, _ = ask()
        assert backend == "spare"  # the engine is down: the fallback answers

        assert gateway.call(lambda: process.wait_ready(120))
        backend, _ = ask()
        assert backend == "local" and process.restarts == 1

        time.sleep(2.0)  # the load monitor scrapes the engine a few times: its up and busy time are measured
        gateway.call(gateway.gw.services.ledger.flush)
        rows = ledger_rows(gateway.config.database_url)
        local_rows = [r for r in rows if r["backend"] == "local"]
        assert [r["backend"] for r in rows] == ["local", "local", "spare", "local"]
        # (lists of tuples: a failure shows every row's values)
        assert [(r["cost_basis"], r["gpu_seconds"] > 0, r["cost_usd"] > 0) for r in local_rows] == \
            [("gpu_amortized", True, True)] * 3
        assert local_rows[1]["cached_prompt_tokens"] > 0
        # The policy prices this engine at a GPU rate, but the engine itself says where it runs (a CPU here),
        # in each answer: even a row served before the gateway's first /metrics scrape says cpu.
        assert [(r["device_hour_usd"], r["device_kind"], r["utilisation"] is not None) for r in local_rows] == \
            [(2.0, "cpu", True)] * 3
    # At shutdown the recorder writes each engine's open interval: its measured up and busy time.
    uptime = _uptime_rows(gateway.config.database_url)
    assert {r["backend"] for r in uptime} == {"local"}  # the stand-in has no busy counter: not recorded
    up, busy = sum(r["seconds"] for r in uptime), sum(r["busy_seconds"] for r in uptime)
    assert 0 < busy <= up and all(r["device_hour_usd"] == 2.0 and r["device_kind"] == "cpu" for r in uptime)


def _uptime_rows(url: str) -> list[dict]:
    import sqlalchemy as sa

    from gateway import db

    engine = sa.create_engine(db.sync_url(url))
    try:
        with engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(sa.text("SELECT * FROM engine_uptime"))]
    finally:
        engine.dispose()
