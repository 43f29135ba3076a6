"""The backend class of an engine backend's `engine_type` (gateway/policy.py): our engine's, or a foreign one's.

vLLM and SGLang answer like our engine does on the request path (their device time comes from their metrics,
read apart); llama.cpp's server puts its own per-request `timings` in each answer (gateway/backends/llamacpp.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.backends.engine_backend import EngineBackend
from gateway.backends.llamacpp import HEALTH_PATH, LlamaCppBackend
from gateway.engine_load import metrics_url

if TYPE_CHECKING:
    from gateway.policy import BackendSpec

__all__ = ["engine_backend", "probe_url"]


def engine_backend(spec: BackendSpec, api_base: str | None = None) -> EngineBackend:
    """One engine (one replica of a fleet) at api_base, or at the spec's api_base."""
    if spec.engine_type == "llamacpp":
        return LlamaCppBackend(spec, api_base)
    return EngineBackend(spec, api_base)


def probe_url(backend: EngineBackend) -> str:
    """What a fleet's health probe fetches: /metrics (our engine's load; vLLM and SGLang serve one too), or
    llama-server's /health (its /metrics exists only with --metrics and names none of our load figures)."""
    if isinstance(backend, LlamaCppBackend):
        return backend.root + HEALTH_PATH
    return metrics_url(backend.api_base)
