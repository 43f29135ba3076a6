"""`kind: litellm`: any hosted API through `litellm.acompletion` / `litellm.atext_completion`.

litellm only translates the wire format here: retries, fallbacks and cooldowns are ours (num_retries=0,
max_retries=0), costs come from gateway/pricing.py, and litellm's own callbacks and telemetry are off.
Responses are returned as plain OpenAI dicts, without litellm's extra fields.
"""
from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import httpx
import litellm  # gateway/__init__.py has set LITELLM_LOCAL_MODEL_COST_MAP: no price-map fetch

from gateway.backends.base import (
    Backend,
    Completion,
    Endpoint,
    UpstreamError,
    Usage,
    is_retryable_status,
    requesting_usage,
    usage_from_dict,
)
from gateway.backends.engine_backend import parse_retry_after

if TYPE_CHECKING:
    from gateway.policy import BackendSpec

litellm.suppress_debug_info = True
litellm.telemetry = False
litellm.success_callback = []
litellm.failure_callback = []
litellm.callbacks = []
logging.getLogger("LiteLLM").setLevel(logging.WARNING)

# Keys litellm adds to OpenAI objects; dropped so clients see the OpenAI format.
_EXTRA_TOP = ("provider_specific_fields", "citations", "moderation", "obfuscation")
_EXTRA_CHOICE = ("provider_specific_fields",)
# Request fields we set ourselves.
_OURS = frozenset({"model", "stream", "stream_options", "timeout", "api_base", "api_key", "num_retries",
                   "max_retries"})


class LiteLLMBackend(Backend):
    def __init__(self, spec: BackendSpec):
        super().__init__(spec)
        fixed: dict[str, Any] = {
            "model": spec.model,
            "timeout": httpx.Timeout(spec.timeout_s, connect=spec.connect_timeout_s),
            "num_retries": 0,  # litellm's retries
            "max_retries": 0,  # the provider SDK's retries
        }
        if spec.api_base:
            fixed["api_base"] = spec.api_base
        self._fixed = fixed

    def _kwargs(self, payload: dict) -> dict:
        kwargs = {k: v for k, v in payload.items() if k not in _OURS}
        kwargs.update(self._fixed)
        if self.spec.api_key_env:  # read per call so a rotated key is picked up without a restart
            key = os.environ.get(self.spec.api_key_env)
            if key:
                kwargs["api_key"] = key
        return kwargs

    async def _call(self, kwargs: dict, endpoint: Endpoint) -> Any:
        fn = litellm.acompletion if endpoint == "chat" else litellm.atext_completion
        try:
            return await fn(**kwargs)
        except Exception as e:  # every litellm/provider error becomes a typed UpstreamError
            raise map_litellm_error(e, self.name) from e

    async def complete(self, payload: dict, endpoint: Endpoint) -> Completion:
        resp = await self._call(self._kwargs(payload), endpoint)
        body = to_openai_dict(resp)
        usage = usage_from_dict(body.get("usage"))
        return Completion(body, usage if usage is not None else Usage())

    async def stream(self, payload: dict, endpoint: Endpoint) -> AsyncIterator[dict]:
        kwargs = self._kwargs(payload)
        kwargs["stream"] = True
        kwargs["stream_options"] = requesting_usage(payload.get("stream_options"))
        wrapper = await self._call(kwargs, endpoint)
        try:
            async for chunk in wrapper:
                yield to_openai_dict(chunk)
        except Exception as e:
            raise map_litellm_error(e, self.name) from e
        finally:
            await _close_stream(wrapper)  # closes the provider's HTTP stream


async def _close_stream(wrapper: Any) -> None:
    """Close a litellm stream wrapper; text-completion wrappers hold the chat wrapper that owns the HTTP stream."""
    for _ in range(3):
        close = getattr(wrapper, "aclose", None)
        if close is not None:
            await close()
            return
        wrapper = getattr(wrapper, "completion_stream", None)
        if wrapper is None:
            return


def to_openai_dict(obj: Any) -> dict:
    """A litellm response/chunk object as the plain OpenAI JSON dict."""
    d = obj if isinstance(obj, dict) else obj.model_dump()
    for k in _EXTRA_TOP:
        d.pop(k, None)
    for choice in d.get("choices") or ():
        for k in _EXTRA_CHOICE:
            choice.pop(k, None)
        for inner in ("message", "delta"):
            part = choice.get(inner)
            if isinstance(part, dict):
                part.pop("provider_specific_fields", None)
    return d


def _caused_by_connect_error(e: BaseException) -> bool:
    seen = 0
    cur: BaseException | None = e
    while cur is not None and seen < 10:
        if isinstance(cur, httpx.ConnectError | ConnectionError) or type(cur).__name__ in (
                "ClientConnectorError", "ClientConnectionError", "APIConnectionError"):
            return True
        cur = cur.__cause__ or cur.__context__
        seen += 1
    return "Connection error" in str(e)


def map_litellm_error(e: Exception, backend: str) -> UpstreamError:
    """litellm/openai exceptions → UpstreamError with the upstream status and whether a retry may help."""
    import openai

    message = f"{backend}: {type(e).__name__}: {e}"
    if isinstance(e, openai.APITimeoutError):  # litellm.Timeout
        return UpstreamError(message, kind="timeout", retryable=True, backend=backend)
    if isinstance(e, openai.APIConnectionError) or _caused_by_connect_error(e):
        return UpstreamError(message, kind="connect", retryable=True, backend=backend)
    status = getattr(e, "status_code", None)
    if not isinstance(status, int):
        # Not an HTTP answer (e.g. a malformed response): another attempt or backend may do better.
        return UpstreamError(message, kind="protocol", retryable=True, backend=backend)
    body = getattr(e, "body", None)
    if isinstance(body, dict) and "message" in body and "error" not in body:
        body = {"error": body}
    elif not (isinstance(body, dict) and isinstance(body.get("error"), dict)):
        body = None
    response = getattr(e, "response", None)
    retry_after = None
    if isinstance(response, httpx.Response):
        retry_after = parse_retry_after(response.headers.get("retry-after"))
    return UpstreamError(message, kind="http", status=status, retryable=is_retryable_status(status), body=body,
                         retry_after=retry_after, backend=backend)


async def stop_litellm_workers() -> None:
    """Stop litellm's background logging worker on this event loop (at gateway shutdown).

    litellm starts it lazily on the loop of the first call; left running, it dies noisily when the
    loop closes. We keep our own ledger, so anything it still holds is discarded.
    """
    from litellm.litellm_core_utils.logging_worker import GLOBAL_LOGGING_WORKER

    try:
        await GLOBAL_LOGGING_WORKER.stop(discard_pending=True, timeout=2.0)
    except RuntimeError as exc:  # started on an earlier event loop that is closed now (tests): nothing to stop
        logging.getLogger("switchyard.backends").debug("litellm logging worker: %s", exc)
