"""`/v1/models` entries: each route of the live policy as an OpenAI model object, with what it can serve.

Besides OpenAI's fields, an entry carries `context_length` (the largest prompt, in tokens, some backend of the
route is known to accept: the policy's `capabilities.max_context`, else litellm's model map; null when no
backend's is known, e.g. an engine the policy does not size) and `capabilities`: what some backend of the route
can do (routing sends each request to a backend of the route that can serve it, gateway/capabilities.py), out of
chat, completions, responses, embeddings, tools, json_mode, json_schema, vision.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gateway import capabilities, pricing

if TYPE_CHECKING:
    from gateway.policy import BackendSpec, Policy, RouteSpec

_FEATURE_NAMES = (("tools", "tools"), ("json_mode", "json_mode"), ("structured_output", "json_schema"),
                  ("images", "vision"))
ORDER = ("chat", "completions", "responses", "embeddings", "tools", "json_mode", "json_schema", "vision")


def route_backends(route: RouteSpec) -> list[str]:
    names: list[str] = []
    for name in (route.backend, route.easy, route.hard, *route.fallbacks):
        if name is not None and name not in names:
            names.append(name)
    return names


def _backend_features(spec: BackendSpec) -> tuple[set[str], int | None]:
    caps = capabilities.of(spec)
    info = pricing.model_info(spec.model) if spec.kind == "litellm" else None
    found: set[str] = set()
    if not (info is not None and info.get("mode") == "embedding"):
        found |= {"chat", "completions", "responses"}
    if caps.embeddings:
        found.add("embeddings")
    if "chat" in found:
        found |= {label for attr, label in _FEATURE_NAMES if getattr(caps, attr)}
    return found, caps.max_context


def entry(name: str, route: RouteSpec, policy: Policy, created: int) -> dict[str, Any]:
    features: set[str] = set()
    contexts: list[int] = []
    for backend in route_backends(route):
        spec = policy.backends.get(backend)
        if spec is None:
            continue
        found, context = _backend_features(spec)
        features |= found
        if context is not None:
            contexts.append(int(context))
    return {"id": name, "object": "model", "created": created, "owned_by": "switchyard",
            "context_length": max(contexts) if contexts else None,
            "capabilities": [f for f in ORDER if f in features]}
