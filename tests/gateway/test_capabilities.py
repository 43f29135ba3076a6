"""Capabilities: what a request needs, what a backend can do (declared or derived), and routing around it."""
from __future__ import annotations

import pytest

from gateway import capabilities
from gateway.policy import parse_policy
from gateway.policy_warnings import policy_warnings
from gateway.routing import Decision, fit_capabilities
from openai_wire import APIError

POLICY = """\
backends:
  engine: {kind: engine, model: m, api_base: "http://127.0.0.1:9/v1", gpu_hour_usd: 1}
  vision: {kind: litellm, model: openai/gpt-4o-mini}
  small-ctx:
    kind: litellm
    model: openai/custom-thing
    input_usd_per_mtok: 1
    output_usd_per_mtok: 1
    capabilities: {tools: false, max_context: 50}
  embedder: {kind: litellm, model: openai/text-embedding-3-small}
routes:
  fixed-engine: {backend: engine, fallbacks: [vision]}
  fixed-vision: {backend: vision, fallbacks: [engine, small-ctx]}
  fixed-alone: {backend: engine}
  auto: {strategy: difficulty, easy: engine, hard: vision}
  auto-none: {strategy: difficulty, easy: engine, hard: small-ctx}
"""
IMAGE = [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                      {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def policy():
    return parse_policy(POLICY, "caps.yaml")


def test_needs() -> None:
    assert capabilities.needs({"messages": [{"role": "user", "content": "hi"}]}) == frozenset()
    assert capabilities.needs({"messages": IMAGE}) == {"images"}
    assert capabilities.needs({"tools": TOOLS}) == {"tools"}
    assert capabilities.needs({"tools": TOOLS, "tool_choice": "none"}) == frozenset()
    assert capabilities.needs({"response_format": {"type": "json_object"}}) == {"json_mode"}
    assert capabilities.needs({"response_format": {"type": "json_schema", "json_schema": {}}}) == {"structured_output"}
    assert capabilities.needs({"response_format": {"type": "text"}}) == frozenset()


def test_derived_and_declared(policy) -> None:
    import litellm

    entry = litellm.model_cost["gpt-4o-mini"]
    vision = capabilities.of(policy.backends["vision"])
    assert (vision.tools, vision.structured_output, vision.images) == (
        entry["supports_function_calling"], entry["supports_response_schema"], entry["supports_vision"])
    assert vision.max_context == entry["max_input_tokens"]
    engine = capabilities.of(policy.backends["engine"])
    assert (engine.tools, engine.structured_output, engine.images, engine.max_context) == (True, True, False, None)
    declared = capabilities.of(policy.backends["small-ctx"])  # unknown to litellm: all but the declared
    assert (declared.tools, declared.images, declared.max_context) == (False, True, 50)
    embedder = capabilities.of(policy.backends["embedder"])  # an embedding model chats with nothing
    assert not (embedder.tools or embedder.structured_output or embedder.images)


def decision(policy, route: str) -> Decision:
    r = policy.routes[route]
    chain = r.chain() if r.strategy == "fixed" else [r.easy, r.hard]
    return Decision(chain=chain, reason="fixed" if r.strategy == "fixed" else "difficulty_easy")


def test_a_fixed_route_whose_backend_cannot_skips_to_a_fallback_that_can(policy) -> None:
    # issue 31 #11: this was a 400 although the fallback has images
    d = decision(policy, "fixed-engine")
    fit_capabilities(policy.routes["fixed-engine"], d, policy, {"messages": IMAGE})
    assert (d.chain, d.reason) == (["vision"], "capability")


def test_a_fixed_route_where_no_backend_can_is_a_400_naming_it(policy) -> None:
    d = decision(policy, "fixed-alone")
    with pytest.raises(APIError) as err:
        fit_capabilities(policy.routes["fixed-alone"], d, policy, {"messages": IMAGE})
    assert err.value.status == 400 and err.value.code == "unsupported_capability"
    assert err.value.param == "messages" and "'engine', which does not support images" in str(err.value)


def test_incapable_fallbacks_leave_the_chain(policy) -> None:
    d = decision(policy, "fixed-vision")
    fit_capabilities(policy.routes["fixed-vision"], d, policy, {"messages": IMAGE, "tools": TOOLS})
    assert d.chain == ["vision"] and d.reason == "fixed"
    d = decision(policy, "fixed-vision")
    fit_capabilities(policy.routes["fixed-vision"], d, policy, {"messages": [{"role": "user", "content": "x" * 400}]})
    assert d.chain == ["vision", "engine"]  # ~100 tokens: more than small-ctx's 50


def test_a_difficulty_route_escalates_with_reason_capability(policy) -> None:
    d = decision(policy, "auto")
    fit_capabilities(policy.routes["auto"], d, policy, {"messages": IMAGE})
    assert (d.chain, d.reason) == (["vision"], "capability")
    d = decision(policy, "auto")
    fit_capabilities(policy.routes["auto"], d, policy, {"messages": [{"role": "user", "content": "hi"}]})
    assert (d.chain, d.reason) == (["engine", "vision"], "difficulty_easy")
    d = decision(policy, "auto-none")
    with pytest.raises(APIError, match="no backend of the route does"):
        fit_capabilities(policy.routes["auto-none"], d, policy, {"messages": IMAGE, "tools": TOOLS})


def test_policy_check_warns_about_fallbacks_that_lack_the_primarys_capabilities(policy) -> None:
    warnings = policy_warnings(policy)
    assert any("routes.fixed-vision: fallback 'engine' lacks images that 'vision' has" in w for w in warnings)
    assert any("routes.fixed-vision: fallback 'small-ctx' lacks tools" in w for w in warnings)
    assert not any("routes.fixed-engine:" in w for w in warnings)


def test_embeddings_are_derived_from_the_model_map_and_declarable(policy) -> None:
    import litellm

    assert litellm.model_cost["text-embedding-3-small"]["mode"] == "embedding"
    assert litellm.model_cost["gpt-4o-mini"]["mode"] == "chat"
    assert capabilities.needs({"model": "m", "input": "hi"}, "embeddings") == {"embeddings"}
    assert capabilities.of(policy.backends["embedder"]).embeddings  # mode: embedding
    assert not capabilities.of(policy.backends["vision"]).embeddings  # gpt-4o-mini: a chat model
    assert not capabilities.of(policy.backends["engine"]).embeddings
    assert capabilities.of(policy.backends["small-ctx"]).embeddings  # unknown to litellm: not known not to
    declared = parse_policy(POLICY.replace("gpu_hour_usd: 1}", "gpu_hour_usd: 1, capabilities: {embeddings: true}}"),
                            "caps.yaml")
    assert capabilities.of(declared.backends["engine"]).embeddings
    d = decision(policy, "fixed-engine")
    with pytest.raises(APIError) as err:
        fit_capabilities(policy.routes["fixed-engine"], d, policy, {"model": "m", "input": "hi"}, "embeddings")
    assert err.value.code == "unsupported_capability" and err.value.param == "model"
    assert "'engine', which does not serve embeddings" in str(err.value)
