"""Overload (429 + Retry-After), readiness (503 until loaded), load failures and clean shutdown."""
from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from hosted.async_llm_engine import AsyncLLMEngine, EngineOverloaded, collect
from hosted.engine import EngineConfig, LLMEngine
from hosted.sampling_params import SamplingParams
from hosted.server import ServerState, build_app
from hosted.tokenizer import Tokenizer
from tests.hosted.serving_helpers import EngineProcess, build_tiny_chat_model, free_port

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_chat_model(tmp_path_factory.mktemp("limits") / "tiny")


def test_overload_answers_429_with_retry_after_and_loses_nothing(model_dir):
    server = EngineProcess(model_dir, "--max-num-seqs", "1", "--max-waiting", "2")
    clean_exit = False
    try:
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=60)

        async def one(i: int):
            try:
                r = await client.completions.create(model="tiny", prompt=f"Request {i}", max_tokens=60,
                                                    temperature=0, extra_body={"ignore_eos": True})
                return r
            except openai.RateLimitError as exc:
                return exc

        async def burst():
            return await asyncio.gather(*(one(i) for i in range(6)))

        results = asyncio.run(burst())
        refused = [r for r in results if isinstance(r, openai.RateLimitError)]
        served = [r for r in results if not isinstance(r, Exception)]
        assert len(refused) + len(served) == 6
        assert refused, "no request was refused although only two may wait"
        assert served
        for exc in refused:
            assert exc.status_code == 429
            assert int(exc.response.headers["retry-after"]) >= 1
            assert exc.body["code"] == "engine_overloaded"
        for r in served:  # accepted work is completed in full
            assert r.usage.completion_tokens == 60 and r.choices[0].finish_reason == "length"
        m = server.metrics()
        assert m['switchyard_engine_requests_total{status="overloaded"}'] == len(refused)
        assert m["switchyard_engine_kv_blocks_free"] == m["switchyard_engine_kv_blocks_total"]
        # SIGINT (Ctrl-C) shuts down cleanly, like SIGTERM does for the main server fixture.
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(30) == 0
        clean_exit = True
    finally:
        server.stop()
    time.sleep(0.1)
    assert clean_exit and "switchyard engine stopped" in server.log


def test_unsupported_checkpoint_fails_at_start_naming_the_problem(tmp_path, model_dir):
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bad / name).write_bytes((model_dir / name).read_bytes())
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(config))
    proc = subprocess.run([sys.executable, "-m", "gateway.cli", "engine", "serve", "--model", str(bad),
                           "--port", str(free_port()), "--log-level", "warning"],
                          check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "GPT2LMHeadModel" in proc.stderr and "unsupported architecture" in proc.stderr


def test_health_is_503_until_the_model_is_loaded(model_dir):
    from starlette.testclient import TestClient

    release = threading.Event()

    def loader():
        release.wait(30)
        engine = AsyncLLMEngine(LLMEngine(EngineConfig(model_dir=str(model_dir), num_kv_blocks=64)))
        return engine, Tokenizer.from_dir(model_dir)

    state = ServerState(model_name="tiny")
    with TestClient(build_app(state, loader=loader)) as http:
        r = http.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi"})
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert r.json()["error"]["code"] == "model_not_ready"
        release.set()
        deadline = time.monotonic() + 30
        while http.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


async def test_async_engine_bounds_waiting_and_measures_busy_fraction(model_dir):
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model_dir=str(model_dir), num_kv_blocks=64, max_num_seqs=1)),
                         max_waiting=2)
    try:
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        # All four start in the same loop iteration, before the engine thread can report any admission:
        # two fill the waiting bound, two are refused.
        tasks = [asyncio.create_task(collect(engine.generate(f"r{i}", [1, 2, 3, i + 4], params)))
                 for i in range(4)]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        refused = [r for r in results if isinstance(r, EngineOverloaded)]
        finished = [r for r in results if isinstance(r, list)]
        assert len(refused) == 2 and len(finished) == 2
        assert refused[0].limit == 2 and refused[0].retry_after >= 1
        assert all(sum(len(o.new_token_ids) for o in r) == 40 and r[-1].finish_reason == "length" for r in finished)
        assert 0.0 < engine.utilisation() <= 1.0
        stats = engine.stats()
        assert stats.num_running == 0 and stats.kv_blocks_free == stats.kv_blocks_total
        with pytest.raises(ValueError, match="empty"):
            await collect(engine.generate("empty", [], params))
    finally:
        await engine.shutdown()


async def test_small_kv_pool_refuses_what_cannot_fit_and_preempts_the_rest(model_dir):
    """In-process app over a deliberately small KV pool (8 blocks x 16 tokens)."""
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model_dir=str(model_dir), num_kv_blocks=8, max_num_seqs=4)))
    state = ServerState(model_name="tiny", engine=engine, tokenizer=Tokenizer.from_dir(model_dir))
    transport = httpx.ASGITransport(app=build_app(state))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://engine", timeout=120) as http:
            r = await http.post("/v1/completions", json={"model": "tiny", "prompt": [5] * 100, "max_tokens": 50})
            assert r.status_code == 400
            assert r.json()["error"]["code"] == "context_length_exceeded" and "KV cache" in r.json()["error"]["message"]

            async def run(i: int) -> dict:
                body = {"model": "tiny", "prompt": [7 + i] * 40, "max_tokens": 40, "temperature": 0,
                        "ignore_eos": True}
                resp = await http.post("/v1/completions", json=body)
                assert resp.status_code == 200, resp.text
                return resp.json()

            solo = [await run(i) for i in range(3)]
            together = await asyncio.gather(*(run(i) for i in range(3)))  # 3 x 5 blocks > 8: preemption
            for a, b in zip(solo, together):
                assert b["usage"]["completion_tokens"] == 40
                assert a["choices"][0]["text"] == b["choices"][0]["text"]
            stats = engine.stats()
            assert stats.num_preemptions >= 1
            assert stats.kv_blocks_free == stats.kv_blocks_total and stats.num_running == 0
    finally:
        await engine.shutdown()
