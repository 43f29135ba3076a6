"""Issue 31 finding 9 (deliverable 8): chargeback that is stable, and the device kind from the engine.

A real gateway (tests/e2e/conftest.run_gateway, SQLite ledger) in front of a small engine on 127.0.0.1 that
answers chat completions with the engine's `switchyard` usage extension and serves /metrics rendered by the
engine's own hosted/metrics.EngineMetrics (its device: the CPU). The policy prices the engine per GPU-hour, so
before the fix every row said `device_kind = gpu`, and the same 37-in/8-out request cost 18x more at a 5%
utilisation than at 90%, with nothing stable beside it. The same gateway run checks that each policy version it
loads (the first, and one hot-reloaded) is stored with its exact text.
"""
from __future__ import annotations

import argparse
import io
import os
import threading
import time
from datetime import UTC, datetime
from types import SimpleNamespace

import openai
import pytest
import sqlalchemy as sa
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway import db, pricing
from gateway.backends.base import Usage
from gateway.ledger.policy_versions import version_of
from gateway.ledger.record import LedgerRecord
from gateway.policy import parse_policy
from gateway.reports import workbook
from tests.e2e.conftest import MASTER_KEY, free_port, run_gateway

DEVICE_SECONDS = 0.35
HOUR_USD = 2.50

POLICY = """\
backends:
  local:
    kind: engine
    model: local
    api_base: http://127.0.0.1:{port}/v1
    gpu_hour_usd: 2.50
routes:
  chat:
    strategy: fixed
    backend: local
"""


class MiniEngine:
    """An engine's HTTP face: chat completions with the usage extension, and the engine's real /metrics."""

    def __init__(self) -> None:
        import torch

        from hosted.engine import EngineStats
        from hosted.metrics import EngineMetrics

        self.utilisation = 0.9
        self.busy = 0.0
        self.metrics = EngineMetrics()
        self._stats = EngineStats
        self._engine = SimpleNamespace(alive=True, num_waiting=0, engine=SimpleNamespace(device=torch.device("cpu")),
                                       utilisation=lambda: self.utilisation, stats=self.stats)

    def stats(self):
        return self._stats(num_running=0, num_waiting=0, kv_blocks_total=64, kv_blocks_free=64,
                           prefix_queries_tokens=0, prefix_hit_tokens=0, busy_seconds=self.busy, num_preemptions=0)

    async def chat(self, request: Request) -> Response:
        await request.json()
        self.busy += DEVICE_SECONDS
        return JSONResponse({
            "id": "chatcmpl-mini", "object": "chat.completion", "created": int(time.time()), "model": "local",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 37, "completion_tokens": 8, "total_tokens": 45},
            "switchyard": {"device_seconds": DEVICE_SECONDS, "utilisation": self.utilisation}})

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.render(self._engine), media_type=self.metrics.content_type)

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/chat/completions", self.chat, methods=["POST"]),
                                 Route("/metrics", self.prometheus)])


def _serve(app: Starlette, port: int) -> uvicorn.Server:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.time() + 20
    while not server.started:
        assert time.time() < deadline, "mini engine did not start"
        time.sleep(0.02)
    return server


def _rows(url: str, sql: str) -> list[dict]:
    engine = sa.create_engine(db.sync_url(url))
    try:
        with engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(sa.text(sql))]
    finally:
        engine.dispose()


def _wait(predicate, timeout: float = 15.0) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def test_busy_cost_is_the_same_whatever_the_utilisation():
    policy = parse_policy(POLICY.format(port=9), "inline")
    spec, route = policy.backends["local"], policy.routes["chat"]
    rows = []
    for utilisation in (0.9, 0.3, 0.03):
        record = LedgerRecord("r", created_at=datetime.now(UTC))
        pricing.charge(record, spec, Usage(37, 8), DEVICE_SECONDS, utilisation, policy, route)
        rows.append(record)
    list_rate = DEVICE_SECONDS * HOUR_USD / 3600
    assert [r.busy_cost_usd for r in rows] == [pytest.approx(list_rate)] * 3
    assert rows[2].cost_usd / rows[0].cost_usd == pytest.approx(0.9 / 0.05)  # amortised: moves with utilisation


def test_engine_rows_carry_a_stable_cost_and_the_engine_device_kind(tmp_path):
    mini = MiniEngine()
    port = free_port()
    server = _serve(mini.app(), port)
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    try:
        with run_gateway(POLICY.format(port=port), tmp_path, database_url=url) as gw:
            load = gw.gw.routing.load
            _wait(lambda: load.device_kind("local") == "cpu")  # scraped from the engine's /metrics
            client = openai.OpenAI(base_url=gw.base_url, api_key=MASTER_KEY, max_retries=0)
            for utilisation in (0.9, 0.03):
                mini.utilisation = utilisation
                client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}])
            gw.call(gw.gw.services.ledger.flush)
            # a hot reload stores the new version's text too
            first = (tmp_path / "policy.yaml").read_text()
            second = first.replace("routes:", "# reloaded\nroutes:")
            (tmp_path / "policy.yaml.tmp").write_text(second)
            os.replace(tmp_path / "policy.yaml.tmp", tmp_path / "policy.yaml")
            _wait(lambda: gw.gw.services.policy_store.current.version == version_of(second))
            gw.call(gw.gw.policy_versions.flush)
            versions = {r["version"]: r["text"] for r in _rows(url, "SELECT version, text FROM policy_versions")}
            assert versions == {version_of(first): first, version_of(second): second}
    finally:
        server.should_exit = True

    rows = _rows(url, "SELECT cost_usd, busy_cost_usd, device_kind, utilisation, gpu_seconds FROM cost_ledger "
                      "ORDER BY created_at")
    assert len(rows) == 2
    list_rate = DEVICE_SECONDS * HOUR_USD / 3600
    assert [r["busy_cost_usd"] for r in rows] == [pytest.approx(list_rate)] * 2  # the same request, the same cost
    assert rows[1]["cost_usd"] / rows[0]["cost_usd"] == pytest.approx(0.9 / 0.05)  # amortised moves 18x
    assert [r["device_kind"] for r in rows] == ["cpu", "cpu"]  # from the engine, not the policy's gpu_hour_usd
    uptime = _rows(url, "SELECT DISTINCT device_kind FROM engine_uptime")
    assert uptime == [{"device_kind": "cpu"}]

    out = io.StringIO()
    args = argparse.Namespace(since=None, until=None, team=None, database_url=url, policy=None,
                              out=str(tmp_path / "csv"), format="csv", bench=None, no_progress=True)
    assert workbook.run(args, out=out, err=io.StringIO()) == 0
    line = next(x for x in out.getvalue().splitlines() if x.startswith("chargeback local"))
    assert line.startswith(f"chargeback local (cpu): ${2 * list_rate:,.4f} at the list rate")
    assert f"${rows[0]['cost_usd'] + rows[1]['cost_usd']:,.4f} utilisation-amortised" in line
    assert "not charged at list rate (idle and unattributed work), shared out by device seconds" in line


def test_each_row_takes_the_device_kind_the_engine_answered_with_before_any_scrape(tmp_path, monkeypatch):
    """CI found the first rows of a freshly started engine priced as `gpu` (the policy's price field): the
    gateway only knew the device kind from a /metrics scrape that had not happened yet. The engine now says
    what served each request in its answer (plain and streamed); the stand-in here has no device in /metrics,
    so only the answer can tell."""
    from gateway.testing.standin import run_standin

    monkeypatch.setenv("STANDIN_API_KEY", "sk-standin")
    with run_standin(engine_extension=True, device_kind="cpu") as base_url:
        port = int(base_url.rsplit(":", 1)[1].split("/")[0])
        with run_gateway(POLICY.format(port=port), tmp_path) as gw:
            assert gw.gw.routing.load.device_kind("local") is None  # nothing scraped says cpu
            client = openai.OpenAI(base_url=gw.base_url, api_key=MASTER_KEY, max_retries=0)
            messages = [{"role": "user", "content": "hi"}]
            client.chat.completions.create(model="chat", messages=messages, max_tokens=3)
            list(client.chat.completions.create(model="chat", messages=messages, max_tokens=3, stream=True))
            client.completions.create(model="chat", prompt="hi", max_tokens=3)
            gw.call(gw.gw.services.ledger.flush)
            url = gw.config.database_url
    rows = _rows(url, "SELECT device_kind, device_hour_usd FROM cost_ledger ORDER BY created_at")
    assert rows == [{"device_kind": "cpu", "device_hour_usd": HOUR_USD}] * 3
