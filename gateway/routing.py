"""Turns a route and a request into an ordered chain of backends to try, with the reason."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.policy import RouteSpec

if TYPE_CHECKING:
    from gateway.app import Gateway


@dataclass(slots=True)
class Decision:
    chain: list[str]  # backend names, first choice first
    reason: str  # fixed | difficulty_easy | difficulty_hard | …
    difficulty: float | None = None
    threshold: float | None = None


def decide(route: RouteSpec, body: dict, gw: Gateway | None = None) -> Decision:
    """Fixed routes go to their backend, then their fallbacks, in order."""
    chain = [route.backend, *[name for name in route.fallbacks if name != route.backend]]
    return Decision(chain=chain, reason="fixed")
