"""Token demand and desired replicas per engine backend (issue 32 #4, gateway/demand.py).

The end-to-end case drives synthetic load through a real gateway to a stand-in engine with the openai SDK, reads
/metrics and checks every figure against the answer worked out here by hand: the packaged benchmark JSON read
raw (largest concurrency whose TTFT p95 meets the target), the tokens the stand-in produced, and the ledger's
own rows for the time in system. The unit cases slide the window with a hand-driven clock.
"""
from __future__ import annotations

import json
import math

import openai
import pytest
import urllib3
from prometheus_client.parser import text_string_to_metric_families

from gateway.demand import DemandTracker
from gateway.policy import PolicyError, parse_policy
from gateway.reports.bench_data import ENGINE_CURVE
from gateway.testing.standin import run_standin
from tests.e2e.conftest import MASTER_KEY, ledger_rows, run_gateway

WINDOW_S = 600.0  # far longer than the test: every request stays in the window, so the rates are exact


def _curve_capacity(p95_ttft_ms: float) -> float:
    """The packaged curve's output tok/s at the largest concurrency meeting the TTFT target, read by hand."""
    points = json.loads(ENGINE_CURVE.read_text())["points"]
    ok = [p for p in points if p["ttft_p95_ms"] <= p95_ttft_ms]
    return max(ok, key=lambda p: p["concurrency"])["output_tok_s"]


def _scrape(root: str) -> dict[tuple[str, str], float]:
    text = urllib3.request("GET", f"{root}/metrics").data.decode()
    return {(s.name, s.labels.get("backend", "")): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


POLICY = f"""\
backends:
  demand_fixed:
    kind: engine
    model: demo-model
    api_base: {{standin}}
    autoscale:
      capacity_tokens_per_s: 0.05
      target_utilisation: 0.5
      window_s: {WINDOW_S}
  demand_curve:
    kind: engine
    model: demo-model
    api_base: {{standin}}
    autoscale:
      p95_ttft_ms: 200
      window_s: {WINDOW_S}
  demand_api:
    kind: litellm
    model: openai/gpt-4o-mini
    api_base: {{standin}}
    api_key_env: STANDIN_API_KEY
routes:
  fixed:
    strategy: fixed
    backend: demand_fixed
  curve:
    strategy: fixed
    backend: demand_curve
  api:
    strategy: fixed
    backend: demand_api
"""


def test_gateway_exports_token_demand_and_desired_replicas(tmp_path, monkeypatch):
    monkeypatch.setenv("STANDIN_API_KEY", "sk-standin")
    with run_standin(engine_extension=True) as standin, run_gateway(POLICY.format(standin=standin), tmp_path) as gw:
        client = openai.OpenAI(base_url=gw.base_url, api_key=MASTER_KEY, max_retries=0)
        msg = [{"role": "user", "content": "how many replicas do we need today"}]
        for _ in range(7):
            client.chat.completions.create(model="fixed", messages=msg, max_tokens=20)
        for i in range(8):  # two of them streamed: the stream's finish feeds the window too
            if i < 2:
                for _chunk in client.chat.completions.create(model="curve", messages=msg, max_tokens=4000,
                                                             stream=True):
                    pass
            else:
                client.chat.completions.create(model="curve", messages=msg, max_tokens=4000)
        client.chat.completions.create(model="api", messages=msg, max_tokens=50)
        m = _scrape(gw.root)
    rows = ledger_rows(gw.config.database_url)  # after shutdown: every batched row is written

    # the policy's own capacity: 7 × 20 tokens over the window, 0.05 tok/s × 0.5 per replica
    fixed_rate = 7 * 20 / WINDOW_S
    assert m[("switchyard_backend_output_tokens_per_second", "demand_fixed")] == pytest.approx(fixed_rate)
    assert m[("switchyard_backend_replica_target_tokens_per_second", "demand_fixed")] == pytest.approx(0.025)
    assert m[("switchyard_backend_desired_replicas", "demand_fixed")] == math.ceil(fixed_rate / 0.025) == 10

    # the packaged curve at a 200 ms TTFT p95 target and report capacity's default utilisation 0.6
    curve_rate = 8 * 4000 / WINDOW_S
    per_replica = _curve_capacity(200) * 0.6
    assert m[("switchyard_backend_output_tokens_per_second", "demand_curve")] == pytest.approx(curve_rate)
    assert m[("switchyard_backend_replica_target_tokens_per_second", "demand_curve")] == pytest.approx(per_replica)
    want = math.ceil(curve_rate / per_replica)
    assert want > 1
    assert m[("switchyard_backend_desired_replicas", "demand_curve")] == want

    # prompt tokens and in-flight tokens (Little's Law) from the ledger's own rows
    for backend in ("demand_fixed", "demand_curve"):
        mine = [r for r in rows if r["backend"] == backend]
        assert len(mine) == (7 if backend == "demand_fixed" else 8)
        prompt = sum(r["prompt_tokens"] for r in mine)
        assert m[("switchyard_backend_prompt_tokens_per_second", backend)] == pytest.approx(prompt / WINDOW_S)
        little = sum((r["prompt_tokens"] + r["completion_tokens"]) * r["latency_ms"] / 1000 for r in mine) / WINDOW_S
        assert little > 0
        assert m[("switchyard_backend_in_flight_tokens", backend)] == pytest.approx(little, rel=1e-3)

    # an API backend is nobody's replica to scale
    assert ("switchyard_backend_desired_replicas", "demand_api") not in m


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _spec(name: str, autoscale: str):
    text = f"""
backends:
  {name}:
    kind: engine
    model: m
    api_base: http://127.0.0.1:9/v1
    autoscale: {autoscale}
routes:
  r: {{strategy: fixed, backend: {name}}}
"""
    return parse_policy(text, "t.yaml").backends[name]


def test_window_slides_and_demand_falls_to_zero():
    clock = Clock()
    t = DemandTracker(clock, export=False)
    spec = _spec("demand_unit_slide", "{capacity_tokens_per_s: 10, target_utilisation: 1, window_s: 10}")
    for _ in range(5):  # 5 requests a second for 4 s: 100 prompt + 30 output tokens each, 2 s in the system
        for _ in range(5):
            t.observe(spec, 100, 30, 2.0)
        clock.now += 1
    d = t.demand("demand_unit_slide")
    assert d.output_tok_s == pytest.approx(25 * 30 / 10)
    assert d.prompt_tok_s == pytest.approx(25 * 100 / 10)
    assert d.in_flight_tokens == pytest.approx(25 * 130 * 2.0 / 10)
    assert t.desired_replicas("demand_unit_slide") == math.ceil(75 / 10)
    clock.now += 7  # the first two seconds fall out of the window
    assert t.demand("demand_unit_slide").output_tok_s == pytest.approx(15 * 30 / 10)
    clock.now += 10
    assert t.demand("demand_unit_slide").output_tok_s == 0
    assert t.desired_replicas("demand_unit_slide") == 0


@pytest.mark.parametrize("tokens_per_s, p95_ttft_ms", [(20.0, 200), (1000.0, 2000), (2000.0, 2500), (5000.0, 1000)])
def test_desired_replicas_equal_report_capacity_devices(tokens_per_s, p95_ttft_ms, tmp_path):
    """The gauge and `switchyard report capacity --json` agree for the same rate and TTFT target."""
    import io

    from gateway.cli import build_parser
    from gateway.reports import capacity

    clock = Clock()
    t = DemandTracker(clock, export=False)
    window = 100
    spec = _spec("demand_unit_report", f"{{p95_ttft_ms: {p95_ttft_ms}, window_s: {window}}}")
    per_request = 64  # the curve's own output tokens per request: no time-in-system scaling either side
    for _ in range(round(tokens_per_s * window / per_request)):
        t.observe(spec, 128, per_request, 3.0)
    rate = t.demand("demand_unit_report").output_tok_s
    argv = ["report", "capacity", "--target-tokens-per-s", repr(rate), "--p95-ttft-ms", str(p95_ttft_ms), "--json",
            "--database-url", f"sqlite:///{tmp_path / 'none.db'}"]
    out = io.StringIO()
    assert capacity.run(build_parser(argv).parse_args(argv), out) == 0
    assert t.desired_replicas("demand_unit_report") == json.loads(out.getvalue())["devices"]


def test_unreachable_ttft_target_is_nan_not_a_guess():
    clock = Clock()
    t = DemandTracker(clock, export=False)
    spec = _spec("demand_unit_nan", "{p95_ttft_ms: 1}")  # the packaged curve's best p95 is ~190 ms
    t.observe(spec, 10, 10, 1.0)
    assert math.isnan(t.desired_replicas("demand_unit_nan"))
    assert math.isnan(t.replica_target_tokens_per_s("demand_unit_nan"))


@pytest.mark.parametrize("autoscale, problem", [
    ("{capacity_tokens_per_s: 0}", "greater than 0"),
    ("{target_utilisation: 1.5}", "less than or equal to 1"),
    ("{window_s: 0.5}", "greater than or equal to 1"),
    ("{capacity: 3}", "capacity"),
])
def test_bad_autoscale_settings_are_refused(autoscale, problem):
    with pytest.raises(PolicyError, match=problem):
        _spec("demand_bad", autoscale)


def test_a_misspelt_autoscale_field_is_named_with_the_right_fix():
    # the hint comes from autoscale's own fields, not the backend's (was: "did you mean 'capabilities'?")
    with pytest.raises(PolicyError, match="allowed fields: capacity_tokens_per_s, p95_ttft_ms"):
        _spec("demand_typo", "{capacity: 3}")


def test_autoscale_on_an_api_backend_is_refused():
    text = """
backends:
  api: {kind: litellm, model: openai/gpt-4o-mini, autoscale: {window_s: 30}}
routes:
  r: {strategy: fixed, backend: api}
"""
    with pytest.raises(PolicyError, match="autoscale"):
        parse_policy(text, "t.yaml")
