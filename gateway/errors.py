"""The gateway's OpenAI errors: factories for the status codes clients expect.

The exception type and its body are `openai_wire.APIError` (shared with the engine); answer one with
`openai_wire.responses.error_response`.
"""
from __future__ import annotations

from openai_wire import APIError

__all__ = ["APIError", "authentication", "invalid_request", "model_not_found", "rate_limited", "upstream_failed"]


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, type="invalid_request_error", param=param, code=code)


def authentication(message: str) -> APIError:
    return APIError(401, message, type="authentication_error", code="invalid_api_key")


def model_not_found(model: str, known: list[str]) -> APIError:
    names = ", ".join(sorted(known)) or "(none)"
    return APIError(404, f"The model '{model}' does not exist on this gateway. Known models: {names}.",
                    type="invalid_request_error", param="model", code="model_not_found")


def rate_limited(message: str, retry_after_s: float, code: str = "rate_limit_exceeded") -> APIError:
    seconds = max(1, int(retry_after_s + 0.999))
    return APIError(429, message, type="rate_limit_error" if code == "rate_limit_exceeded" else "insufficient_quota",
                    code=code, headers={"Retry-After": str(seconds)})


def upstream_failed(message: str, *, timeout: bool = False) -> APIError:
    if timeout:
        return APIError(504, message, type="api_error", code="upstream_timeout")
    return APIError(502, message, type="api_error", code="upstream_error")
