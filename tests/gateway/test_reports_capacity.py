"""`switchyard report capacity` and `switchyard report ladder`: numbers worked by hand.

Capacity: a hand-written curve file, Little's Law and device counts computed by hand, TTFT filtering, the
roofline floor (the 70B / H100 example), and `--from-ledger` against a real migrated database whose busiest
hour is known. Ladder: $/Mtok and speed-ups of a synthetic stack by hand, and a run over the real benchmark.
"""
from __future__ import annotations

import argparse
import io
import json
import math
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import Boolean, DateTime, Float, Integer, String, column, create_engine, insert, table

from bench import store
from gateway.db import sync_url, upgrade
from gateway.reports import capacity, ladder, roofline

ROOT = Path(__file__).resolve().parents[2]
# The cheaper benchmark's results record (bench/results/cheaper/<machine>.json) and its newest full run.
REAL_BENCH = store.path("cheaper", store.newest("cheaper", label="")[0])
REAL_RUN = store.newest("cheaper", label="")[1]["result"]

POLICY = """\
backends:
  api:
    kind: litellm
    model: openai/gpt-4o-mini
    input_usd_per_mtok: 0.15
    output_usd_per_mtok: 0.6
  eng:
    kind: engine
    model: m
    api_base: http://127.0.0.1:9
    gpu_hour_usd: 2.0
    gpus: 2
  cpu:
    kind: engine
    model: m
    api_base: http://127.0.0.1:9
    cpu_hour_usd: 0.5
routes:
  m:
    strategy: fixed
    backend: eng
"""

# 100 output tokens per request; W and TTFT as measured.
CURVE = {"meta": {"output_tokens": 100, "prompt_tokens": 128},
         "points": [{"concurrency": 1, "output_tok_s": 50.0, "ttft_p50_ms": 80, "ttft_p95_ms": 100,
                     "mean_seconds_in_system": 2.0},
                    {"concurrency": 16, "output_tok_s": 400.0, "ttft_p50_ms": 900, "ttft_p95_ms": 1200,
                     "mean_seconds_in_system": 4.0},
                    {"concurrency": 4, "output_tok_s": 160.0, "ttft_p50_ms": 250, "ttft_p95_ms": 300,
                     "mean_seconds_in_system": 2.5}]}


@pytest.fixture
def policy_file(tmp_path) -> Path:
    p = tmp_path / "policy.yaml"
    p.write_text(POLICY)
    return p


@pytest.fixture
def curve_file(tmp_path) -> Path:
    p = tmp_path / "curve.json"
    p.write_text(json.dumps(CURVE))
    return p


def cap_args(**kw) -> argparse.Namespace:
    base = {"target_tokens_per_s": None, "from_ledger": False, "p95_ttft_ms": None, "target_utilisation": 0.6,
            "curve": None, "database_url": None, "since": None, "until": None, "backend": None, "policy": None,
            "json": False}
    base.update(kw)
    return argparse.Namespace(**base)


def run_cap(**kw) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = capacity.run(cap_args(**kw), out=out, err=err)
    return rc, out.getvalue(), err.getvalue()


# ------------------------------------------------------------------------------------------ Little's Law


def test_plan_by_hand_largest_concurrency_without_ttft_target(curve_file):
    curve = capacity.load_curve(curve_file)
    assert [p.concurrency for p in curve.points] == [1, 4, 16]
    plan = capacity.plan_capacity(curve, 1000.0, target_utilisation=0.5)
    assert plan.point.concurrency == 16
    # devices = ceil(1000 / (400 × 0.5)) = 5; rate = 1000 / 100 = 10 req/s; L = 10 × 4.0 = 40 sequences.
    assert plan.devices == 5
    assert plan.request_rate_per_s == pytest.approx(10.0)
    assert plan.seconds_in_system == pytest.approx(4.0)
    assert plan.sequences_in_flight == pytest.approx(40.0)
    assert plan.sequences_per_device == pytest.approx(8.0)
    assert plan.achieved_utilisation == pytest.approx(0.5)


def test_ttft_target_picks_largest_concurrency_that_meets_it(curve_file):
    curve = capacity.load_curve(curve_file)
    assert capacity.choose_point(curve.points, 500).concurrency == 4
    assert capacity.choose_point(curve.points, 300).concurrency == 4  # the bound is inclusive
    assert capacity.choose_point(curve.points, 299).concurrency == 1
    assert capacity.choose_point(curve.points, 5000).concurrency == 16
    plan = capacity.plan_capacity(curve, 1000.0, 0.5, p95_ttft_ms=500)
    # ceil(1000 / (160 × 0.5)) = ceil(12.5) = 13 devices; L = 10 req/s × 2.5 s = 25.
    assert plan.devices == 13
    assert plan.sequences_in_flight == pytest.approx(25.0)


def test_impossible_ttft_is_a_clear_error(curve_file):
    curve = capacity.load_curve(curve_file)
    with pytest.raises(capacity.CapacityError, match=r"best measured is 100 ms at concurrency 1"):
        capacity.choose_point(curve.points, 50)
    rc, out, err = run_cap(target_tokens_per_s=1000, p95_ttft_ms=50, curve=str(curve_file))
    assert rc == 1 and out == ""
    assert "no curve point meets TTFT p95 <= 50 ms" in err


def test_curve_without_ttft_cannot_meet_a_ttft_target():
    curve = capacity.parse_curve(REAL_RUN, "cheaper_model.json")
    assert [p.concurrency for p in curve.points] == [1, 8, 32]
    assert all(p.ttft_p95_ms is None and p.time_derived for p in curve.points)
    with pytest.raises(capacity.CapacityError, match="no TTFT measurements"):
        capacity.choose_point(curve.points, 1000)


def test_spec_rows_become_a_curve_with_littles_law_time(tmp_path):
    data = {"meta": {"prompt_tokens": 64},
            "spec": {"tokens": 64, "rows": [
                {"batch": 1, "config": "plain", "decode_tok_s": 60.0},
                {"batch": 1, "config": "plain", "decode_tok_s": 40.0},
                {"batch": 1, "config": "ngram adaptive", "decode_tok_s": 999.0},
                {"batch": 8, "config": "plain", "decode_tok_s": 320.0}]}}
    curve = capacity.parse_curve(data, "x")
    assert [(p.concurrency, p.output_tok_s) for p in curve.points] == [(1, 50.0), (8, 320.0)]
    # W = c × tokens / tok_s: 1 × 64 / 50 and 8 × 64 / 320.
    assert curve.points[0].mean_seconds_in_system == pytest.approx(1.28)
    assert curve.points[1].mean_seconds_in_system == pytest.approx(1.6)


def test_points_without_time_in_system_derive_it_from_littles_law():
    data = {"meta": {"output_tokens": 64}, "points": [{"concurrency": 8, "output_tok_s": 256.0, "ttft_p95_ms": 90}]}
    (point,) = capacity.parse_curve(data, "x").points
    assert point.time_derived and point.mean_seconds_in_system == pytest.approx(8 * 64 / 256.0)
    with pytest.raises(capacity.CapacityError, match="mean_seconds_in_system"):
        capacity.parse_curve({"points": [{"concurrency": 8, "output_tok_s": 256.0}]}, "x")


def test_run_prints_plan_and_monthly_cost(curve_file, policy_file):
    rc, out, err = run_cap(target_tokens_per_s=1000, target_utilisation=0.5, curve=str(curve_file),
                           policy=str(policy_file))
    assert rc == 0, err
    assert "devices needed            5" in out
    # first engine backend 'eng': 2 GPUs × $2/h = $4/h; 5 × 4 × 730 = 14,600.
    assert "$14,600.00" in out
    assert "sequences in flight (L)   40.00 total, 8.00 per device" in out
    assert "| 16 | 400.0 | 900 | 1,200 | 4.00 | chosen |" in out
    assert "a month = 730 h" in out and str(curve_file) in out
    assert "Decode roofline floor" in out and "H100 SXM" in out


def test_run_json_and_cpu_priced_backend(curve_file, policy_file):
    rc, out, err = run_cap(target_tokens_per_s=1000, target_utilisation=0.5, curve=str(curve_file),
                           policy=str(policy_file), backend="cpu", json=True, p95_ttft_ms=500)
    assert rc == 0, err
    body = json.loads(out)
    assert body["devices"] == 13
    assert body["operating_point"]["concurrency"] == 4
    assert body["device_hour_usd"] == 0.5 and body["device_backend"] == "cpu"
    assert body["monthly_usd"] == pytest.approx(13 * 0.5 * 730)
    assert body["sequences_in_flight"] == pytest.approx(25.0)
    assert body["assumptions"]


def test_bad_inputs_exit_1_with_message(curve_file, policy_file, tmp_path):
    rc, _, err = run_cap(target_tokens_per_s=0, curve=str(curve_file), policy=str(policy_file))
    assert rc == 1 and "positive" in err
    rc, _, err = run_cap(target_tokens_per_s=10, target_utilisation=0, curve=str(curve_file),
                         policy=str(policy_file))
    assert rc == 1 and "utilisation" in err
    rc, _, err = run_cap(target_tokens_per_s=10, curve=str(tmp_path / "missing.json"), policy=str(policy_file))
    assert rc == 1 and "no throughput curve" in err
    rc, _, err = run_cap(target_tokens_per_s=10, curve=str(curve_file), policy=str(policy_file), backend="api")
    assert rc == 1 and "not an engine" in err


def test_default_curve_files_give_a_plan(policy_file):
    # Without --curve: engine_curve.json when present, else the other benchmark files.
    rc, out, err = run_cap(target_tokens_per_s=5000, policy=str(policy_file))
    assert rc == 0, err
    assert "devices needed" in out and "chosen" in out


# ------------------------------------------------------------------------------------------ roofline


def test_roofline_70b_fp16_on_h100_is_about_42_ms():
    ms = roofline.decode_floor_ms(70e9, roofline.bytes_per_param("fp16"), roofline.ACCELERATORS["H100 SXM"])
    # 70e9 × 2 B = 140 GB per token; 140e9 / 3.35e12 s = 41.8 ms.
    assert ms == pytest.approx(140e9 / 3.35e12 * 1000)
    assert 41 < ms < 43


def test_bytes_per_precision_and_kv():
    assert roofline.bytes_per_param("fp32") == 4.0
    assert roofline.bytes_per_param("bf16") == 2.0
    assert roofline.bytes_per_param("FP16") == 2.0
    assert roofline.bytes_per_param("int8") == pytest.approx(1 + 2 / 32) == pytest.approx(1.0625)
    assert roofline.bytes_per_param("int4") == pytest.approx(0.5 + 2 / 32) == pytest.approx(0.5625)
    with pytest.raises(roofline.RooflineError):
        roofline.bytes_per_param("fp8")
    # KV: 2 × 30 layers × 3 kv heads × 64 dims = 11,520 values per position; 1,000 positions in fp16.
    kv_values = roofline.kv_values_per_position(30, 3, 64)
    assert kv_values == 11520
    kv = roofline.kv_bytes_per_token(kv_values, 1000, 2)
    assert kv == 23_040_000
    assert roofline.decode_floor_ms(1e9, 1.0, 1e12, kv) == pytest.approx((1e9 + kv) / 1e12 * 1000)
    with pytest.raises(roofline.RooflineError):
        roofline.decode_floor_ms(1e9, 1.0, 0)


def test_roofline_table_from_the_real_bench():
    shape = roofline.model_shape_from_bench([REAL_BENCH, store.path("engine_throughput", store.newest("engine_throughput", label="")[0])])
    data = REAL_RUN
    assert shape.param_count == data["runs"]["fp32"]["param_bytes"] // 4
    assert shape.kv_values_per_position == 11520  # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64
    rows = roofline.roofline_table(shape.param_count, 0, 0, {"H200": 4.8e12})
    fp32, _, _, int4 = rows
    assert fp32.floors_ms["H200"] == pytest.approx(shape.param_count * 4 / 4.8e12 * 1000)
    assert int4.floors_ms["H200"] == pytest.approx(shape.param_count * 0.5625 / 4.8e12 * 1000)
    bw, _ = roofline.cpu_read_bandwidth([REAL_BENCH])
    assert bw == pytest.approx(data["meta"]["read_bandwidth"]["gb_s"] * 1e9)


# ------------------------------------------------------------------------------------------ the ledger

REQUESTS = table("requests", column("request_id", String), column("created_at", DateTime(timezone=True)),
                 column("endpoint", String), column("requested_model", String), column("stream", Boolean),
                 column("backend", String), column("prompt_tokens", Integer),
                 column("cached_prompt_tokens", Integer), column("completion_tokens", Integer),
                 column("input_cost_usd", Float), column("output_cost_usd", Float), column("cost_usd", Float),
                 column("status", String), column("attempts", Integer))


def insert_rows(url: str, rows: list[tuple[str, int, int, int, str, str]]) -> None:
    """(backend, hour, minute, prompt, completion, status) rows on 2025-03-01 (UTC)."""
    engine = create_engine(sync_url(url))
    try:
        with engine.begin() as conn:
            for i, (backend, hour, minute, prompt, completion, status) in enumerate(rows):
                conn.execute(insert(REQUESTS).values(
                    request_id=f"r{i}", created_at=datetime(2025, 3, 1, hour, minute, tzinfo=UTC),
                    endpoint="chat.completions", requested_model="m", stream=False, backend=backend,
                    prompt_tokens=prompt, cached_prompt_tokens=0, completion_tokens=completion,
                    input_cost_usd=0.0, output_cost_usd=0.0, cost_usd=0.0, status=status, attempts=1))
    finally:
        engine.dispose()


LEDGER = [
    # hour 10: three ok requests, 600 output and 150 prompt tokens; an error that must not count
    ("eng", 10, 5, 50, 100, "ok"), ("eng", 10, 30, 50, 200, "ok"), ("eng", 10, 59, 50, 300, "ok"),
    ("eng", 10, 40, 50, 10_000, "error"),
    # hour 11: more prompt tokens, fewer output tokens (500)
    ("eng", 11, 0, 1000, 400, "ok"), ("eng", 11, 20, 1000, 100, "ok"),
    # hour 12: another backend, the busiest hour of all
    ("other", 12, 15, 10, 5000, "ok"),
]


@pytest.fixture
def ledger_url(migrated_db_url) -> str:
    insert_rows(migrated_db_url, LEDGER)
    return migrated_db_url


def test_ledger_busiest_hour_by_hand(ledger_url):
    load = capacity.ledger_load(ledger_url, backend="eng")
    assert load.busiest_hour == "2025-03-01 10"
    assert load.requests == 5 and load.busiest_hour_requests == 3 and load.hours_with_traffic == 2
    assert load.output_tok_s == pytest.approx(600 / 3600)
    assert load.prompt_tok_s == pytest.approx(150 / 3600)
    assert load.mean_completion_tokens == pytest.approx((600 + 500) / 5)
    assert load.mean_prompt_tokens == pytest.approx((150 + 2000) / 5)

    everything = capacity.ledger_load(ledger_url)
    assert everything.busiest_hour == "2025-03-01 12"
    assert everything.output_tok_s == pytest.approx(5000 / 3600)
    assert everything.requests == 6

    later = capacity.ledger_load(ledger_url, since="2025-03-01T11:00:00", until="2025-03-01T12:00:00")
    assert later.busiest_hour == "2025-03-01 11" and later.requests == 2
    assert later.output_tok_s == pytest.approx(500 / 3600)


def test_run_from_ledger(ledger_url, curve_file, policy_file):
    rc, out, err = run_cap(from_ledger=True, database_url=ledger_url, backend="eng", curve=str(curve_file),
                           policy=str(policy_file), json=True)
    assert rc == 0, err
    body = json.loads(out)
    assert body["target_tokens_per_s"] == pytest.approx(600 / 3600)
    assert body["ledger"]["busiest_hour"] == "2025-03-01 10"
    assert body["devices"] == 1
    # the curve's W at c = 16 (4.0 s for 100 tokens) scaled to the ledger's 220 tokens: 8.8 s;
    # L = (600/3600 / 220) req/s × 8.8 s.
    assert body["seconds_in_system"] == pytest.approx(8.8)
    assert body["sequences_in_flight"] == pytest.approx(600 / 3600 / 220 * 8.8)
    assert body["roofline"]["context_tokens"] == 430 + 220
    rc, out, err = run_cap(from_ledger=True, database_url=ledger_url, backend="eng", curve=str(curve_file),
                           policy=str(policy_file))
    assert rc == 0, err
    assert "busiest hour 2025-03-01 10:00 UTC: 0.17 output tok/s" in out
    # issue 31 #6: a ledger shorter than a day is labelled as such (its busiest "hour" may be a partial one)
    assert out.startswith("Capacity plan (tokens per second)\n\nSHORT WINDOW: the ledger's traffic spans 2 UTC hour")
    assert body["ledger"]["window_note"].startswith("SHORT WINDOW")


def test_empty_ledger_exits_1_with_message(migrated_db_url, curve_file, policy_file):
    insert_rows(migrated_db_url, [("eng", 9, 0, 10, 10, "error"), ("eng", 9, 1, 10, 0, "rejected")])
    rc, out, err = run_cap(from_ledger=True, database_url=migrated_db_url, curve=str(curve_file),
                           policy=str(policy_file))
    assert rc == 1 and out == ""
    assert "no successful requests" in err and "Traceback" not in err


def test_unmigrated_database_is_a_clear_error(tmp_path, curve_file, policy_file):
    url = f"sqlite:///{tmp_path / 'blank.db'}"
    rc, _, err = run_cap(from_ledger=True, database_url=url, curve=str(curve_file), policy=str(policy_file))
    assert rc == 1 and "cannot read the ledger" in err


def test_sqlite_busiest_hour_fixture_is_migrated(tmp_path):
    # The same numbers straight through gateway.db.upgrade on a file of our own.
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    upgrade(url)
    insert_rows(url, LEDGER[:3])
    load = capacity.ledger_load(url)
    assert (load.busiest_hour, load.requests, load.output_tok_s) == ("2025-03-01 10", 3, pytest.approx(600 / 3600))


# ------------------------------------------------------------------------------------------ the ladder

STACK = {"stack": {"requests": 4, "tokens": 10, "gpu_hour_usd": 3.6, "system_prompt_tokens": 20, "rows": [
    {"stage": "one request at a time", "tok_s": 100.0, "same_as_stage_1": True, "spec_acceptance": None},
    {"stage": "+ continuous batching", "tok_s": 400.0, "same_as_stage_1": True, "spec_acceptance": None},
    {"stage": "+ prefix cache", "tok_s": 800.0, "same_as_stage_1": True, "spec_acceptance": None},
    {"stage": "+ int8 weights", "tok_s": 200.0, "same_as_stage_1": False, "spec_acceptance": None},
    {"stage": "prefix cache + speculative decoding", "tok_s": 1000.0, "same_as_stage_1": True,
     "spec_acceptance": 0.5}]}}


@pytest.fixture
def stack_file(tmp_path) -> Path:
    p = tmp_path / "stack.json"
    p.write_text(json.dumps(STACK))
    return p


def test_ladder_by_hand(stack_file):
    rows = ladder.load_stack(stack_file)
    rungs = ladder.ladder_rows(rows, 3.6, 0.5)
    # $3.6/h ÷ (tok/s × 3600) × 1e6 = 1000 / tok_s dollars per Mtok at 100%; twice that at 50%.
    assert [r.usd_per_mtok_full for r in rungs] == pytest.approx([10.0, 2.5, 1.25, 5.0, 1.0])
    assert [r.usd_per_mtok_measured for r in rungs] == pytest.approx([20.0, 5.0, 2.5, 10.0, 2.0])
    assert [r.speedup_vs_previous for r in rungs] == pytest.approx([1.0, 4.0, 2.0, 0.25, 1.25])
    assert [r.speedup_vs_first for r in rungs] == pytest.approx([1.0, 4.0, 8.0, 2.0, 10.0])
    assert "slower" in rungs[3].note and "differs" in rungs[3].note
    assert "alternative stack" in rungs[4].note and "'+ prefix cache'" in rungs[4].note
    assert "50%" in rungs[4].note  # draft acceptance
    with pytest.raises(AttributeError):
        rungs[0].tok_s = 1.0  # frozen


def test_ladder_unknown_and_zero_utilisation(stack_file):
    rows = ladder.load_stack(stack_file)
    unknown = ladder.ladder_rows(rows, 3.6, None)
    assert all(r.usd_per_mtok_measured is None for r in unknown)
    zero = ladder.ladder_rows(rows, 3.6, 0.0)
    assert zero[0].usd_per_mtok_measured == pytest.approx(10.0 / 0.05)
    assert "floored at 5%" in zero[0].note


def test_ladder_errors(tmp_path):
    with pytest.raises(ladder.LadderError, match="no such file"):
        ladder.load_stack(tmp_path / "nope.json")
    (tmp_path / "nostack.json").write_text(json.dumps({"meta": {}}))
    with pytest.raises(ladder.LadderError, match="no stack section"):
        ladder.load_stack(tmp_path / "nostack.json")
    assert issubclass(ladder.LadderError, ValueError)
    out, err = io.StringIO(), io.StringIO()
    args = argparse.Namespace(bench=str(tmp_path / "nope.json"), policy=None, backend=None, utilisation=None,
                              database_url=None, json=False)
    assert ladder.run(args, out=out, err=err) == 1 and "no such file" in err.getvalue()


def test_ladder_run_prints_table(stack_file, policy_file):
    out, err = io.StringIO(), io.StringIO()
    args = argparse.Namespace(bench=str(stack_file), policy=str(policy_file), backend="cpu", utilisation=None,
                              database_url=None, json=False)
    assert ladder.run(args, out=out, err=err, measured_utilisation=0.25) == 0, err.getvalue()
    text = out.getvalue()
    # cpu backend $0.5/h: 0.5e6 / (100 × 3600) = 1.389 at 100%, ×4 at 25%.
    assert "| one request at a time | 100.0 | 1.00× | 1.00× | 1.389 | 5.556 |" in text
    assert "| + int8 weights | 200.0 | 0.25× | 2.00× |" in text
    assert "$/Mtok @ 25% measured" in text
    out = io.StringIO()
    args.utilisation, args.json = 0.5, True  # --utilisation overrides the measured value
    assert ladder.run(args, out=out, err=err, measured_utilisation=0.25) == 0
    body = json.loads(out.getvalue())
    assert body["utilisation"] == 0.5 and body["device_hour_usd"] == 0.5
    assert body["rungs"][0]["usd_per_mtok_measured"] == pytest.approx(0.5e6 / (100 * 3600 * 0.5))


def test_ladder_over_the_real_benchmark(policy_file):
    rows = ladder.load_stack(REAL_BENCH)
    usd = REAL_RUN["stack"]["gpu_hour_usd"]
    rungs = ladder.ladder_rows(rows, usd, None)
    assert len(rungs) == len(rows) >= 5
    for rung, row in zip(rungs, rows, strict=True):  # the benchmark priced its rows the same way
        assert rung.usd_per_mtok_full == pytest.approx(row["usd_per_mtok"])
        assert rung.speedup_vs_first == pytest.approx(row["tok_s"] / rows[0]["tok_s"])
    for r in rungs[1:]:
        assert (r.speedup_vs_previous < 1) == ("slower" in r.note)
    out, err = io.StringIO(), io.StringIO()
    args = argparse.Namespace(bench=str(REAL_BENCH), policy=str(policy_file), backend=None, utilisation=None,
                              database_url=None, json=False)
    assert ladder.run(args, out=out, err=err) == 0, err.getvalue()
    text = out.getvalue()
    assert "+ continuous batching" in text and "measured utilisation unknown" in text
    assert math.isfinite(rungs[-1].usd_per_mtok_full)
