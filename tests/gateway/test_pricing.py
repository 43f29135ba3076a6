"""Prices from litellm's bundled map (compared against the map, never hard-coded), overrides, GPU amortisation."""
from __future__ import annotations

import pytest

from gateway.backends.base import Usage
from gateway.policy import BackendSpec, parse_policy
from gateway.policy_warnings import policy_warnings
from gateway.pricing import (
    DEFAULT_ENGINE_RESERVE_USD_PER_MTOK,
    UTILISATION_FLOOR,
    Prices,
    counterfactual_cost,
    max_cost_estimate,
    price_table_version,
    prices_for,
    request_cost,
)


def api(model: str = "openai/gpt-4o-mini", **kw) -> BackendSpec:
    return BackendSpec(name="api", kind="litellm", model=model, **kw)


def engine(**kw) -> BackendSpec:
    kw.setdefault("gpu_hour_usd", 3.6)
    return BackendSpec(name="eng", kind="engine", model="demo", api_base="http://h/v1", **kw)


@pytest.fixture(scope="module")
def map_entry() -> dict:
    import litellm

    return litellm.model_cost["gpt-4o-mini"]


def test_litellm_prices_with_and_without_provider_prefix(map_entry: dict) -> None:
    expected = Prices(map_entry["input_cost_per_token"], map_entry["output_cost_per_token"],
                      map_entry["cache_read_input_token_cost"])
    assert prices_for(api("openai/gpt-4o-mini")) == expected
    assert prices_for(api("gpt-4o-mini")) == expected
    assert expected.input_per_token > 0 and expected.output_per_token > expected.input_per_token


def test_prefix_is_only_stripped_for_the_matching_provider() -> None:
    assert prices_for(api("anthropic/gpt-4o-mini")) is None
    assert prices_for(api("openai/no-such-model-xyz")) is None


def test_engine_backends_have_no_token_prices() -> None:
    assert prices_for(engine()) is None


def test_overrides_win_and_partial_overrides_keep_the_rest(map_entry: dict) -> None:
    full = prices_for(api(input_usd_per_mtok=1.0, output_usd_per_mtok=2.0, cached_input_usd_per_mtok=0.5))
    assert full == Prices(1e-6, 2e-6, 0.5e-6)
    only_output = prices_for(api(output_usd_per_mtok=9.0))
    assert only_output == Prices(map_entry["input_cost_per_token"], 9e-6, map_entry["cache_read_input_token_cost"])
    # an input override without a cached price: cached tokens cost the overridden input price
    assert prices_for(api(input_usd_per_mtok=4.0)).cached_input_per_token == pytest.approx(4e-6)
    # unknown model: both overrides needed
    assert prices_for(api("openai/partner-llama", input_usd_per_mtok=0.6)) is None
    assert prices_for(api("openai/partner-llama", input_usd_per_mtok=0.6, output_usd_per_mtok=0.8)) == Prices(
        pytest.approx(0.6e-6), pytest.approx(0.8e-6), pytest.approx(0.6e-6))


def test_api_cost_charges_cached_tokens_at_the_cached_rate(map_entry: dict) -> None:
    usage = Usage(prompt_tokens=1000, completion_tokens=200, cached_prompt_tokens=400)
    cost = request_cost(api(), usage)
    inp = 600 * map_entry["input_cost_per_token"] + 400 * map_entry["cache_read_input_token_cost"]
    out = 200 * map_entry["output_cost_per_token"]
    assert cost.basis == "api_price"
    assert cost.input_usd == pytest.approx(inp) and cost.output_usd == pytest.approx(out)
    assert cost.total_usd == pytest.approx(inp + out)
    unpriced = request_cost(api("openai/unknown-model-xyz"), usage)
    assert (unpriced.total_usd, unpriced.basis) == (0.0, "api_price")


def test_gpu_amortized_cost() -> None:
    spec = engine(gpu_hour_usd=3.6, gpus=2)
    usage = Usage(prompt_tokens=300, completion_tokens=100)
    # 2 s of device time on 2 GPUs at $3.60/h, at 50% utilisation: 2 × 2 × 0.001 $/s / 0.5 = $0.008
    cost = request_cost(spec, usage, device_seconds=2.0, utilisation=0.5)
    assert cost.basis == "gpu_amortized"
    assert cost.total_usd == pytest.approx(0.008)
    assert cost.input_usd == pytest.approx(0.006) and cost.output_usd == pytest.approx(0.002)  # 300:100 split
    # fully busy: the device time itself; unknown utilisation counts as fully busy
    assert request_cost(spec, usage, 2.0, 1.0).total_usd == pytest.approx(0.004)
    assert request_cost(spec, usage, 2.0, None).total_usd == pytest.approx(0.004)
    # a nearly idle GPU is floored so one request is not charged the whole idle hour
    floored = request_cost(spec, usage, 2.0, 0.001).total_usd
    assert floored == pytest.approx(0.004 / UTILISATION_FLOOR)
    assert request_cost(spec, usage, None, 0.5).total_usd == 0.0
    assert request_cost(spec, Usage(), 1.0, 1.0).input_usd == 0.0


POLICY = """\
backends:
  local: {kind: engine, api_base: "http://127.0.0.1:9/v1", model: demo, gpu_hour_usd: 2.5}
  mini: {kind: litellm, model: openai/gpt-4o-mini}
  big: {kind: litellm, model: openai/gpt-4o}
routes:
  demo: {backend: local, fallbacks: [mini]}
  vs-big: {backend: local, counterfactual: big}
  engine-only: {backend: local}
"""


def test_counterfactual_cost_uses_the_routes_api_prices() -> None:
    policy = parse_policy(POLICY, "t.yaml")
    usage = Usage(prompt_tokens=1000, completion_tokens=500, cached_prompt_tokens=0)
    mini, big = prices_for(policy.backends["mini"]), prices_for(policy.backends["big"])
    assert counterfactual_cost(policy, policy.routes["demo"], usage) == pytest.approx(
        1000 * mini.input_per_token + 500 * mini.output_per_token)
    assert counterfactual_cost(policy, policy.routes["vs-big"], usage) == pytest.approx(
        1000 * big.input_per_token + 500 * big.output_per_token)
    assert counterfactual_cost(policy, policy.routes["engine-only"], usage) is None


def test_max_cost_estimate_is_the_worst_case_over_the_chain() -> None:
    policy = parse_policy(POLICY, "t.yaml")
    local, mini, big = (policy.backends[n] for n in ("local", "mini", "big"))
    pm, pb = prices_for(mini), prices_for(big)
    assert max_cost_estimate(policy, [mini], 100, 50) == pytest.approx(100 * pm.input_per_token
                                                                        + 50 * pm.output_per_token)
    worst = max_cost_estimate(policy, [mini, big], 100, 50)
    assert worst == pytest.approx(100 * pb.input_per_token + 50 * pb.output_per_token)
    assert max_cost_estimate(policy, [local], 100, 50) == pytest.approx(150 * DEFAULT_ENGINE_RESERVE_USD_PER_MTOK
                                                                         * 1e-6)
    custom = local.model_copy(update={"reserve_usd_per_mtok": 1.0})
    assert max_cost_estimate(policy, [custom], 100, 50) == pytest.approx(150e-6)
    assert max_cost_estimate(policy, [], 100, 50) == 0.0


def test_price_table_version_is_stable_and_names_litellm() -> None:
    from importlib.metadata import version

    v = price_table_version()
    assert v.startswith(f"litellm-{version('litellm')}+") and len(v.split("+")[1]) == 8
    assert price_table_version() == v and len(v) <= 64


def test_policy_warns_about_unpriced_models(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PARTNER_KEY", raising=False)
    policy = parse_policy("""\
backends:
  partner: {kind: litellm, model: openai/partner-llama, api_key_env: PARTNER_KEY}
routes:
  r: {backend: partner}
""", "w.yaml")
    warnings = policy_warnings(policy)
    assert any("no price for 'openai/partner-llama'" in w and "input_usd_per_mtok" in w for w in warnings)
    assert any("PARTNER_KEY is not set" in w for w in warnings)


def test_every_zero_cost_carries_its_reason(map_entry: dict) -> None:
    from gateway import pricing

    usage = Usage(prompt_tokens=100, completion_tokens=20)
    assert request_cost(api("openai/unknown-model-xyz"), usage).note == pricing.NOTE_UNPRICED_MODEL
    assert request_cost(api(), Usage()).note == pricing.NOTE_NO_TOKENS
    assert request_cost(api(), usage).note is None
    assert request_cost(engine(gpu_hour_usd=0.0), usage, 1.0, 1.0).note == pricing.NOTE_NO_DEVICE_PRICE
    assert request_cost(engine(), usage, None, 1.0).note == pricing.NOTE_NO_DEVICE_SECONDS
    assert request_cost(engine(), usage, 0.0, 1.0).note == pricing.NOTE_NO_DEVICE_SECONDS
    floored = request_cost(engine(), usage, 1.0, 0.01)
    assert floored.total_usd > 0 and floored.note == pricing.NOTE_UTILISATION_FLOOR
    assert request_cost(engine(), usage, 1.0, 0.5).note is None


def test_a_cpu_host_price_replaces_the_gpu_price() -> None:
    from gateway.pricing import device_hour_usd, device_kind

    cpu = engine(gpu_hour_usd=0.0, cpu_hour_usd=0.36)
    assert (device_hour_usd(cpu), device_kind(cpu)) == (0.36, "cpu")
    gpu = engine(gpu_hour_usd=2.5, gpus=4)
    assert (device_hour_usd(gpu), device_kind(gpu)) == (10.0, "gpu")
    assert (device_hour_usd(api()), device_kind(api())) == (0.0, None)
    # 10 s on a $0.36/h host at full load: $0.001
    cost = request_cost(cpu, Usage(prompt_tokens=10, completion_tokens=10), 10.0, 1.0)
    assert cost.total_usd == pytest.approx(0.001) and cost.basis == "gpu_amortized"


def test_cpu_hour_usd_is_validated() -> None:
    from gateway.policy import PolicyError

    with pytest.raises(PolicyError, match="either per CPU host"):
        parse_policy("""\
backends:
  e: {kind: engine, api_base: "http://h/v1", model: m, cpu_hour_usd: 0.4, gpu_hour_usd: 2.5}
routes:
  r: {backend: e}
""", "c.yaml")
    with pytest.raises(PolicyError, match="'cpu_hour_usd' applies only to engine backends"):
        parse_policy("""\
backends:
  a: {kind: litellm, model: openai/gpt-4o-mini, cpu_hour_usd: 0.4}
routes:
  r: {backend: a}
""", "c.yaml")
    ok = parse_policy("""\
backends:
  e: {kind: engine, api_base: "http://h/v1", model: m, cpu_hour_usd: 0.4}
routes:
  r: {backend: e}
""", "c.yaml")
    assert ok.backends["e"].cpu_hour_usd == 0.4


def test_policy_warns_about_an_engine_without_a_device_price() -> None:
    policy = parse_policy("""\
backends:
  e: {kind: engine, api_base: "http://h/v1", model: m}
routes:
  r: {backend: e}
""", "w.yaml")
    assert any("backends.e: no device price" in w and "no_device_price" in w for w in policy_warnings(policy))


def test_charge_fills_the_attribution_columns(map_entry: dict) -> None:
    from datetime import UTC, datetime

    from gateway.ledger.record import LedgerRecord
    from gateway.pricing import NOTE_DEVICE_SECONDS_ESTIMATED, charge

    policy = parse_policy(POLICY, "t.yaml")
    usage = Usage(prompt_tokens=1000, completion_tokens=100, cached_prompt_tokens=600)
    row = LedgerRecord(request_id="r1", created_at=datetime.now(UTC))
    charge(row, policy.backends["mini"], usage, None, None, policy, policy.routes["demo"])
    saved = 600 * (map_entry["input_cost_per_token"] - map_entry["cache_read_input_token_cost"])
    assert row.cache_savings_usd == pytest.approx(saved) and saved > 0
    assert (row.device_hour_usd, row.device_kind, row.gpu_seconds, row.cost_note) == (None, None, None, None)

    row = LedgerRecord(request_id="r2", created_at=datetime.now(UTC))
    charge(row, policy.backends["local"], usage, 1.5, 0.25, policy, policy.routes["demo"], estimated=True)
    assert (row.device_hour_usd, row.device_kind, row.utilisation, row.gpu_seconds) == (2.5, "gpu", 0.25, 1.5)
    assert row.cost_usd == pytest.approx(1.5 * 2.5 / 3600 / 0.25)
    assert row.cost_note == NOTE_DEVICE_SECONDS_ESTIMATED
