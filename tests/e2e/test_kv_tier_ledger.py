"""Issue 34 (visibility and price): a gateway in front of a real `switchyard engine serve` with KV tiers. A
returning conversation whose prefix left the device pool is restored from host memory; its ledger row records the
restored tokens (kv_restored_host_tokens), counts them in cached_prompt_tokens and prices them at the cached rate
in the counterfactual API cost. Streamed and plain requests both carry the split."""
from __future__ import annotations

import openai
import pytest

from tests.e2e.conftest import MASTER_KEY, ledger_rows, run_gateway
from tests.hosted.serving_helpers import EngineProcess, build_tiny_chat_model

MODEL = "tiny-llama"
SYSTEM = ("The engine streamed tokens while the server listened and answered every question. " * 2).strip()
POLICY = """
backends:
  eng:
    kind: engine
    model: {model}
    api_base: {engine}/v1
    gpu_hour_usd: 3.6
  api:
    kind: litellm
    model: openai/gpt-4o-mini
    api_base: http://127.0.0.1:9/v1
    api_key_env: STANDIN_API_KEY
    input_usd_per_mtok: 10
    cached_input_usd_per_mtok: 1
    output_usd_per_mtok: 20
routes:
  local:
    strategy: fixed
    backend: eng
    counterfactual: api
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_chat_model(tmp_path_factory.mktemp("kvtier-ledger") / MODEL)


def _chat(client, system: str, user: str, stream: bool) -> None:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    if stream:
        for _ in client.chat.completions.create(model="local", max_tokens=4, temperature=0, messages=messages,
                                                stream=True):
            pass
    else:
        client.chat.completions.create(model="local", max_tokens=4, temperature=0, messages=messages)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_restored_tokens_reach_the_ledger_priced_as_cached(model_dir, tmp_path, monkeypatch, stream):
    monkeypatch.setenv("STANDIN_API_KEY", "sk-unused")
    server = EngineProcess(model_dir, "--num-kv-blocks", "12", "--block-size", "16", "--max-num-seqs", "1",
                           "--kv-host-gb", "0.01", "--kv-restore", "always")
    try:
        with run_gateway(POLICY.format(model=MODEL, engine=server.base_url), tmp_path) as gw:
            client = openai.OpenAI(base_url=gw.base_url, api_key=MASTER_KEY, max_retries=0, timeout=60)
            _chat(client, SYSTEM, "First question.", stream)
            for i in range(3):  # other conversations push the first one's blocks out of the device pool
                _chat(client, f"Conversation {i}: " + SYSTEM[::-1], f"Other {i}.", stream)
            _chat(client, SYSTEM, "First question.", stream)
            gw.call(gw.gw.services.ledger.flush)
            rows = ledger_rows(gw.config.database_url)
    finally:
        assert server.stop() == 0, server.log
    assert [r["status"] for r in rows] == ["ok"] * 5
    first, back = rows[0], rows[-1]
    assert first["kv_restored_host_tokens"] == 0 and first["kv_restored_disk_tokens"] == 0
    assert back["kv_restored_host_tokens"] >= 32 and back["kv_restored_host_tokens"] % 16 == 0
    assert back["kv_restored_disk_tokens"] == 0
    assert back["cached_prompt_tokens"] >= back["kv_restored_host_tokens"]
    uncached = back["prompt_tokens"] - back["cached_prompt_tokens"]
    expected = (uncached * 10 + back["cached_prompt_tokens"] * 1 + back["completion_tokens"] * 20) / 1e6
    assert back["counterfactual_cost_usd"] == pytest.approx(expected)
    assert back["counterfactual_cost_usd"] < first["counterfactual_cost_usd"]  # same prompt, mostly cached


def test_usage_from_dict_reads_the_tier_split():
    from gateway.backends.base import usage_from_dict

    usage = usage_from_dict({"prompt_tokens": 40, "completion_tokens": 2, "prompt_tokens_details": {
        "cached_tokens": 32}, "switchyard_prompt_tokens": {"computed": 8, "device_cache": 0, "restored_host": 16,
                                                           "restored_disk": 16}})
    assert (usage.cached_prompt_tokens, usage.restored_host_tokens, usage.restored_disk_tokens) == (32, 16, 16)
    plain = usage_from_dict({"prompt_tokens": 4, "completion_tokens": 1})
    assert (plain.restored_host_tokens, plain.restored_disk_tokens) == (None, None)
    odd = usage_from_dict({"prompt_tokens": 4, "switchyard_prompt_tokens": {"restored_host": "x",
                                                                            "restored_disk": -3}})
    assert (odd.restored_host_tokens, odd.restored_disk_tokens) == (None, None)
