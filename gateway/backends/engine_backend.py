"""`kind: engine`: the in-house engine's OpenAI-compatible API over one pooled httpx client per backend.

This is the gateway's fast path: one shallow copy of the payload, one json.dumps, one json.loads per
response or chunk, SSE parsed straight from `aiter_lines()`.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING

import httpx

from gateway.backends.base import (
    Backend,
    Completion,
    Endpoint,
    UpstreamError,
    Usage,
    engine_stats,
    is_retryable_status,
    usage_from_dict,
)

if TYPE_CHECKING:
    from gateway.policy import BackendSpec

_PATHS = {"chat": "/chat/completions", "completions": "/completions"}
_COMPACT = (",", ":")


class EngineBackend(Backend):
    def __init__(self, spec: BackendSpec, api_base: str | None = None):
        super().__init__(spec)
        base = (api_base or spec.api_base or "").rstrip("/")
        if not base:
            raise ValueError(f"backend {spec.name!r}: no api_base (an embedded engine's URL must be passed in)")
        self.api_base = base
        self._urls = {k: httpx.URL(base + p) for k, p in _PATHS.items()}
        self._headers = {"content-type": "application/json", "accept": "application/json"}
        key = os.environ.get(spec.api_key_env) if spec.api_key_env else None
        if key:
            self._headers["authorization"] = f"Bearer {key}"
        self._client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=spec.max_connections,
                                max_keepalive_connections=spec.max_connections, keepalive_expiry=30),
            # read = the whole response for plain requests, the gap between chunks for streams
            timeout=httpx.Timeout(spec.timeout_s, connect=spec.connect_timeout_s, pool=spec.timeout_s),
        )

    def _encode(self, payload: dict, stream: bool) -> bytes:
        body = dict(payload)  # shallow: the caller's payload is never changed
        body["model"] = self.spec.model
        if stream:
            body["stream"] = True
            opts = payload.get("stream_options")
            body["stream_options"] = {**opts, "include_usage": True} if isinstance(opts, dict) else {
                "include_usage": True}
        else:
            body.pop("stream", None)
            body.pop("stream_options", None)  # only valid with stream: true
        return json.dumps(body, separators=_COMPACT).encode()

    async def complete(self, payload: dict, endpoint: Endpoint) -> Completion:
        try:
            resp = await self._client.post(self._urls[endpoint], content=self._encode(payload, False),
                                           headers=self._headers)
        except httpx.HTTPError as e:
            raise self._transport_error(e) from e
        if resp.status_code >= 400:
            raise self._http_error(resp.status_code, resp.content, resp.headers)
        try:
            body = json.loads(resp.content)
        except ValueError as e:
            raise UpstreamError(f"{self.name}: response is not JSON ({e})", kind="protocol", status=resp.status_code,
                                backend=self.name) from e
        device_seconds, utilisation = engine_stats(body)
        usage = usage_from_dict(body.get("usage"))
        return Completion(body, usage if usage is not None else Usage(), device_seconds, utilisation)

    async def stream(self, payload: dict, endpoint: Endpoint) -> AsyncIterator[dict]:
        request = self._client.build_request("POST", self._urls[endpoint], content=self._encode(payload, True),
                                             headers=self._headers)
        try:
            resp = await self._client.send(request, stream=True)
        except httpx.HTTPError as e:
            raise self._transport_error(e) from e
        try:
            if resp.status_code >= 400:
                await resp.aread()
                raise self._http_error(resp.status_code, resp.content, resp.headers)
            done = False
            async for line in resp.aiter_lines():
                # Keep reading after [DONE] so the response completes and its connection returns to the pool.
                if done or not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    continue
                try:
                    chunk = json.loads(data)
                except ValueError as e:
                    raise UpstreamError(f"{self.name}: bad SSE data ({e})", kind="protocol",
                                        backend=self.name) from e
                yield chunk
        except httpx.HTTPError as e:
            raise self._transport_error(e) from e
        finally:
            await resp.aclose()  # before the end of the body this closes the connection: the engine sees it

    async def aclose(self) -> None:
        await self._client.aclose()

    def _transport_error(self, e: httpx.HTTPError) -> UpstreamError:
        if isinstance(e, httpx.ConnectTimeout | httpx.ConnectError):
            kind = "connect"
        elif isinstance(e, httpx.TimeoutException):
            kind = "timeout"
        else:
            kind = "protocol"
        return UpstreamError(f"{self.name}: {kind} error talking to {self.api_base}: {type(e).__name__} {e}".rstrip(),
                             kind=kind, retryable=True, backend=self.name)

    def _http_error(self, status: int, content: bytes, headers: httpx.Headers) -> UpstreamError:
        body = None
        try:
            parsed = json.loads(content)
            if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
                body = parsed
        except ValueError:
            pass
        detail = body["error"].get("message") if body else content[:200].decode("utf-8", "replace")
        return UpstreamError(f"{self.name}: upstream returned {status}: {detail}", kind="http", status=status,
                             retryable=is_retryable_status(status), body=body,
                             retry_after=parse_retry_after(headers.get("retry-after")), backend=self.name)


def parse_retry_after(value: str | None) -> float | None:
    """Retry-After as seconds: a number, or an HTTP date."""
    if not value:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        return max(parsedate_to_datetime(value).timestamp() - time.time(), 0.0)
    except (TypeError, ValueError):
        return None
