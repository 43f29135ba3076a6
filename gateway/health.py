"""Each backend's health as `/health` and `/metrics` report it, and whether every route can be served.

A backend is `up`, `down` or `circuit_open`:
- `circuit_open`: its circuit breaker is open (or half-open, waiting for its probe), whatever its kind;
- an engine is `down` when the gateway's supervisor has no live child for it (`launch: embedded`) or its
  `/metrics` does not answer the load monitor (gateway/engine_load.py: unknown or stale);
- a litellm backend (a hosted API) is `up` unless its breaker is open: the gateway never probes a provider.

The gateway is `degraded` when some route has no `up` backend among all it may use (backend, easy, hard and
fallbacks); `/health` still answers 200 then, so a load balancer can choose (the body says what is down).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from gateway.backends.resilience import BreakerState

if TYPE_CHECKING:
    from gateway.backends.resilience import BreakerRegistry
    from gateway.embedded import EmbeddedEngines
    from gateway.engine_load import EngineLoadMonitor
    from gateway.policy import Policy, RouteSpec

BackendHealth = Literal["up", "down", "circuit_open"]


def backend_states(policy: Policy, breakers: BreakerRegistry, load: EngineLoadMonitor,
                   embedded: EmbeddedEngines) -> dict[str, BackendHealth]:
    processes = embedded.processes()
    states: dict[str, BackendHealth] = {}
    for name, spec in policy.backends.items():
        if name in breakers and breakers[name].state is not BreakerState.CLOSED:
            states[name] = "circuit_open"
        elif spec.kind == "engine" and (
                (name in processes and processes[name].pid is None) or not load.get(name).known):
            states[name] = "down"
        else:
            states[name] = "up"
    return states


def route_backends(route: RouteSpec) -> list[str]:
    names = [route.backend, route.easy, route.hard, *route.fallbacks]
    return list(dict.fromkeys(n for n in names if n))


def unserved_routes(policy: Policy, states: dict[str, BackendHealth]) -> list[str]:
    """Routes none of whose backends is up."""
    return [name for name, route in policy.routes.items()
            if not any(states.get(b) == "up" for b in route_backends(route))]
