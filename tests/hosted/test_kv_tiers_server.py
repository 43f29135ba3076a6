"""KV tiering through `switchyard engine serve --kv-host-gb … --kv-disk-dir …` (a real subprocess) and the official
openai SDK: a returning conversation whose prefix left the device pool is restored, its usage says from where
(cached_tokens includes restored tokens, so the gateway prices them as cached), its answer is the one a fresh engine
gives, and /metrics counts the tier's traffic."""
from __future__ import annotations

import pytest

from tests.hosted.serving_helpers import EngineProcess, build_tiny_chat_model

openai = pytest.importorskip("openai")

MODEL = "tiny-llama"
SYSTEM = ("The engine streamed tokens while the server listened and answered every question. " * 2).strip()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_chat_model(tmp_path_factory.mktemp("kvtier") / MODEL)


def _chat(client, system: str, user: str):
    return client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                          messages=[{"role": "system", "content": system},
                                                    {"role": "user", "content": user}])


def _run(model_dir, *flags):
    """The returning turn's reply after three other conversations filled the pool; and the server's metrics."""
    server = EngineProcess(model_dir, "--num-kv-blocks", "12", "--block-size", "16", "--max-num-seqs", "1", *flags)
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        _chat(client, SYSTEM, "First question.")
        for i in range(3):
            _chat(client, f"Conversation {i}: " + SYSTEM[::-1], f"Other {i}.")
        reply = _chat(client, SYSTEM, "First question.")
        return reply, server.metrics()
    finally:
        assert server.stop() == 0, server.log


def test_serve_restores_from_host_and_reports_it(model_dir, tmp_path):
    plain, _ = _run(model_dir)
    reply, metrics = _run(model_dir, "--kv-host-gb", "0.01", "--kv-disk-dir", str(tmp_path / "kv"),
                          "--kv-restore", "always")
    assert reply.choices[0].message.content == plain.choices[0].message.content
    split = reply.usage.model_extra["switchyard_prompt_tokens"]
    assert split["restored_host"] >= 32 and split["restored_disk"] == 0
    assert reply.usage.prompt_tokens_details.cached_tokens == split["restored_host"] + split["device_cache"]
    assert split["computed"] + reply.usage.prompt_tokens_details.cached_tokens == reply.usage.prompt_tokens
    assert plain.usage.model_extra["switchyard_prompt_tokens"]["restored_host"] == 0
    assert metrics['switchyard_engine_kv_tier_restored_blocks_total{tier="host"}'] == split["restored_host"] // 16
    assert metrics['switchyard_engine_kv_tier_bytes_total{direction="in",tier="host"}'] > 0
    assert metrics["switchyard_engine_kv_disk_tier_enabled"] == 1


def test_policy_engine_args_take_the_tier_keys():
    """A policy's engine_args reach `engine serve` as the same flags (gateway/engine_args.py reads our parser)."""
    from gateway.engine_args import argv, check

    args = {"kv_host_gb": 8, "kv_disk_dir": "/var/cache/kv", "kv_disk_gb": 64, "kv_disk_persist": True,
            "kv_restore": "auto"}
    assert check(args) == []
    assert argv(args) == ["--kv-host-gb", "8", "--kv-disk-dir", "/var/cache/kv", "--kv-disk-gb", "64",
                          "--kv-disk-persist", "--kv-restore", "auto"]
    assert [p.key for p in check({"kv_host_gb": "lots", "kv_restore": "sometimes"})] == ["kv_host_gb", "kv_restore"]
