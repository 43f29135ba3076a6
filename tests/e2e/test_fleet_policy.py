"""Engine fleets in the policy (`api_bases:`, `balance:`) and the fleet's prefix index: bounded and expiring."""
from __future__ import annotations

import textwrap

import pytest

from gateway.fleet import PrefixIndex, prompt_blocks
from gateway.policy import PolicyError, parse_policy

ROUTES = """
routes:
  chat:
    backend: fleet
"""


def _parse(backend: str):
    return parse_policy(textwrap.dedent("backends:\n  fleet:\n" + textwrap.indent(textwrap.dedent(backend), "    "))
                        + ROUTES, "policy.yaml")


def _problems(backend: str) -> str:
    with pytest.raises(PolicyError) as caught:
        _parse(backend)
    return str(caught.value)


def test_a_fleet_policy_parses_with_documented_defaults() -> None:
    spec = _parse("""
        kind: engine
        model: m
        api_bases: [http://10.0.0.1:8100/v1, http://10.0.0.2:8100/v1]
    """).backends["fleet"]
    assert spec.api_bases == ["http://10.0.0.1:8100/v1", "http://10.0.0.2:8100/v1"]
    assert spec.balance is None  # the fleet uses BalanceSpec()'s defaults
    tuned = _parse("""
        kind: engine
        model: m
        api_bases: [http://10.0.0.1:8100/v1]
        balance: {strategy: least_loaded, balance_abs_threshold: 8}
    """).backends["fleet"].balance
    assert tuned.strategy == "least_loaded" and tuned.balance_abs_threshold == 8 and tuned.balance_rel_threshold == 1.5


@pytest.mark.parametrize(("backend", "expected"), [
    ("kind: engine\nmodel: m\napi_bases: [http://a:1/v1, ftp://b/v1]\n",
     "backends.fleet.api_bases[1]: 'ftp://b/v1' is not an http(s) URL"),
    ("kind: engine\nmodel: m\napi_bases: [http://a:1/v1, http://a:1/v1/]\n", "is listed twice"),
    ("kind: engine\nmodel: m\napi_base: http://a:1/v1\napi_bases: [http://b:1/v1]\n",
     "'api_base' and 'api_bases' are exclusive"),
    ("kind: engine\nmodel: m\nlaunch: embedded\napi_bases: [http://b:1/v1]\n",
     "an embedded engine is started by the gateway and has no api_bases"),
    ("kind: litellm\nmodel: openai/x\napi_bases: [http://b:1/v1]\n", "'api_bases' applies only to engine backends"),
    ("kind: engine\nmodel: m\napi_base: http://a:1/v1\nbalance: {strategy: round_robin}\n",
     "'balance' applies only to a fleet"),
    ("kind: engine\nmodel: m\napi_bases: []\n", "backends.fleet.api_bases: List should have at least 1 item"),
    ("kind: engine\nmodel: m\napi_base: http://a:1/v1\nreplicas: 2\n",
     "'replicas' is how many engines the gateway starts (`launch: embedded`)"),
    ("kind: engine\nmodel: m\nlaunch: embedded\nreplicas: 2\nengine_port: 8100\n",
     "several replicas cannot share one engine_port"),
    ("kind: engine\nmodel: m\nlaunch: embedded\nreplicas: 0\n",
     "backends.fleet.replicas: Input should be greater than or equal to 1"),
    ("kind: engine\nmodel: m\napi_bases: [http://a:1/v1]\nbalance: {strategy: random}\n",
     "cache_aware"),
    ("kind: engine\nmodel: m\napi_bases: [http://a:1/v1]\nbalance: {block_size: 16}\n",
     "backends.fleet.balance.block_size: unknown field 'block_size'"),
    ("kind: engine\nmodel: m\napi_bases: [http://a:1/v1]\nbalance: {balance_rel_threshold: 0.5}\n",
     "balance_rel_threshold"),
])
def test_bad_fleet_settings_are_refused_with_the_field_and_fix(backend: str, expected: str) -> None:
    assert expected in _problems(backend)


def test_block_hashes_are_chained_so_a_later_turn_extends_an_earlier_one() -> None:
    turn1 = {"messages": [{"role": "system", "content": "s" * 300}, {"role": "user", "content": "q1"}]}
    turn2 = {"messages": [*turn1["messages"], {"role": "assistant", "content": "a1"},
                          {"role": "user", "content": "q2" * 100}]}
    first, _ = prompt_blocks(turn1, "chat", 64, 256)
    second, size = prompt_blocks(turn2, "chat", 64, 256)
    assert second[:len(first)] == first and len(second) > len(first)
    other, _ = prompt_blocks({"messages": [{"role": "system", "content": "t" + "s" * 299}]}, "chat", 64, 256)
    assert other[0] != first[0] and not set(other) & set(first)  # one changed byte: every later block differs
    assert len(prompt_blocks(turn2, "chat", 64, 3)[0]) == 3 and size > 64 * 3


def test_the_prefix_index_is_bounded_and_expires() -> None:
    index = PrefixIndex(capacity=100, ttl_s=10.0)
    hashes = list(range(1000))
    index.add(hashes, now=0.0)
    assert len(index) == 100  # the most recent 100
    assert index.matched(hashes, now=1.0) == 0 and index.matched(hashes[900:], now=1.0) == 100
    assert index.matched(hashes[900:], now=11.0) == 0  # expired
    index.add([5, 6], now=20.0)
    assert len(index) == 2  # expired entries are dropped when new ones come
