"""Issue 36 deliverable 1: where a request's time goes, per stage, from the running gateway.

With SWITCHYARD_STAGE_PROFILE on, a real gateway (uvicorn on 127.0.0.1, SQLite ledger) in front of the
stand-in engine answers openai SDK requests, and GET /admin/stage-profile gives each stage of each request
on its route, in order, for the master key only; off (the default), the endpoint does not exist. The
benchmark's docs table is written from its JSON between markers, never by hand.
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import openai

from gateway import db, keys, stage_profile
from tests.e2e.conftest import MASTER_KEY, run_gateway
from tests.e2e.policy_builder import one_engine_route

ROOT = Path(__file__).resolve().parents[2]
PLAIN_STAGES = ["edge", "auth", "body", "route", "reserve", "admit", "send", "upstream", "dispatch", "finish",
                "respond", "overhead"]


def _profile(gateway, key: str = MASTER_KEY, reset: bool = False) -> httpx.Response:
    return httpx.get(f"{gateway.root}/admin/stage-profile", params={"reset": "1" if reset else "0"},
                     headers={"Authorization": f"Bearer {key}"}, timeout=10)


def test_each_request_stage_is_timed_per_route(standin, tmp_path, monkeypatch):
    monkeypatch.setattr(stage_profile, "ENABLED", True)
    stage_profile.STORE.reset()
    with run_gateway(one_engine_route(standin), tmp_path) as gateway:
        client = openai.OpenAI(base_url=gateway.base_url, api_key=MASTER_KEY, max_retries=0)
        for i in range(5):
            client.chat.completions.create(model="local", messages=[{"role": "user", "content": f"hi {i}"}],
                                           max_tokens=3)
        with_bad_key = openai.OpenAI(base_url=gateway.base_url, api_key="sk-nope", max_retries=0)
        try:
            with_bad_key.chat.completions.create(model="local", messages=[{"role": "user", "content": "x"}])
        except openai.AuthenticationError:
            pass

        summary = _profile(gateway, reset=True).json()
        local = summary["local"]
        assert local["requests"] == 5
        assert list(local["stages_us"]) == PLAIN_STAGES  # every stage, in the order the request met them
        assert all(s["count"] == 5 and 0 <= s["p50"] <= s["p99"] for s in local["stages_us"].values())
        stages = local["stages_us"]
        # overhead is every stage but the upstream exchange (per request, so its mean is the sum of the means)
        own = sum(v["mean"] for k, v in stages.items() if k not in ("upstream", "overhead"))
        assert abs(stages["overhead"]["mean"] - own) < 1e-6
        assert summary["none"]["requests"] == 1  # the refused key's request: edge only, no route
        assert _profile(gateway).json() == {}  # reset after reading

        async def make_key() -> str:
            engine = db.create_engine(gateway.config.database_url)
            try:
                return (await keys.create_key(engine, "apps"))[0]
            finally:
                await engine.dispose()

        plain_key = asyncio.run(make_key())
        assert _profile(gateway, key=plain_key).status_code == 403


def test_the_profile_endpoint_does_not_exist_unless_switched_on(standin, tmp_path, monkeypatch):
    monkeypatch.setattr(stage_profile, "ENABLED", False)
    with run_gateway(one_engine_route(standin), tmp_path) as gateway:
        assert _profile(gateway).status_code == 404


def _bench_module():
    from bench import gateway_overhead

    return gateway_overhead


def test_the_docs_table_and_the_drift_come_from_the_json(tmp_path):
    bench = _bench_module()
    stages = {s: {"count": 3, "mean": 10.0, "p50": 10.0, "p90": 11.0, "p99": 12.0} for s in PLAIN_STAGES}
    run = {"machine": {"cpus": 2, "cpu_model": "Test CPU 9000"}, "finished_at": "2026-12-03 16:00 UTC",
           "settings": {"latency_requests": 100, "concurrency": [8], "ledger": "sqlite, on"},
           "results": {"upstream direct": {"p50_ms": 0.1, "p99_ms": 0.2, "overhead_p50_ms": 0.0,
                                           "overhead_p99_ms": 0.0, "peak_rps": 9000.0},
                       "gateway, engine backend": {"p50_ms": 0.4, "p99_ms": 1.0, "overhead_p50_ms": 0.3,
                                                   "overhead_p99_ms": 0.8, "peak_rps": 3000.0,
                                                   "stages_us": stages}}}
    docs = tmp_path / "benchmarks.md"
    docs.write_text(f"# Benchmarks\n\nbefore\n\n{bench.BEGIN}\nstale typed table\n{bench.END}\n\nafter\n")
    assert bench.render_docs(run, docs)
    text = docs.read_text()
    assert "stale typed table" not in text and text.startswith("# Benchmarks\n\nbefore") and text.endswith("after\n")
    assert "| gateway, engine backend | 0.40 | 1.00 | 0.30 | 0.80 | 3000 | n/a |" in text
    assert "Test CPU 9000 (2 CPUs)" in text and "| upstream | 10 |" in text

    later = json.loads(json.dumps(run))
    later["results"]["gateway, engine backend"].update(overhead_p50_ms=0.5, peak_rps=1500.0)
    moved = "\n".join(bench.drift(run, later))
    assert "0.30 → 0.50 (+0.20)" in moved and "3000 → 1500 (-50%)" in moved
    elsewhere = json.loads(json.dumps(later))
    elsewhere["machine"]["cpu_model"] = "Another CPU"
    assert bench.drift(run, elsewhere) == []  # another machine: no comparison
