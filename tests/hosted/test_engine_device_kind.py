"""Issue 31 finding 9: the engine says what it runs on. A real `switchyard engine serve` (tiny random-weight Llama,
CPU) exposes `switchyard_engine_device_info{kind="cpu"}` on /metrics, and the gateway's load monitor reads that
kind from the same text (so its ledger rows say `cpu`, not the `gpu` that a policy's gpu_hour_usd implied)."""
from __future__ import annotations

import httpx
import pytest

from gateway.engine_load import reported_device_kind
from hosted.metrics import device_kind
from tests.hosted.serving_helpers import EngineProcess, build_tiny_chat_model, parse_metrics


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = EngineProcess(build_tiny_chat_model(tmp_path_factory.mktemp("devkind") / "tiny-llama"))
    yield proc
    assert proc.stop() == 0, proc.log


def test_metrics_name_the_device_kind(server):
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    assert parse_metrics(text)['switchyard_engine_device_info{device="cpu",kind="cpu"}'] == 1.0
    assert reported_device_kind(text) == "cpu"


def test_device_types_map_to_kinds():
    assert [device_kind(t) for t in ("cpu", "cuda", "xpu", "mps")] == ["cpu", "gpu", "gpu", "gpu"]
    assert reported_device_kind("switchyard_engine_ready 1.0\n") is None  # an engine that does not say
