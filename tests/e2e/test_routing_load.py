"""Utilisation-aware routing against a real engine: spill-over when it is saturated, a relaxed threshold when idle.

The engine is `switchyard engine serve` on a tiny random model; the "API" is the stand-in behind litellm.
The difficulty model is the project's default model (trained from router/data/ into tmp), so prompt
scores are real; thresholds are set from the measured scores and each precondition is asserted.
"""
from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import openai
import pytest

from gateway.testing.standin import run_standin
from router.model import DifficultyModel
from router.train import train_default_model
from tests.e2e.conftest import MASTER_KEY, ledger_rows, run_gateway
from tests.hosted.serving_helpers import EngineProcess, build_tiny_chat_model

CANDIDATES = [
    "hi",
    "What is the capital of France?",
    "Translate good morning to French",
    "Implement a lock-free concurrent queue in Rust with correct memory ordering and explain ABA.",
    "Find all integer solutions of x^2 - 7y^2 = 1 and prove there are infinitely many.",
    "Prove that there are infinitely many primes of the form 4k+3, and explain each step rigorously.",
]

POLICY = """
backends:
  local:
    kind: engine
    model: tiny
    api_base: {engine}/v1
    gpu_hour_usd: 2.0
  api:
    kind: litellm
    model: openai/gpt-4o-mini
    api_base: {standin}
    api_key_env: STANDIN_API_KEY
    input_usd_per_mtok: 0.15
    output_usd_per_mtok: 0.6
routes:
  assistant:
    strategy: difficulty
    easy: local
    hard: api
    threshold: {threshold}
    model_path: {model}
{extra}
  strict:
    strategy: difficulty
    easy: local
    hard: api
    threshold: {threshold}
    model_path: {model}
"""


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-chat-routing")
    build_tiny_chat_model(directory)
    return directory


@pytest.fixture(scope="module")
def scored(tmp_path_factory) -> tuple[Path, dict[str, float]]:
    path = tmp_path_factory.mktemp("router") / "default.npz"
    train_default_model(path)
    model = DifficultyModel.load(path)
    return path, {p: model.score(p) for p in CANDIDATES}


@pytest.fixture
def engine(tiny_model_dir):
    process = EngineProcess(tiny_model_dir, "--max-num-seqs", "1", "--served-model-name", "tiny")
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture
def api(monkeypatch):
    monkeypatch.setenv("STANDIN_API_KEY", "sk-standin")
    with run_standin() as base_url:
        yield base_url


def ask(gateway, route: str, prompt: str) -> str:
    client = openai.OpenAI(base_url=gateway.base_url, api_key=MASTER_KEY, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=route, messages=[{"role": "user", "content": prompt}], max_tokens=4)
    return raw.headers["x-switchyard-backend"]


def wait_for(predicate, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def occupy(base_url: str, n: int, max_tokens: int) -> list[socket.socket]:
    """n long streamed requests sent straight to the engine over raw sockets; closing a socket aborts it."""
    host, port = base_url.removeprefix("http://").split(":")
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "go"}], "stream": True,
                       "max_tokens": max_tokens, "ignore_eos": True}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    socks = []
    for _ in range(n):
        s = socket.create_connection((host, int(port)))
        s.sendall(head + body)
        socks.append(s)
    return socks


def route_rows(gateway) -> list[dict]:
    gateway.call(gateway.gw.services.ledger.flush)
    return ledger_rows(gateway.config.database_url)


def test_saturated_engine_spills_easy_work_to_the_api(engine, api, scored, tmp_path) -> None:
    model_path, scores = scored
    easy, hard = CANDIDATES[0], max(CANDIDATES, key=scores.get)
    threshold = round((scores[easy] + scores[hard]) / 2, 4)
    assert scores[easy] < threshold <= scores[hard]
    policy = POLICY.format(engine=engine.base_url, standin=api, threshold=threshold, model=model_path,
                           extra="    spillover: {max_waiting: 1}")
    with run_gateway(policy, tmp_path) as gateway:
        monitor = gateway.gw.routing.load
        monitor.interval_s = 0.1
        wait_for(lambda: monitor.get("local").known, what="the first scrape")
        assert ask(gateway, "assistant", easy) == "local"  # not saturated: easy work stays in-house
        assert ask(gateway, "assistant", hard) == "api"

        socks = occupy(engine.base_url, n=10, max_tokens=450)  # one runs (max-num-seqs 1), nine queue
        try:
            seen = wait_for(lambda: (lo := monitor.get("local")).known and lo.waiting > 1 and lo, what="a queue")
            assert seen.running <= 1  # max-num-seqs 1 (0 for an instant between two of them)
            assert ask(gateway, "assistant", easy) == "api"  # spilled instead of queueing behind them
        finally:
            for s in socks:
                s.close()  # the engine aborts them
        wait_for(lambda: (lo := monitor.get("local")).known and lo.waiting == 0 and lo.running == 0,
                 what="the queue to drain")
        assert ask(gateway, "assistant", easy) == "local"

        rows = route_rows(gateway)
        assert [(r["backend"], r["route_reason"]) for r in rows] == [
            ("local", "difficulty_easy"), ("api", "difficulty_hard"), ("api", "spillover"),
            ("local", "difficulty_easy")]
        assert all(r["threshold"] == pytest.approx(threshold) for r in rows)
        assert rows[2]["difficulty"] == pytest.approx(scores[easy]) and rows[2]["cost_basis"] == "api_price"


def test_idle_engine_relaxes_the_threshold_up_to_the_floor(engine, api, scored, tmp_path) -> None:
    model_path, scores = scored
    ranked = sorted(CANDIDATES, key=scores.get)
    easy, mid, hard = ranked[0], ranked[-2], ranked[-1]
    threshold = round((scores[easy] + scores[mid]) / 2, 4)  # mid is hard by score
    max_threshold = round((scores[mid] + scores[hard]) / 2, 4)  # but under the quality floor
    assert scores[easy] < threshold <= scores[mid] < max_threshold <= scores[hard]
    policy = POLICY.format(engine=engine.base_url, standin=api, threshold=threshold, model=model_path,
                           extra=f"    idle: {{below_utilisation: 0.5, max_threshold: {max_threshold}}}")
    with run_gateway(policy, tmp_path) as gateway:
        monitor = gateway.gw.routing.load
        monitor.interval_s = 0.1
        idle = wait_for(lambda: (lo := monitor.get("local")).known and lo, what="the first scrape")
        assert idle.busy < 0.5 / 4  # a fresh engine: relaxed (nearly) all the way to the floor
        assert ask(gateway, "assistant", mid) == "local"  # the idle engine takes the mid-difficulty request
        assert ask(gateway, "strict", mid) == "api"  # the same request without `idle:` goes to the API
        assert ask(gateway, "assistant", hard) == "api"  # above the quality floor: never relaxed away
        assert ask(gateway, "assistant", easy) == "local"

        rows = route_rows(gateway)
        assert [(r["route"], r["backend"], r["route_reason"]) for r in rows] == [
            ("assistant", "local", "idle_relaxed"), ("strict", "api", "difficulty_hard"),
            ("assistant", "api", "difficulty_hard"), ("assistant", "local", "difficulty_easy")]
        relaxed = rows[0]["threshold"]
        assert threshold < relaxed <= max_threshold and relaxed > scores[mid]
        assert rows[1]["threshold"] == pytest.approx(threshold)
