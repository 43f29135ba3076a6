"""Warnings about a valid policy: what it allows but probably does not intend (an API model litellm cannot
price, an engine without a device price, an unset key variable, a fallback that lacks what its primary can do).

Apart from gateway/policy.py because the checks need pricing and capabilities, which read the policy's types:
the schema imports neither, so nothing here leads back to it.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.policy import Policy, RouteSpec


def policy_warnings(policy: Policy) -> list[str]:
    """Things that are valid but probably not intended (unpriced API models, unset key variables)."""
    import os

    from gateway.pricing import device_hour_usd, prices_for

    out = []
    for name, b in policy.backends.items():
        if b.kind == "litellm" and prices_for(b) is None:
            out.append(f"{policy.source}: backends.{name}: litellm has no price for '{b.model}'; its requests "
                       "would be logged at $0 (flagged `unpriced_model`) — set input_usd_per_mtok and "
                       "output_usd_per_mtok")
        if b.kind == "engine" and not device_hour_usd(b):
            out.append(f"{policy.source}: backends.{name}: no device price (`gpu_hour_usd` or `cpu_hour_usd`); "
                       "its requests would be logged at $0 (flagged `no_device_price`) and reports cannot "
                       "compare hosting with buying")
        if b.api_key_env and b.api_key_env not in os.environ:
            out.append(f"{policy.source}: backends.{name}: environment variable {b.api_key_env} is not set "
                       "(requests to this backend will fail until it is)")
    for name, r in policy.routes.items():
        out.extend(_fallback_capability_warnings(policy, name, r))
        if r.model_path is not None and not Path(r.model_path).is_file():
            out.append(f"{policy.source}: routes.{name}: model_path {r.model_path} is not a file (relative paths "
                       f"are read from {Path.cwd()}); the route sends every request to '{r.backend}' until it is")
    return out


def _fallback_capability_warnings(policy: Policy, name: str, route: RouteSpec) -> list[str]:
    """A fallback that lacks what the route's primary backend can do will not take such requests over."""
    from gateway.capabilities import FEATURES
    from gateway.capabilities import of as capabilities_of

    primary = route.backend if route.strategy == "fixed" else (route.easy or route.backend)
    if primary not in policy.backends:
        return []
    has = capabilities_of(policy.backends[primary])
    out = []
    for fallback in route.fallbacks:
        if fallback not in policy.backends:
            continue
        other = capabilities_of(policy.backends[fallback])
        lacking = [f for f in FEATURES if getattr(has, f) and not getattr(other, f)]
        if lacking:
            out.append(f"{policy.source}: routes.{name}: fallback '{fallback}' lacks {', '.join(lacking)} that "
                       f"'{primary}' has; requests that need them will not fall back to it")
    return out
