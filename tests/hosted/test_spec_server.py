"""Speculative decoding behind the engine's OpenAI server (in process, demo model): the same text as without it
(stop strings included, even when one lands inside a step's accepted drafts), per-request acceptance in the
usage extension and global totals in /metrics."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from hosted.async_llm_engine import AsyncLLMEngine
from hosted.engine import EngineConfig, LLMEngine
from hosted.models import DEMO_MODEL_DIR
from hosted.server import ServerState, build_app
from hosted.tokenizer import Tokenizer
from tests.hosted.serving_helpers import parse_metrics

PROMPT = ("Copy this code exactly:\ndef parse_args(argv):\n    parser = argparse.ArgumentParser()\n"
          "    parser.add_argument('--name')\n    return parser.parse_args(argv)\n\nCopy:\ndef parse_args(argv):\n")


def _app(**spec) -> tuple[AsyncLLMEngine, httpx.AsyncClient]:
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model_dir=DEMO_MODEL_DIR, num_kv_blocks=64, **spec)))
    state = ServerState(model_name="demo", engine=engine, tokenizer=Tokenizer.from_dir(DEMO_MODEL_DIR))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(state)), base_url="http://engine",
                               timeout=120)
    return engine, client


async def test_same_text_with_acceptance_in_usage_andparse_metrics():
    plain_engine, plain = _app()
    spec_engine, spec = _app(speculative="ngram", spec_adaptive=False)
    try:
        body = {"model": "demo", "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        want = (await plain.post("/v1/completions", json=body)).json()
        got = (await spec.post("/v1/completions", json=body)).json()
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        assert got["usage"] == want["usage"]
        ext = got["switchyard"]
        assert ext["spec_proposed"] > 0 and 0 < ext["spec_accepted"] <= ext["spec_proposed"]
        assert "spec_proposed" not in want["switchyard"]  # no speculation, no fields

        text = want["choices"][0]["text"]
        stop = text[len(text) // 2:len(text) // 2 + 4]  # a stop string in the middle of the output
        body_stop = {**body, "stop": [stop], "logprobs": 1}
        want = (await plain.post("/v1/completions", json=body_stop)).json()
        got = (await spec.post("/v1/completions", json=body_stop)).json()
        assert want["choices"][0]["finish_reason"] == got["choices"][0]["finish_reason"] == "stop"
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
        assert got["choices"][0]["logprobs"]["tokens"] == want["choices"][0]["logprobs"]["tokens"]

        m = parse_metrics((await spec.get("/metrics")).text)
        proposed = m["switchyard_engine_spec_proposed_tokens_total"]
        accepted = m["switchyard_engine_spec_accepted_tokens_total"]
        assert proposed >= ext["spec_proposed"] and 0 < accepted <= proposed
        assert m["switchyard_engine_spec_acceptance_rate"] == pytest.approx(accepted / proposed)
        assert parse_metrics((await plain.get("/metrics")).text)["switchyard_engine_spec_proposed_tokens_total"] == 0
        for _ in range(200):  # the stop string aborted the request; the engine thread frees it next
            stats = spec_engine.stats()
            if stats.num_running == 0:
                break
            await asyncio.sleep(0.01)
        assert stats.num_running == 0 and stats.kv_blocks_free == stats.kv_blocks_total
    finally:
        await plain.aclose()
        await spec.aclose()
        await plain_engine.shutdown()
        await spec_engine.shutdown()
