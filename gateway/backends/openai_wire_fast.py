"""The fast path of `kind: litellm` backends whose provider speaks OpenAI's own wire (openai/…, hosted_vllm/…,
custom_openai/…, openai_like/…, lm_studio/…, llamafile/…, litellm_proxy/…).

A full `litellm.acompletion` costs 6-8 ms of CPU per call here (docs/api-path.md has the breakdown): logging
objects and callbacks, cost calculation, the OpenAI SDK's request building and pydantic response objects, httpx.
The gateway does its own retries, costs, logging and answer checks, and returns plain OpenAI dicts, so on this
path litellm keeps only its request translation: a chat request goes through the provider's litellm chat config
(`map_openai_params` + `transform_request`: e.g. `max_tokens` as `max_completion_tokens` for o-series models,
vLLM's tool-schema fixes), decided once per backend. Completions, embeddings and Responses bodies are already the
provider's (litellm sends them as they are). The request goes out on one pooled aiohttp session per backend;
the answer is read within the backend's caps (guard.py) and returned as the upstream's JSON.

What is not OpenAI's wire (Azure's deployment URLs and api-version, Anthropic, Bedrock, Vertex…), or a backend
with `fast_path: false`, keeps the full litellm call (gateway/backends/litellm_backend.py).
"""
from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import aiohttp
import litellm
import orjson

from gateway.backends.base import (
    Completion,
    Endpoint,
    UpstreamError,
    Usage,
    is_retryable_status,
    requesting_usage,
    usage_from_dict,
)
from gateway.backends.engine_backend import parse_retry_after, read_at_most, rejected, sse_chunk
from gateway.backends.guard import AnswerRejected, SSELines, is_event_stream
from gateway.backends.http1 import ConnectFailed, Http1Pool
from gateway.redact import redact
from gateway.responses_api import END_EVENTS

if TYPE_CHECKING:
    from collections.abc import Mapping

    from gateway.policy import BackendSpec

# litellm providers whose HTTP is OpenAI's wire at the api_base as given (litellm uses the OpenAI SDK for them).
FAST_PROVIDERS = frozenset({"openai", "custom_openai", "hosted_vllm", "openai_like", "lm_studio", "llamafile",
                            "litellm_proxy"})
_PATHS = {"chat": "/chat/completions", "completions": "/completions", "embeddings": "/embeddings",
          "responses": "/responses"}
# Client fields never forwarded: the gateway sets them (model, stream…) or they would steer litellm/the SDK.
_DROPPED = frozenset({"model", "stream", "stream_options", "timeout", "api_base", "api_key", "num_retries",
                      "max_retries", "extra_body"})
# Sent as the client gave them (litellm would keep metadata for its logging and rewrite `developer` as `system`).
_AS_SENT = ("metadata", "user")
_REQUIRED_LIST = {"chat": "choices", "completions": "choices", "embeddings": "data", "responses": "output"}
_ERROR_BODY_BYTES = 64 * 1024
_READ_BUFFER = 1 << 20
_OPENAI_BASE = "https://api.openai.com/v1"


def fast_wire(spec: BackendSpec) -> OpenAIWireFast | None:
    """The fast path for this backend, or None when litellm must make the call (decided once, at construction)."""
    if not getattr(spec, "fast_path", True):
        return None
    try:
        model, provider, _, _ = litellm.get_llm_provider(spec.model, api_base=spec.api_base)
        config = litellm.ProviderConfigManager.get_provider_chat_config(model, litellm.LlmProviders(provider))
    except Exception:  # noqa: BLE001 — an unknown provider or model: litellm reports it on the call
        return None
    if provider not in FAST_PROVIDERS or config is None:
        return None
    base = spec.api_base
    if not base and provider == "openai":  # litellm's own default chain for openai/…
        base = litellm.api_base or os.environ.get("OPENAI_BASE_URL") or os.environ.get("OPENAI_API_BASE") or _OPENAI_BASE
    if not base:
        return None
    endpoints = {"chat", "embeddings", "responses", "completions"}
    if provider == "openai" and model in litellm.open_ai_chat_completion_models:
        endpoints.discard("completions")  # litellm sends a chat model's completions as chat: it keeps that case
    try:
        responses = litellm.ProviderConfigManager.get_provider_responses_api_config(provider, model, base)
    except Exception:  # noqa: BLE001 — no Responses config: litellm bridges it to chat, so it keeps the endpoint
        responses = None
    if responses is None:
        endpoints.discard("responses")
    return OpenAIWireFast(spec, model, provider, (config, responses), base.rstrip("/"), frozenset(endpoints))


def check_chat(payload: dict) -> None:
    """Refuse (TypeError: the client's request, never sent) the shapes litellm's own path fails on before sending."""
    messages = payload.get("messages")
    if not isinstance(messages, list):
        raise TypeError("messages must be a list of message objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise TypeError(f"messages[{i}] must be an object with a string role")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise TypeError(f"messages[{i}].content must be a string or a list of content parts")
    response_format = payload.get("response_format")
    if response_format is not None and not isinstance(response_format, dict):
        raise TypeError(f"unsupported response_format: {response_format!r:.40}")


class OpenAIWireFast:
    """One backend's requests over its own pooled aiohttp session; answers as the upstream's OpenAI dicts."""

    def __init__(self, spec: BackendSpec, model: str, provider: str, configs: tuple[Any, Any], base: str,
                 endpoints: frozenset[str]):
        """`configs`: litellm's chat and Responses API configs for this provider and model."""
        self.spec, self.name, self.model, self.provider = spec, spec.name, model, provider
        self.endpoints = endpoints
        self._config, self._responses_config = configs
        self._supported = frozenset(self._config.get_supported_openai_params(model)) - _DROPPED - set(_AS_SENT)
        self._urls = {k: base + p for k, p in _PATHS.items()}
        self._base = base
        self._pool: Http1Pool | None = None  # plain requests (gateway/backends/http1.py); streams: aiohttp
        self._pool_loop: asyncio.AbstractEventLoop | None = None
        self._stream_timeout = aiohttp.ClientTimeout(total=None, sock_connect=spec.connect_timeout_s,
                                                     sock_read=spec.timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._in_flight = 0  # calls using the session: a policy reload's aclose waits for them
        self._closing = False

    # ------------------------------------------------------------ credentials and session

    def api_key(self) -> str | None:
        """The key for this call (read per call: a rotated key is used without a restart), or None when there is
        none and litellm's own path should make the call (and report the missing credentials as it does)."""
        if self.spec.api_key_env:
            key = os.environ.get(self.spec.api_key_env)
            if key:
                return key
        if self.provider in ("openai", "custom_openai"):
            return os.environ.get("OPENAI_API_KEY") or litellm.api_key or litellm.openai_key
        return self._config.get_openai_compatible_provider_info(None, None)[1]

    def _client(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            connector = aiohttp.TCPConnector(limit=self.spec.max_connections, keepalive_timeout=30,
                                             enable_cleanup_closed=True)
            self._session = aiohttp.ClientSession(connector=connector, read_bufsize=_READ_BUFFER,
                                                  auto_decompress=False, skip_auto_headers=("User-Agent",))
            self._loop = loop
        return self._session

    async def aclose(self) -> None:
        """Close the pool once the calls in flight are done (a reload replaces the backend under them: they
        finish on the policy they started with)."""
        self._closing = True
        if self._in_flight == 0:
            await self._close_session()

    def _plain_pool(self) -> Http1Pool:
        loop = asyncio.get_running_loop()
        if self._pool is None or self._pool_loop is not loop:
            self._pool = Http1Pool(self._base, self.spec.max_connections, self.spec.connect_timeout_s)
            self._pool_loop = loop
        return self._pool

    async def _close_session(self) -> None:
        if self._pool is not None and self._pool_loop is asyncio.get_running_loop():
            await self._pool.aclose()
        if self._session is not None and not self._session.closed and self._loop is asyncio.get_running_loop():
            await self._session.close()

    async def _done(self) -> None:
        self._in_flight -= 1
        if self._closing and self._in_flight == 0:
            await self._close_session()

    # ------------------------------------------------------------ requests

    def body(self, payload: dict, endpoint: Endpoint, stream: bool) -> bytes:
        """The provider's request body: litellm's chat translation, or the OpenAI body as sent."""
        if endpoint == "chat":
            body = self._chat_body(payload)
        elif endpoint == "responses":
            body = self._responses_body(payload)
        else:
            body = {k: v for k, v in payload.items() if k not in _DROPPED}
            if endpoint == "embeddings":
                body.pop("metadata", None)  # litellm keeps an embedding call's metadata for its logging
            body["model"] = self.model
        if stream:
            body["stream"] = True
            if endpoint != "responses":  # a Responses stream always ends with its usage
                body["stream_options"] = requesting_usage(payload.get("stream_options"))
        return orjson.dumps(body)

    def _chat_body(self, payload: dict) -> dict:
        check_chat(payload)
        params: dict = {}
        extra: dict = {}
        for k, v in payload.items():
            if k in self._supported:
                if v is not None:  # litellm passes only the parameters that are set
                    params[k] = v
            elif k not in _DROPPED and k != "messages":
                extra[k] = v  # not an OpenAI parameter litellm maps: sent as is (litellm's extra_body)
        messages = payload["messages"]
        optional = self._config.map_openai_params(params, {}, self.model, False)
        # Copies: a config may edit messages in place (vLLM's drops assistant thinking blocks).
        body = self._config.transform_request(self.model, [dict(m) for m in messages], optional, {}, {})
        body.update(extra)
        if any(m.get("role") == "developer" for m in messages):
            body["messages"] = messages  # as sent: litellm would make `developer` a `system` message
        body["model"] = self.model
        return body

    def _responses_body(self, payload: dict) -> dict:
        """litellm's Responses translation (e.g. max_output_tokens raised to OpenAI's minimum of 16)."""
        from litellm.types.router import GenericLiteLLMParams

        params = {k: v for k, v in payload.items() if k not in _DROPPED and k != "input" and v is not None}
        optional = self._responses_config.map_openai_params(params, self.model, False)
        return self._responses_config.transform_responses_api_request(self.model, payload.get("input"),
                                                                      dict(optional), GenericLiteLLMParams(), {})

    def _headers(self, key: str) -> dict[str, str]:
        headers = {"content-type": "application/json", "accept": "application/json"}
        if key:
            headers["authorization"] = f"Bearer {key}"
        return headers

    async def complete(self, payload: dict, endpoint: Endpoint, key: str) -> Completion:
        data = self.body(payload, endpoint, False)
        self._in_flight += 1
        try:
            pool = self._plain_pool()
            status, headers, content = await pool.post(
                pool.head(_PATHS[endpoint], self._headers(key)), data, timeout_s=self.spec.timeout_s,
                max_bytes=self.spec.max_response_bytes, error_bytes=_ERROR_BODY_BYTES)
        except AnswerRejected as e:
            raise self.rejected(e) from e
        except (aiohttp.ClientError, TimeoutError, OSError, asyncio.IncompleteReadError,
                asyncio.LimitOverrunError) as e:
            raise self._transport_error(e) from e
        finally:
            await self._done()
        if status >= 400:
            raise self._http_error(status, content, headers, key)
        try:
            body = orjson.loads(content)
        except orjson.JSONDecodeError as e:
            raise self.rejected(AnswerRejected("malformed", f"the answer is not JSON ({e})")) from e
        if not isinstance(body, dict) or not isinstance(body.get(_REQUIRED_LIST[endpoint]), list):
            raise self.rejected(AnswerRejected("malformed", f"the answer is not a {endpoint} object"))
        return Completion(body, usage_from_dict(body.get("usage")) or Usage())

    def stream(self, payload: dict, endpoint: Endpoint, key: str) -> AsyncIterator[dict]:
        """The stream's chunks; the request body is built (and a bad one refused) before the first is asked for."""
        return self._stream(self.body(payload, endpoint, True), endpoint, key)

    async def _stream(self, data: bytes, endpoint: Endpoint, key: str) -> AsyncIterator[dict]:
        self._in_flight += 1
        try:
            resp = await self._client().post(self._urls[endpoint], data=data, headers=self._headers(key),
                                             timeout=self._stream_timeout)
        except BaseException as e:  # cancelled too: the call is no longer in flight
            await self._done()
            if isinstance(e, aiohttp.ClientError | TimeoutError):
                raise self._transport_error(e) from e
            raise
        finished = False
        try:
            if resp.status >= 400:
                raise self._http_error(resp.status, await read_at_most(resp, _ERROR_BODY_BYTES), resp.headers, key)
            if not is_event_stream(resp.headers.get("content-type")):
                raise AnswerRejected("malformed", "a stream was asked for and the answer is not text/event-stream "
                                                  f"({resp.headers.get('content-type')!r})")
            lines = SSELines(self.spec.max_response_bytes, self.spec.max_stream_bytes)
            done = False
            async for part in resp.content.iter_any():
                for raw in lines.feed(part):
                    if done or not raw.startswith(b"data:"):
                        continue  # read on after the end so the connection goes back to the pool
                    if raw[5:].strip() == b"[DONE]":
                        done = True
                        continue
                    chunk = self._chunk(raw, key)
                    done = chunk.get("type") in END_EVENTS  # a Responses stream ends with its last event
                    yield chunk
            rest = lines.end()
            if not done and rest.startswith(b"data:"):  # a last line without its line ending
                if rest[5:].strip() == b"[DONE]":
                    done = True
                else:
                    chunk = self._chunk(rest, key)
                    done = chunk.get("type") in END_EVENTS
                    yield chunk
            if not done:
                raise AnswerRejected("malformed", "the stream ended without [DONE]")
            finished = True
        except AnswerRejected as e:
            raise self.rejected(e) from e
        except (aiohttp.ClientError, TimeoutError) as e:
            raise self._transport_error(e) from e
        finally:
            if finished:
                resp.release()
            else:
                resp.close()  # cut short (client gone, error): the upstream sees the disconnect
            await self._done()

    def _chunk(self, line: bytes, key: str) -> dict:
        return sse_chunk(line, self.name, [key] if key else ())

    # ------------------------------------------------------------ errors, as map_litellm_error types them

    def rejected(self, e: AnswerRejected) -> UpstreamError:
        return rejected(self.name, e)

    def _transport_error(self, e: BaseException) -> UpstreamError:
        if isinstance(e, aiohttp.ClientConnectorError | ConnectFailed):
            kind, detail = "connect", "Connection error."
        elif isinstance(e, TimeoutError):  # a connect timeout too: litellm's APITimeoutError
            kind, detail = "timeout", "Request timed out."
        else:
            kind, detail = "protocol", f"the connection failed ({type(e).__name__})"
        return UpstreamError(f"{self.name}: {kind} error: {type(e).__name__}", kind=kind,  # type: ignore[arg-type]
                             retryable=True, backend=self.name, detail=detail)

    def _http_error(self, status: int, content: bytes, headers: Mapping[str, str], key: str) -> UpstreamError:
        body = None
        try:
            parsed = orjson.loads(content)
        except orjson.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            if isinstance(parsed.get("error"), dict):
                body = parsed
            elif "message" in parsed:
                body = {"error": parsed}
        message = body["error"].get("message") if body else None
        detail = redact(str(message) if message else content[:200].decode("utf-8", "replace") or f"HTTP {status}",
                        [key] if key else ())
        return UpstreamError(f"{self.name}: upstream returned {status}: {detail}", kind="http", status=status,
                             retryable=is_retryable_status(status), body=body, detail=detail,
                             retry_after=parse_retry_after(headers.get("retry-after")), backend=self.name)
