"""Backends: where the gateway sends requests. `build_backend(spec)` makes the right one for a policy entry."""
from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.backends.base import Backend, Completion, StreamTally, UpstreamError, Usage, usage_from_chunk
from gateway.backends.resilience import (
    BreakerRegistry,
    BreakerState,
    CircuitBreaker,
    complete_with_fallbacks,
    open_stream_with_fallbacks,
)

if TYPE_CHECKING:
    from gateway.policy import BackendSpec

__all__ = ["Backend", "BreakerRegistry", "BreakerState", "CircuitBreaker", "Completion", "StreamTally",
           "UpstreamError", "Usage", "build_backend", "complete_with_fallbacks", "open_stream_with_fallbacks",
           "usage_from_chunk"]


def build_backend(spec: BackendSpec, api_base: str | None = None) -> Backend:
    """The backend for a policy entry. `api_base` is for embedded engines, whose URL the gateway knows only
    once it has started them; otherwise the spec's api_base is used. litellm is imported only when needed."""
    if spec.kind == "engine" and spec.api_bases and api_base is None:
        from gateway.fleet import FleetBackend  # several replicas, one chosen per request

        return FleetBackend(spec)
    if spec.kind == "engine":
        from gateway.backends.engines import engine_backend  # by engine_type (ours, llama.cpp's, ...)

        if api_base is None and spec.api_base is None and spec.engine_port is not None:
            api_base = f"http://127.0.0.1:{spec.engine_port}/v1"
        return engine_backend(spec, api_base)
    from gateway.backends.litellm_backend import LiteLLMBackend

    return LiteLLMBackend(spec)
