"""Embedded engines that start slowly or crash-loop, with real `switchyard engine serve` children: the gateway serves
API routes meanwhile (engine routes fall back, or answer 503 with Retry-After), /health shows `starting` and then
the exit code and stderr tail of each failed run, the gateway log says why at ERROR, and SIGTERM during start-up
ends everything within 5 s."""
from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from pathlib import Path

import httpx
import openai
import pytest

from gateway.embedded import EngineProcess
from gateway.policy import BackendSpec
from tests.e2e.conftest import free_port, wait_http
from tests.e2e.test_serve_start import MASTER, Serve

POLICY = """\
backends:
  local:
    kind: engine
    launch: embedded
    model: demo
    engine_model_path: {model}
    engine_args: {{threads: 1}}
    gpu_hour_usd: 1.0
  api:
    kind: litellm
    model: openai/gpt-4o-mini
    api_base: {standin}
    api_key_env: STANDIN_API_KEY
routes:
  demo:
    backend: local
  demo-or-api:
    backend: local
    fallbacks: [api]
  gpt-4o-mini:
    backend: api
"""


async def test_an_engine_refusing_its_arguments_says_why_in_the_log_and_its_state(tmp_path, caplog):
    """A flag the engine's parser refuses (the spec is built directly: a policy with it no longer loads) makes the
    real engine exit 2 at every start; the reason is argparse's own line, kept from its stderr."""
    caplog.set_level(logging.INFO, logger="switchyard.embedded")
    spec = BackendSpec(name="local", kind="engine", model="demo", launch="embedded",
                       engine_model_path=str(tmp_path), engine_args={"max-batch-size": 8})
    process = EngineProcess(spec, tmp_path / "logs")
    process.start()
    try:
        assert process.state == "starting" and process.retry_after_s() is not None
        deadline = time.monotonic() + 60
        while process.last_exit is None:
            assert time.monotonic() < deadline, "the engine did not exit"
            await asyncio.sleep(0.1)
        exit_ = process.last_exit
        assert exit_.code == 2 and process.state == "restarting"
        assert any("unrecognized arguments: --max-batch-size 8" in line for line in exit_.stderr_tail), exit_
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert any("exited with code 2" in m and "unrecognized arguments: --max-batch-size 8" in m for m in errors)
        assert process.retry_after_s() >= 1  # the backoff left, plus a start
        # the log file still gets everything the child wrote
        assert "unrecognized arguments" in process.log_path.read_text()
    finally:
        await process.stop()
    assert process.pid is None


def _health(port: int) -> dict:
    return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()


def test_the_gateway_serves_while_its_engine_crash_loops_and_stops_within_5_s(standin, tmp_path):
    """The engine's model is missing: it exits 2 a few seconds into each start. Before, the gateway did not listen
    for the 120 s it waited for the engine; API routes were down too, and the log said only `exited with code 2`."""
    missing = tmp_path / "no-such-model"
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.format(model=missing, standin=standin))
    port = free_port()
    serve = Serve(tmp_path, "--policy", str(policy), "--port", str(port),
                  "--database-url", f"sqlite:///{tmp_path / 'ledger.db'}",
                  env={"STANDIN_API_KEY": os.environ["STANDIN_API_KEY"]})
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=40)
        health = _health(port)
        assert health["backends"]["local"] in ("starting", "down"), health
        assert health["engines"]["local"]["state"] in ("starting", "restarting"), health

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=MASTER, max_retries=0)
        messages = [{"role": "user", "content": "hi"}]
        raw = client.chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=messages)
        assert raw.headers["x-switchyard-backend"] == "api" and raw.parse().choices[0].message.content
        raw = client.chat.completions.with_raw_response.create(model="demo-or-api", messages=messages)
        assert raw.headers["x-switchyard-backend"] == "api"  # the engine is not serving: its fallback answers
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(model="demo", messages=messages)
        assert refused.value.status_code == 503 and refused.value.code == "engine_starting"
        assert int(refused.value.response.headers["retry-after"]) >= 1

        deadline = time.monotonic() + 60
        while (last := _health(port)["engines"]["local"]["last_exit"]) is None:
            assert time.monotonic() < deadline, serve.output
            time.sleep(0.2)
        assert last["code"] == 2 and any("is not a checkpoint directory or a GGUF file" in line
                                         for line in last["stderr_tail"]), last
        serve.wait_for_output("is not a checkpoint directory or a GGUF file")
        error_lines = [line for line in serve.output.splitlines() if " ERROR " in line]
        assert any("embedded engine local exited with code 2" in line for line in error_lines), serve.output
        pids = [int(p) for p in re.findall(r"embedded engine local started \(pid (\d+)\)", serve.output)]
        took = serve.stop()
    finally:
        serve.kill()
    assert took < 5, serve.output
    assert all(not _alive(pid) for pid in pids)
    assert "is ready at" not in serve.output and "Traceback" not in serve.output


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    from tests.hosted.serving_helpers import build_tiny_chat_model

    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.mark.parametrize("after_s", [2.0])
def test_sigterm_while_a_real_engine_starts_ends_everything_within_5_s(standin, tiny_model_dir, tmp_path, after_s):
    """A real engine in the middle of its start (importing torch, or loading the model, 2 s in on a busy box): the
    gateway, already serving, stops within 5 s of SIGTERM and takes the engine with it (measured here: 0.4 s at
    0.5 s and at 3 s in)."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.format(model=tiny_model_dir, standin=standin))
    port = free_port()
    serve = Serve(tmp_path, "--policy", str(policy), "--port", str(port),
                  "--database-url", f"sqlite:///{tmp_path / 'ledger.db'}",
                  env={"STANDIN_API_KEY": os.environ["STANDIN_API_KEY"]})
    try:
        serve.wait_for_output("embedded engine local started")
        time.sleep(after_s)
        pid = int(re.search(r"embedded engine local started \(pid (\d+)\)", serve.output).group(1))
        took = serve.stop()
    finally:
        serve.kill()
    print(f"SIGTERM {after_s} s into the engine's start: the gateway exited in {took:.2f} s")
    assert took < 5, serve.output
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is not alive: it is only waiting to be reaped (by init once the gateway is gone)
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
