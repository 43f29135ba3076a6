"""The routing decision with synthetic engine load, the metrics parser, the model cache, and the policy settings."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from gateway.engine_load import UNKNOWN, EngineLoad, _Engine, histogram_quantile, metrics_url, parse_samples
from gateway.policy import IdleSpec, PolicyError, SpilloverSpec, parse_policy
from gateway.routing import (
    Decision,
    DifficultyModels,
    RoutingRuntime,
    budget_downgrade,
    choose,
    decide,
    difficulty_chain,
    relaxed_threshold,
    saturated,
)
from router.model import DifficultyModel
from router.train import fit

SPILL = SpilloverSpec(max_waiting=4, max_kv_usage=0.95, max_ttft_ms=3000)
IDLE = IdleSpec(below_utilisation=0.3, max_threshold=0.8)


def load(**kw) -> EngineLoad:
    base = {"known": True, "waiting": 0, "running": 1, "kv_usage": 0.2, "busy": 0.6, "ttft_p50_ms": 50.0,
            "ttft_p95_ms": 120.0}
    return EngineLoad(**{**base, **kw})


# ---------------------------------------------------------------- the decision


def test_difficulty_without_load_settings() -> None:
    assert choose(0.2, 0.5, UNKNOWN, None, None) == (False, 0.5, "difficulty_easy")
    assert choose(0.5, 0.5, UNKNOWN, None, None) == (True, 0.5, "difficulty_hard")  # ≥ threshold is hard


@pytest.mark.parametrize(("over", "field"), [({"waiting": 5}, "waiting"), ({"kv_usage": 0.97}, "kv"),
                                             ({"ttft_p95_ms": 3500.0}, "ttft")])
def test_each_spillover_limit_sends_easy_work_to_hard(over: dict, field: str) -> None:
    busy = load(**over)
    assert saturated(busy, SPILL)
    assert choose(0.1, 0.5, busy, SPILL, None) == (True, 0.5, "spillover")
    assert choose(0.7, 0.5, busy, SPILL, None) == (True, 0.5, "difficulty_hard")  # hard anyway: no spill


def test_limits_are_exceeded_not_reached_and_unknown_never_spills() -> None:
    at_limits = load(waiting=4, kv_usage=0.95, ttft_p95_ms=3000.0)
    assert not saturated(at_limits, SPILL)
    assert choose(0.1, 0.5, at_limits, SPILL, None)[2] == "difficulty_easy"
    assert not saturated(UNKNOWN, SPILL)
    assert not saturated(load(waiting=None, kv_usage=None, ttft_p95_ms=None), SPILL)  # nothing measured yet
    only_queue = SpilloverSpec(max_waiting=0)
    assert saturated(load(waiting=1, kv_usage=1.0), only_queue)
    assert not saturated(load(waiting=0, kv_usage=1.0), only_queue)  # unset limits are not checked


def test_idle_relaxation_is_linear_and_floored() -> None:
    assert relaxed_threshold(0.5, load(busy=0.3), IDLE) == 0.5  # at the utilisation bound: no change
    assert relaxed_threshold(0.5, load(busy=0.0), IDLE) == pytest.approx(0.8)  # idle: the quality floor
    assert relaxed_threshold(0.5, load(busy=0.15), IDLE) == pytest.approx(0.65)  # half way
    assert relaxed_threshold(0.5, load(busy=0.6), IDLE) == 0.5
    assert relaxed_threshold(0.5, UNKNOWN, IDLE) == 0.5
    assert relaxed_threshold(0.9, load(busy=0.0), IDLE) == 0.9  # never lowers a threshold
    for busy in np.linspace(0, 0.3, 13):
        assert 0.5 <= relaxed_threshold(0.5, load(busy=float(busy)), IDLE) <= 0.8


def test_idle_relaxed_reason_only_when_the_relaxation_decided() -> None:
    idle = load(busy=0.0)
    assert choose(0.6, 0.5, idle, None, IDLE) == (False, pytest.approx(0.8), "idle_relaxed")
    assert choose(0.3, 0.5, idle, None, IDLE) == (False, pytest.approx(0.8), "difficulty_easy")
    assert choose(0.85, 0.5, idle, None, IDLE) == (True, pytest.approx(0.8), "difficulty_hard")
    # Saturation wins over idleness (a full queue with a low busy fraction still spills).
    assert choose(0.6, 0.5, load(busy=0.0, waiting=9), SPILL, IDLE) == (True, 0.5, "difficulty_hard")
    assert choose(0.3, 0.5, load(busy=0.0, waiting=9), SPILL, IDLE) == (True, 0.5, "spillover")


def test_chain_order_and_no_duplicates() -> None:
    policy = parse_policy(POLICY, "p.yaml")
    route = policy.routes["assistant"]
    assert difficulty_chain(route, hard=False) == ["local", "spare", "mini"]
    assert difficulty_chain(route, hard=True) == ["mini", "spare", "local"]
    route2 = route.model_copy(update={"fallbacks": ["mini", "local"]})
    assert difficulty_chain(route2, hard=False) == ["local", "mini"]


# ---------------------------------------------------------------- engine metrics


def engine_metrics_text(ttft_observations: list[float], waiting=3, running=1, used=30, total=40, busy=0.25) -> str:
    """The engine's exposition format (same metric names, written by prometheus_client)."""
    r = CollectorRegistry()
    p = "switchyard_engine_"
    h = Histogram(p + "time_to_first_token_seconds", "ttft", registry=r,
                  buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0))
    for x in ttft_observations:
        h.observe(x)
    for name, value in (("requests_waiting", waiting), ("requests_running", running), ("kv_blocks_used", used),
                        ("kv_blocks_total", total), ("busy_fraction", busy)):
        Gauge(p + name, name, registry=r).set(value)
    return generate_latest(r).decode()


def test_metrics_url() -> None:
    assert metrics_url("http://127.0.0.1:8100/v1") == "http://127.0.0.1:8100/metrics"
    assert metrics_url("http://h:1/v1/") == "http://h:1/metrics"


def test_histogram_quantile_interpolates_inside_the_bucket() -> None:
    bounds = (0.1, 0.5, 1.0, float("inf"))
    assert histogram_quantile(0.5, bounds, (0, 10, 10, 10)) == pytest.approx(0.3)
    assert histogram_quantile(0.5, bounds, (0, 0, 0, 0)) is None
    assert histogram_quantile(0.95, bounds, (0, 0, 0, 4)) == 1.0  # overflow bucket: the last finite bound


def test_snapshot_gauges_and_recent_ttft_from_histogram_deltas() -> None:
    engine = _Engine("http://x/metrics")
    old = [4.0] * 50  # slow requests long ago
    engine.update(engine_metrics_text(old), now=0.0, window_s=10.0)
    assert engine.load.ttft_p50_ms is None  # one snapshot: no window yet
    engine.update(engine_metrics_text(old + [0.02] * 10), now=20.0, window_s=10.0)
    engine.update(engine_metrics_text(old + [0.02] * 10 + [0.2] * 10), now=25.0, window_s=10.0)
    lo = engine.load
    assert (lo.waiting, lo.running, lo.kv_usage, lo.busy) == (3, 1, 0.75, 0.25)
    # The baseline is the newest snapshot at or before 25 - 10 = 15 (t=0): the 20 recent requests count, the
    # 50 older ones do not. p50 falls in the 10-25 ms bucket, p95 in the 100-250 ms one.
    assert 10 < lo.ttft_p50_ms <= 100 and 100 < lo.ttft_p95_ms <= 250
    engine.update(engine_metrics_text(old + [0.02] * 10 + [0.2] * 10), now=40.0, window_s=10.0)
    assert engine.load.ttft_p95_ms is None  # nothing finished in the last 10 s
    engine.update(engine_metrics_text([0.02]), now=41.0, window_s=10.0)  # counters went back: restarted
    assert engine.load.known and engine.load.ttft_p50_ms is None


def test_parse_ignores_other_metrics_and_labels() -> None:
    text = engine_metrics_text([0.01]) + 'switchyard_engine_requests_total{status="success"} 3.0\nother 1\n'
    values, buckets = parse_samples(text)
    assert values["switchyard_engine_requests_waiting"] == 3
    assert "other" not in values and not any("{" in k for k in values)
    assert buckets[-1] == (float("inf"), 1.0)


# ---------------------------------------------------------------- models and decide()

POLICY = """
backends:
  local: {kind: engine, model: tiny, api_base: "http://127.0.0.1:9/v1"}
  spare: {kind: engine, model: spare, api_base: "http://127.0.0.1:9/v1"}
  mini: {kind: litellm, model: openai/gpt-4o-mini, input_usd_per_mtok: 1, output_usd_per_mtok: 2}
routes:
  assistant:
    strategy: difficulty
    easy: local
    hard: mini
    threshold: 0.5
    model_path: MODEL
    fallbacks: [spare]
"""


def tiny_model(path: Path, hard_word: str = "prove", inverted: bool = False) -> DifficultyModel:
    """Trained on 60 rows: `<hard_word> the statement …` needs the strong model, `say hi …` does not
    (the other way round when inverted)."""
    prompts = [f"{hard_word} the statement number {i}" for i in range(20)] + [f"say hi {i}" for i in range(40)]
    weak = np.array([False] * 20 + [True] * 40) != inverted
    model = fit(prompts, weak, np.ones(60, dtype=bool))
    model.save(path)
    return DifficultyModel.load(path)


async def test_decide_scores_chat_and_completions_and_reloads_a_changed_file(tmp_path: Path) -> None:
    path = tmp_path / "m.npz"
    tiny_model(path)
    policy = parse_policy(POLICY.replace("MODEL", str(path)), "p.yaml")
    route = policy.routes["assistant"]
    runtime = RoutingRuntime()
    models, load = runtime.models, runtime.load
    assert decide(route, {"messages": [{"role": "user", "content": "hi"}]}, models, load).reason == "no_score"
    await runtime.models.sync(policy)
    try:
        hard = decide(route, {"messages": [{"role": "user", "content": "prove the statement number 3"}]}, models, load)
        easy = decide(route, {"prompt": "say hi 3"}, models, load)
        assert (hard.reason, hard.chain, hard.threshold) == ("difficulty_hard", ["mini", "spare", "local"], 0.5)
        assert (easy.reason, easy.chain) == ("difficulty_easy", ["local", "spare", "mini"])
        assert hard.difficulty >= 0.5 > easy.difficulty
        assert hard.model_version == DifficultyModel.load(path).version
        assert decide(route, {"prompt": [1, 2, 3]}, models, load).reason == "no_score"  # token ids: nothing to read
        # A retrained model replaces the file: the watcher's check picks it up.
        old_version = hard.model_version
        tiny_model(path, inverted=True)
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
        await runtime.models.check_now()
        again = decide(route, {"messages": [{"role": "user", "content": "prove the statement number 3"}]}, models, load)
        assert again.model_version != old_version and again.reason == "difficulty_easy"
        # A broken file keeps the last good model.
        path.write_bytes(b"not a model")
        await runtime.models.check_now()
        assert decide(route, {"prompt": "say hi 3"}, models, load).model_version == again.model_version
    finally:
        await runtime.aclose()


async def test_missing_model_routes_to_backend_and_default_model_loads_in_a_thread(tmp_path, monkeypatch) -> None:
    policy = parse_policy(POLICY.replace("MODEL", str(tmp_path / "absent.npz")), "p.yaml")
    runtime = RoutingRuntime()
    models, load = runtime.models, runtime.load
    await runtime.models.sync(policy)
    d = decide(policy.routes["assistant"], {"prompt": "prove it"}, models, load)
    assert (d.reason, d.chain) == ("no_score", ["mini", "spare", "local"])  # backend defaults to hard
    # No model_path: the project's default model, trained into the data dir on first use, off the loop.
    monkeypatch.setenv("SWITCHYARD_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("SWITCHYARD_ROUTER_MODEL", raising=False)
    default_policy = parse_policy(POLICY.replace("    model_path: MODEL\n", ""), "p.yaml")
    beats = 0

    async def ticker() -> None:
        nonlocal beats
        while True:
            await asyncio.sleep(0.01)
            beats += 1

    tick = asyncio.create_task(ticker())
    await runtime.models.sync(default_policy)
    tick.cancel()
    assert beats > 0  # the loop kept running while the model trained
    assert list((tmp_path / "data" / "router").glob("default-*.npz"))
    d = decide(default_policy.routes["assistant"], {"prompt": "hi"}, models, load)
    assert d.reason == "difficulty_easy" and d.difficulty < 0.5
    await runtime.aclose()


async def test_models_are_shared_by_path_and_dropped_with_their_routes(tmp_path) -> None:
    path = tmp_path / "m.npz"
    tiny_model(path)
    text = POLICY.replace("MODEL", str(path)) + """
  second:
    strategy: difficulty
    easy: local
    hard: mini
    model_path: MODEL
""".replace("MODEL", str(path))
    policy = parse_policy(text, "p.yaml")
    models = DifficultyModels()
    await models.sync(policy)
    assert models.get(policy.routes["assistant"]) is models.get(policy.routes["second"]) is not None
    other = tmp_path / "other.npz"
    tiny_model(other, hard_word="explain")
    new_policy = parse_policy(POLICY.replace("MODEL", str(other)), "p.yaml")
    await models.sync(new_policy)
    assert models.get(policy.routes["assistant"]) is None  # the old file's model is gone with its routes
    assert models.get(new_policy.routes["assistant"]).version == DifficultyModel.load(other).version
    await models.aclose()


# ---------------------------------------------------------------- policy settings

ROUTE_HEAD = """
backends:
  local: {kind: engine, model: tiny, api_base: "http://127.0.0.1:9/v1"}
  mini: {kind: litellm, model: openai/gpt-4o-mini, input_usd_per_mtok: 1, output_usd_per_mtok: 2}
routes:
  assistant:
"""


def error_of(route_body: str) -> str:
    with pytest.raises(PolicyError) as info:
        parse_policy(ROUTE_HEAD + route_body, "p.yaml")
    return str(info.value)


def test_route_settings_parse() -> None:
    policy = parse_policy(ROUTE_HEAD + """    strategy: difficulty
    easy: local
    hard: mini
    threshold: 0.5
    spillover: {max_waiting: 4, max_kv_usage: 0.95, max_ttft_ms: 3000}
    idle: {below_utilisation: 0.3, max_threshold: 0.8}
    shadow: {sample_rate: 0.1, judge: mini}
    budget_downgrade: true
""", "p.yaml")
    r = policy.routes["assistant"]
    assert r.spillover == SPILL and r.idle == IDLE and r.shadow.judge == "mini" and r.budget_downgrade
    assert parse_policy(ROUTE_HEAD + "    strategy: difficulty\n    easy: local\n    hard: mini\n"
                        "    shadow: {sample_rate: 1}\n", "p.yaml").routes["assistant"].shadow.judge == "exact"


def test_the_budget_downgrade_and_the_fallback_reason_are_routings() -> None:
    """The decision is complete before the proxy acts on it: the cheaper decision a key that cannot afford hard
    gets, and the reason a row records for the backend that served it."""
    head = ROUTE_HEAD + "    strategy: difficulty\n    easy: local\n    hard: mini\n"
    allowed = parse_policy(head + "    budget_downgrade: true\n", "p.yaml").routes["assistant"]
    hard = Decision(chain=["mini", "local"], reason="difficulty_hard", difficulty=0.7, threshold=0.5)
    cheaper = budget_downgrade(allowed, hard)
    assert cheaper == Decision(chain=["local"], reason="budget", difficulty=0.7, threshold=0.5)
    assert hard.chain == ["mini", "local"] and hard.reason == "difficulty_hard"  # the first decision is kept
    assert budget_downgrade(allowed, cheaper) is None  # easy alone already: the refusal stands
    assert budget_downgrade(parse_policy(head, "p.yaml").routes["assistant"], hard) is None  # not allowed
    assert hard.reason_served_by("mini") == "difficulty_hard"
    assert hard.reason_served_by("local") == "fallback"


@pytest.mark.parametrize(("body", "expected"), [
    ("    strategy: fixed\n    backend: local\n    spillover: {max_waiting: 1}\n",
     "'spillover' applies only to `strategy: difficulty`"),
    ("    strategy: difficulty\n    easy: mini\n    hard: local\n    idle: {below_utilisation: 0.3, max_threshold: 0.8}\n",
     "'idle' reads the load of the `easy` backend, and 'mini' is not an engine"),
    ("    strategy: difficulty\n    easy: local\n    hard: mini\n    spillover: {}\n", "spillover sets no limit"),
    (("    strategy: difficulty\n    easy: local\n    hard: mini\n    threshold: 0.6\n"
      "    idle: {below_utilisation: 0.3, max_threshold: 0.5}\n"), "max_threshold 0.5 is below the route's threshold"),
    ("    strategy: difficulty\n    easy: local\n    hard: mini\n    shadow: {sample_rate: 0.1, judge: mni}\n",
     "unknown judge 'mni'"),
    ("    strategy: difficulty\n    easy: local\n    hard: mini\n    shadow: {sample_rate: 1.5}\n",
     "less than or equal to 1"),
    ("    strategy: difficulty\n    easy: local\n    hard: mini\n    spillover: {max_waitng: 3}\n",
     "did you mean 'max_waiting'?"),
    ("    strategy: difficulty\n    easy: local\n    hard: mini\n    idle: {max_threshold: 0.8}\n",
     "missing required field 'below_utilisation'"),
])
def test_bad_route_settings_name_field_and_fix(body: str, expected: str) -> None:
    message = error_of(body)
    assert expected in message and "p.yaml:" in message and "fix:" in message


@pytest.mark.parametrize("name", ["utilisation-routing.yaml", "shadow-learning.yaml"])
def test_example_policies_validate(name: str) -> None:
    from gateway.policy import load_policy

    route = load_policy(Path(__file__).resolve().parents[2] / "policies" / "examples" / name).routes["assistant"]
    assert route.strategy == "difficulty" and (route.spillover and route.idle or route.shadow)
