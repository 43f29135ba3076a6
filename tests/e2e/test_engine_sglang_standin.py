"""`engine_type: sglang` behind the real gateway, priced from the engine's Prometheus busy counter.

SGLang cannot be installed and served on these CPU-only machines (its wheels need CUDA), so the engine is a
stand-in speaking SGLang's wire format and metrics (tests/e2e/sglang_standin.py); its busy counter is the truth
the ledger's device-seconds must add up to. The real-engine check of the same path is test_engine_vllm.py."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from gateway.keys import create_key
from tests.e2e.conftest import MASTER_KEY, free_port, ledger_rows, run_gateway
from tests.e2e.sglang_standin import run_sglang_standin

HOUR_USD = 3.6
POLICY = """
backends:
  sgl:
    kind: engine
    engine_type: sglang
    model: stand-in
    api_base: {base}
    cpu_hour_usd: {hour}
routes:
  local: {{backend: sgl}}
"""
LENGTHS = (40, 10, 25, 5, 30, 15)  # output tokens of the concurrent requests


def settled_rows(url: str, expected: int, timeout: float = 30) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        rows = ledger_rows(url)
        if len(rows) >= expected or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


def test_sglang_rows_are_priced_from_its_busy_counter_and_add_up_to_it(tmp_path):
    port = free_port()
    with run_sglang_standin(port) as engine, \
            run_gateway(POLICY.format(base=f"http://127.0.0.1:{port}/v1", hour=HOUR_USD), tmp_path) as gw:
        client = openai.OpenAI(base_url=gw.base_url, api_key=MASTER_KEY, max_retries=0)

        def ask(n: int, stream: bool = False) -> str | None:
            messages = [{"role": "user", "content": f"count to {n} please"}]
            if stream:
                chunks = client.chat.completions.create(model="local", messages=messages, max_tokens=n, stream=True,
                                                        stream_options={"include_usage": True})
                return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            raw = client.chat.completions.with_raw_response.create(model="local", messages=messages, max_tokens=n)
            return raw.headers["x-switchyard-cost-usd"]

        time.sleep(1.0)  # a first scrape: the engine's counters before our requests
        first_cost = ask(20)
        ask(20, stream=True)
        with ThreadPoolExecutor(len(LENGTHS)) as pool:
            list(pool.map(lambda n: ask(n, stream=n % 2 == 0), LENGTHS))
        later_cost = ask(20)
        chunks = list(client.chat.completions.create(model="local", messages=[{"role": "user", "content": "more"}],
                                                     max_tokens=12, stream=True, stream_options={"include_usage": True}))
        streamed_cost = chunks[-1].usage.model_extra["cost_usd"]  # the gateway's extra field in the usage chunk
        expected = 4 + len(LENGTHS)
        rows = settled_rows(gw.config.database_url, expected)
        busy = engine.busy_s
        exported = _gauge(httpx.get(gw.root + "/metrics").text, 'switchyard_engine_attributed_seconds{backend="sgl"}')
    assert len(rows) == expected
    # the first answer could not be priced yet (no rate learned); later answers carry the learned estimate
    assert float(first_cost) == 0 and float(later_cost) > 0 and streamed_cost > 0
    for row in rows:
        assert row["backend"] == "sgl" and row["status"] == "ok"
        # settled with its attributed device time, not an estimate (an idle engine's busy fraction may be floored)
        assert row["cost_note"] in (None, "utilisation_floor"), row
        assert row["gpu_seconds"] > 0
        util = max(row["utilisation"], 0.05)
        assert row["busy_cost_usd"] == pytest.approx(row["gpu_seconds"] * HOUR_USD / 3600)
        assert row["cost_usd"] == pytest.approx(row["gpu_seconds"] * HOUR_USD / 3600 / util)
        assert row["device_kind"] == "cpu" and row["device_hour_usd"] == HOUR_USD
    attributed = sum(row["gpu_seconds"] for row in rows)
    assert attributed == pytest.approx(busy, rel=0.10), (attributed, busy)
    assert exported == pytest.approx(attributed)  # what the gateway exports for operators to watch
    uptime = ledger_rows_uptime(gw.config.database_url)
    assert sum(r["busy_seconds"] for r in uptime) == pytest.approx(busy, rel=0.10)
    assert sum(r["seconds"] for r in uptime) >= sum(r["busy_seconds"] for r in uptime)


def test_a_keys_budget_settles_to_the_attributed_cost_not_the_answers_estimate(tmp_path):
    port = free_port()
    with run_sglang_standin(port), \
            run_gateway(POLICY.format(base=f"http://127.0.0.1:{port}/v1", hour=HOUR_USD), tmp_path) as gw:
        key, info = gw.call(lambda: create_key(gw.gw.db_engine, "team-s", budget_usd=1.0))
        client = openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=0)
        time.sleep(1.0)  # a first scrape
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda n: client.chat.completions.create(
                model="local", messages=[{"role": "user", "content": "go"}], max_tokens=n), (30, 5, 20, 10)))
        client.chat.completions.create(model="local", messages=[{"role": "user", "content": "go"}], max_tokens=15)
        rows = settled_rows(gw.config.database_url, 5)

        async def book() -> tuple[float | None, float | None]:
            return gw.gw.services.budgets.spent(info.id), gw.gw.services.budgets.reserved(info.id)

        spent, reserved = gw.call(book)
    assert len(rows) == 5 and all(r["cost_note"] in (None, "utilisation_floor") for r in rows)
    # the book holds what the ledger holds: each row's cost after its attribution, nothing left reserved
    assert reserved == 0
    assert spent == pytest.approx(sum(r["cost_usd"] for r in rows)) and spent > 0


def test_rows_are_written_with_the_estimate_when_the_engines_metrics_never_answer(tmp_path):
    # SGLang started without --enable-metrics: no scrape ever succeeds; the rows wait 10 s for one, then are written
    # with what is known (never lost)
    port = free_port()
    with run_sglang_standin(port, metrics=False), \
            run_gateway(POLICY.format(base=f"http://127.0.0.1:{port}/v1", hour=HOUR_USD), tmp_path) as gw:
        client = openai.OpenAI(base_url=gw.base_url, api_key=MASTER_KEY, max_retries=0)
        for n in (5, 8):
            client.chat.completions.create(model="local", messages=[{"role": "user", "content": "hi"}], max_tokens=n)
        rows = settled_rows(gw.config.database_url, 2, timeout=60)
    assert [(r["status"], r["completion_tokens"]) for r in rows] == [("ok", 5), ("ok", 8)]
    # no engine figure and no learned rate yet: $0, and the row says why
    assert all(r["gpu_seconds"] is None and r["cost_usd"] == 0 and r["cost_note"] == "no_device_seconds" for r in rows)


def _gauge(text: str, sample: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(sample + " "))
    return float(line.split()[-1])


def ledger_rows_uptime(url: str) -> list[dict]:
    import sqlalchemy as sa

    from gateway import db

    engine = sa.create_engine(db.sync_url(url))
    try:
        with engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(sa.text("SELECT * FROM engine_uptime WHERE backend='sgl'"))]
    finally:
        engine.dispose()
