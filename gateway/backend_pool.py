"""The live Backend objects for the current policy, rebuilt only where a spec changed."""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

from gateway.backends import build_backend
from gateway.backends.base import Backend, Usage
from gateway.embedded import EmbeddedEngines
from gateway.policy import BackendSpec, Policy

log = logging.getLogger("switchyard.backends")

_EMA_WEIGHT = 0.1


@dataclass(slots=True)
class _DeviceRate:
    """Device-seconds per token, learned from completed engine requests (to price cut-off streams)."""

    per_token: float | None = None

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0:
            return
        rate = seconds / tokens
        self.per_token = rate if self.per_token is None else (1 - _EMA_WEIGHT) * self.per_token + _EMA_WEIGHT * rate


class BackendPool:
    def __init__(self, embedded: EmbeddedEngines) -> None:
        self._embedded = embedded
        self._backends: dict[str, Backend] = {}
        self._specs: dict[str, BackendSpec] = {}
        self._rates: dict[str, _DeviceRate] = {}

    async def sync(self, policy: Policy) -> None:
        """Match the backends to a (new) policy: start embedded engines, build clients, close stale ones."""
        bases = await self._embedded.sync(policy)
        wanted: dict[str, BackendSpec] = {}
        for name, spec in policy.backends.items():
            if spec.name in bases:
                spec = spec.model_copy(update={"api_base": bases[spec.name]})
            elif (replicas := self._embedded.fleet_bases(spec.name)) is not None:  # `replicas: N` (gateway/fleet.py)
                spec = spec.model_copy(update={"api_bases": replicas})
            wanted[name] = spec
        stale = []
        for name, spec in wanted.items():
            if self._specs.get(name) != spec:
                if name in self._backends:
                    stale.append(self._backends[name])
                self._backends[name] = build_backend(spec)
                self._specs[name] = spec
        for name in set(self._backends) - set(wanted):
            stale.append(self._backends.pop(name))
            self._specs.pop(name, None)
        for backend in stale:
            try:
                await backend.aclose()
            except Exception as exc:  # noqa: BLE001 — closing a dead client must not stop the swap
                log.warning("closing backend %s failed: %s", backend.name, exc)

    def chain(self, names: list[str]) -> list[Backend]:
        return [self._backends[name] for name in names if name in self._backends]

    def get(self, name: str) -> Backend | None:
        return self._backends.get(name)

    def retry_after_s(self, name: str) -> float | None:
        """Seconds until `name` may serve, for an embedded engine not serving yet; None for any other backend."""
        return self._embedded.retry_after_s(name)

    def observe_device_seconds(self, name: str, usage: Usage, seconds: float) -> None:
        self._rates.setdefault(name, _DeviceRate()).observe(usage.prompt_tokens + usage.completion_tokens, seconds)

    def estimate_device_seconds(self, name: str, usage: Usage) -> float | None:
        rate = self._rates.get(name)
        if rate is None or rate.per_token is None:
            return None
        return rate.per_token * (usage.prompt_tokens + usage.completion_tokens)

    async def aclose(self) -> None:
        for backend in self._backends.values():
            try:
                await backend.aclose()
            except Exception as exc:  # noqa: BLE001 — shut the rest down regardless
                log.warning("closing backend %s failed: %s", backend.name, exc)
        self._backends.clear()
        self._specs.clear()
        await self._embedded.stop_all()
        if "gateway.backends.litellm_backend" in sys.modules:
            await sys.modules["gateway.backends.litellm_backend"].stop_litellm_workers()
