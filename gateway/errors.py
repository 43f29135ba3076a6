"""OpenAI-shaped errors: one exception type, one JSON body, the status codes clients expect."""
from __future__ import annotations

import orjson
from starlette.responses import Response


class APIError(Exception):
    """An error the gateway answers with OpenAI's body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, type: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return Response(orjson.dumps(self.body()), status_code=self.status,
                        media_type="application/json", headers=self.headers)


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
