"""Test policies built from parts (a backend, a route) instead of YAML written out in every e2e file.

    policy(backends={"eng": engine(standin, gpu_hour_usd=3.6)}, routes={"local": fixed("eng")})

gives the YAML text `run_gateway` takes; any other policy key (`budgets:`, a route's `fallbacks`, a backend's
`max_retries`) is one more keyword. The gateway parses it as any policy file: nothing here checks it.
"""
from __future__ import annotations

from typing import Any

import yaml

from gateway.listen_address import free_port

STANDIN_KEY_ENV = "STANDIN_API_KEY"  # what the `standin` fixture sets


def engine(api_base: str, model: str = "demo-model", **fields: Any) -> dict[str, Any]:
    """An engine-kind backend (our engine's API, or a stand-in speaking it) at `api_base`."""
    return {"kind": "engine", "model": model, "api_base": api_base, **fields}


def fleet(api_bases: list[str], model: str = "demo-model", **fields: Any) -> dict[str, Any]:
    """An engine-kind backend over several replicas (`api_bases`), balanced by the gateway."""
    return {"kind": "engine", "model": model, "api_bases": list(api_bases), **fields}


def embedded(model_path: object, model: str = "tiny", **fields: Any) -> dict[str, Any]:
    """An engine the gateway starts itself (`launch: embedded`) from the checkpoint at `model_path`."""
    return {"kind": "engine", "launch": "embedded", "model": model, "engine_model_path": str(model_path), **fields}


def litellm(api_base: str, model: str = "openai/gpt-4o-mini", **fields: Any) -> dict[str, Any]:
    """A litellm-kind backend at `api_base`, its key in $STANDIN_API_KEY."""
    return {"kind": "litellm", "model": model, "api_base": api_base, "api_key_env": STANDIN_KEY_ENV, **fields}


def dead(**fields: Any) -> dict[str, Any]:
    """An engine-kind backend at a port nothing listens on, failing fast (no retry, a 0.5 s connect timeout)."""
    return engine(f"http://127.0.0.1:{free_port()}/v1", model="nobody",
                  **{"max_retries": 0, "connect_timeout_s": 0.5, **fields})


def fixed(backend: str, **fields: Any) -> dict[str, Any]:
    """A fixed route to `backend` (fallbacks, counterfactual, … as keywords)."""
    return {"strategy": "fixed", "backend": backend, **fields}


def difficulty(easy: str, hard: str, model_path: object, threshold: float = 0.5, **fields: Any) -> dict[str, Any]:
    """A difficulty route: `easy` below `threshold`, `hard` at or above it, scored by the model at `model_path`."""
    return {"strategy": "difficulty", "easy": easy, "hard": hard, "threshold": threshold,
            "model_path": str(model_path), **fields}


def one_engine_route(api_base: str) -> str:
    """The smallest gateway the fault tests need: route `local` to engine backend `eng` at `api_base`."""
    return policy(backends={"eng": engine(api_base, gpu_hour_usd=3.6)}, routes={"local": fixed("eng")})


def policy(backends: dict[str, dict[str, Any]], routes: dict[str, dict[str, Any]], **top: Any) -> str:
    """The policy's YAML text."""
    return yaml.safe_dump({"backends": backends, "routes": routes, **top}, sort_keys=False)
