"""Each backend's health as `/health` and `/metrics` report it, and whether every route can be served.

A backend is `up`, `starting`, `down` or `circuit_open`:
- `circuit_open`: its circuit breaker is open (or half-open, waiting for its probe), whatever its kind;
- an embedded engine is `starting` from its launch until its /health first answers (requests skip it meanwhile);
- an engine is `down` when the gateway's supervisor has no live, healthy child for it (`launch: embedded`: a
  crash, waiting out the restart backoff) or its `/metrics` does not answer the load monitor
  (gateway/engine_load.py: unknown or stale);
- a litellm backend (a hosted API) is `up` unless its breaker is open: the gateway never probes a provider.

The gateway is `degraded` when some route has no `up` backend among all it may use (backend, easy, hard and
fallbacks); `/health` still answers 200 then, so a load balancer can choose (the body says what is down).
`engines` (engine_details) says, per embedded engine, its state, restarts and how its last run ended: the exit
code and the tail of its stderr (redacted: /health needs no key), e.g. argparse's "unrecognized arguments".
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from gateway import fleet
from gateway.backends.resilience import BreakerState

if TYPE_CHECKING:
    from gateway.backends.resilience import BreakerRegistry
    from gateway.embedded import EmbeddedEngines
    from gateway.engine_load import EngineLoadMonitor
    from gateway.policy import Policy, RouteSpec

BackendHealth = Literal["up", "starting", "down", "circuit_open"]


def backend_states(policy: Policy, breakers: BreakerRegistry, load: EngineLoadMonitor,
                   embedded: EmbeddedEngines) -> dict[str, BackendHealth]:
    processes = embedded.processes()
    states: dict[str, BackendHealth] = {}
    for name, spec in policy.backends.items():
        if name in breakers and breakers[name].state is not BreakerState.CLOSED:
            states[name] = "circuit_open"
        elif (fleet_up := fleet.serving(name)) is not None:  # an engine fleet: up while a replica is admitted
            states[name] = "up" if fleet_up else "down"
        elif name in processes and processes[name].state == "starting":
            states[name] = "starting"
        elif spec.kind == "engine" and (
                (name in processes and (processes[name].pid is None or processes[name].state != "up"))
                or not load.get(name).known):
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


def engine_details(embedded: EmbeddedEngines, policy: Policy) -> dict[str, dict]:
    """Per embedded engine: state, pid, restarts and `last_exit` (code, when, how long it ran, stderr tail)."""
    from gateway.redact import configured_secrets, redact

    secrets = configured_secrets(spec.api_key_env for spec in policy.backends.values())
    out = {}
    for name, process in embedded.processes().items():
        details = process.details()
        if details["last_exit"] is not None:
            details["last_exit"]["stderr_tail"] = [redact(line, secrets) for line in details["last_exit"]["stderr_tail"]]
        out[name] = details
    return out
