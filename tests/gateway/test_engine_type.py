"""`engine_type` on an engine backend (issue 32 item 3): which server answers there, validated with a fix."""
from __future__ import annotations

import pytest

from gateway.policy import PolicyError, parse_policy

BASE = """\
backends:
  e:
    kind: engine
    model: smollm2
{extra}
routes:
  r:
    backend: e
"""


def policy(extra: str):
    return parse_policy(BASE.format(extra=extra), "p.yaml")


def error(extra: str) -> str:
    with pytest.raises(PolicyError) as exc:
        policy(extra)
    return str(exc.value)


def test_default_is_switchyard() -> None:
    assert policy("    api_base: http://127.0.0.1:8100/v1").backends["e"].engine_type == "switchyard"


@pytest.mark.parametrize("kind", ["switchyard", "vllm", "sglang", "llamacpp"])
def test_each_engine_type_is_accepted(kind: str) -> None:
    p = policy(f"    api_base: http://127.0.0.1:8100/v1\n    engine_type: {kind}")
    assert p.backends["e"].engine_type == kind


def test_unknown_engine_type_names_the_choices() -> None:
    msg = error("    api_base: http://127.0.0.1:8100/v1\n    engine_type: llama.cpp")
    assert "engine_type" in msg
    for kind in ("switchyard", "vllm", "sglang", "llamacpp"):
        assert kind in msg


def test_foreign_engine_cannot_be_embedded() -> None:
    msg = error("    launch: embedded\n    engine_type: vllm")
    assert "launches only its own engine" in msg and "api_base" in msg


def test_foreign_engine_takes_no_engine_args() -> None:
    msg = error("    api_base: http://127.0.0.1:8100/v1\n    engine_type: llamacpp\n    engine_args: {max-num-seqs: 4}")
    assert "engine_args" in msg and "llamacpp" in msg


def test_engine_type_on_a_litellm_backend_is_refused() -> None:
    text = """\
backends:
  api:
    kind: litellm
    model: openai/gpt-4o-mini
    engine_type: vllm
routes:
  r:
    backend: api
"""
    with pytest.raises(PolicyError) as exc:
        parse_policy(text, "p.yaml")
    assert "'engine_type' applies only to engine backends" in str(exc.value)


def test_a_foreign_fleet_is_accepted() -> None:
    p = policy("    engine_type: sglang\n    api_bases: [http://127.0.0.1:30000/v1, http://127.0.0.1:30001/v1]")
    assert p.backends["e"].engine_type == "sglang"


def test_the_backend_class_follows_engine_type() -> None:
    import asyncio

    from gateway.backends import build_backend
    from gateway.backends.engine_backend import EngineBackend
    from gateway.backends.engines import probe_url
    from gateway.backends.llamacpp import LlamaCppBackend

    llama = build_backend(policy("    api_base: http://127.0.0.1:8080/v1\n    engine_type: llamacpp").backends["e"])
    assert isinstance(llama, LlamaCppBackend) and probe_url(llama) == "http://127.0.0.1:8080/health"
    vllm = build_backend(policy("    api_base: http://127.0.0.1:8000/v1\n    engine_type: vllm").backends["e"])
    assert type(vllm) is EngineBackend and probe_url(vllm) == "http://127.0.0.1:8000/metrics"
    fleet = build_backend(policy("    engine_type: llamacpp\n    api_bases: [http://127.0.0.1:8080/v1, "
                                 "http://127.0.0.1:8081/v1]").backends["e"])
    try:
        assert all(isinstance(r.backend, LlamaCppBackend) for r in fleet.replicas)
        assert len({id(r.backend.clock) for r in fleet.replicas}) == 2  # one clock per server
    finally:
        asyncio.run(fleet.aclose())
