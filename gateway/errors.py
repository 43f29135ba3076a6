"""The gateway's OpenAI errors: factories for the status codes clients expect.

The exception type and its body are `openai_wire.APIError` (shared with the engine). Code that refuses a request
raises one; `answer` is the one place it becomes a response (the Starlette app's exception handler, and the hot
path's, gateway/hot_path.py).
"""
from __future__ import annotations

from typing import Any

from openai_wire import APIError
from openai_wire.responses import error_response

__all__ = ["APIError", "answer", "authentication", "backend_misconfigured", "circuit_open", "clip", "engine_starting", "invalid_request", "model_not_found",
           "quota_exceeded", "rate_limited", "request_too_large", "upstream_failed", "upstream_rejected"]

ECHO_CHARS = 64  # a client's string echoed in an error message is cut to this many characters


async def answer(request: Any, exc: Exception) -> Any:
    """An APIError as its OpenAI error response: the exception handler of the gateway's app (Starlette's
    signature; `request` is unused)."""
    assert isinstance(exc, APIError)
    return error_response(exc)


def clip(value: object, limit: int = ECHO_CHARS) -> str:
    """`value` as text of at most `limit` characters ("…" marks a cut): for echoing and storing client strings."""
    text = value if isinstance(value, str) else str(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, type="invalid_request_error", param=param, code=code)


def authentication(message: str) -> APIError:
    return APIError(401, message, type="authentication_error", code="invalid_api_key")


def model_not_found(model: str, known: list[str]) -> APIError:
    names = ", ".join(sorted(known)) or "(none)"
    return APIError(404, f"The model '{clip(model)}' does not exist on this gateway. Known models: {names}.",
                    type="invalid_request_error", param="model", code="model_not_found")


def rate_limited(message: str, retry_after_s: float, code: str = "rate_limit_exceeded") -> APIError:
    """A per-key RPM/TPM limit (or an upstream's): Retry-After says when a retry can succeed."""
    seconds = max(1, int(retry_after_s + 0.999))
    return APIError(429, message, type="rate_limit_error", code=code, headers={"Retry-After": str(seconds)})


def quota_exceeded(message: str) -> APIError:
    """A budget that is spent: no retry helps, so `x-should-retry: false` (the openai SDKs give up at once) and no
    Retry-After (they would otherwise sleep for it)."""
    return APIError(429, message, type="insufficient_quota", code="insufficient_quota",
                    headers={"x-should-retry": "false"})


def request_too_large(limit_bytes: int) -> APIError:
    return APIError(413, f"The request body is larger than this gateway's limit of {limit_bytes} bytes.",
                    type="invalid_request_error", code="request_too_large")


def upstream_rejected(status: int, detail: str, param: str | None = None, code: str | None = None) -> APIError:
    """An upstream's 4xx about the request itself, passed on as that status, its message quoted."""
    return APIError(status, f"The backend rejected the request: {detail}", type="invalid_request_error",
                    param=param, code=code)


def backend_misconfigured(status: int, detail: str) -> APIError:
    """The provider refused our credentials or model name (401/403/404): the gateway's fault, not the client's.
    A client's retry cannot fix it: `x-should-retry: false` stops the openai SDKs retrying a 502."""
    return APIError(502, f"The gateway's backend is misconfigured (the provider answered {status}: {detail}); "
                         "this is not a problem with your request — tell the gateway's operator.",
                    type="api_error", code="backend_misconfigured", headers={"x-should-retry": "false"})


def upstream_failed(message: str, *, timeout: bool = False, code: str = "upstream_error") -> APIError:
    """A backend that failed (5xx, cut, malformed or oversized answer: 502) or did not answer in time (504)."""
    if timeout:
        return APIError(504, message, type="api_error", code="upstream_timeout")
    return APIError(502, message, type="api_error", code=code)


def engine_starting(backends: list[str], retry_after_s: float) -> APIError:
    """Every backend for the model is an embedded engine that is not serving yet (starting, or restarting after
    a crash): nothing was sent; retry after Retry-After."""
    seconds = max(1, int(retry_after_s + 0.999))
    return APIError(503, f"The engine serving this model ({', '.join(backends)}) is starting; try again in "
                         f"{seconds} s.", type="api_error", code="engine_starting",
                    headers={"Retry-After": str(seconds)})


def circuit_open(retry_after_s: float) -> APIError:
    """Every backend for the model has its circuit breaker open: nothing was sent; retry after the cooldown."""
    return APIError(503, "No backend is available for this model right now (circuit open after repeated "
                         "failures); try again shortly.", type="api_error", code="circuit_open",
                    headers={"Retry-After": str(max(1, int(retry_after_s + 0.999)))})
