"""`kind: litellm`: any hosted API through `litellm.acompletion` / `atext_completion` / `aembedding` /
`aresponses` (the Responses API: litellm sends it to providers that have one, e.g. OpenAI's /v1/responses, and
bridges it to chat completions for those that do not).

litellm only translates the wire format here: retries, fallbacks and cooldowns are ours (num_retries=0,
max_retries=0), costs come from gateway/pricing.py, and litellm's own callbacks and telemetry are off.
Responses are returned as plain OpenAI dicts, without litellm's extra fields.

Pass-through: litellm keeps `metadata` for its own logging, drops `user` for model names it does not
know, and rewrites the `developer` role as `system`. For OpenAI-compatible providers (`_PASSTHROUGH_PROVIDERS`)
the client's `metadata` and `user`, and its messages as sent when one has the `developer` role, go into
`extra_body`, which the OpenAI SDK merges into the JSON body last. Other providers get what litellm makes
of them: `developer` as `system`, `user` where litellm maps it (e.g. Anthropic's metadata.user_id), and no
`metadata` (it has no equivalent there).

Errors: `map_litellm_error` types every litellm exception. One that litellm raised while building the
provider's request (a TypeError/ValueError… with no network error behind it) is the client's: kind
"request", a 400, never retried. One raised after a 2xx answer arrived (litellm could not read it: not JSON,
bad SSE data, a truncated stream) is the upstream's: kind "malformed". The upstream's message is kept without
litellm's wording, and redacted (gateway/redact.py), in `detail`.

Fast path: a provider that speaks OpenAI's wire (openai/…, hosted_vllm/…; gateway/backends/openai_wire_fast.py)
is called without `litellm.acompletion`: litellm's request translation only, over the backend's own pooled
aiohttp session, answers read within the caps and returned as the upstream's JSON; the errors are typed as
`map_litellm_error` types litellm's. `fast_path: false` in the policy keeps the full litellm call
(docs/api-path.md says what each path does and costs).

Untrusted answers: litellm's OpenAI-wire HTTP (openai, azure, text-completion-openai…) goes through
`guard.GuardedTransport` (litellm.aclient_session), which caps each answer at the backend's
max_response_bytes (a stream: each event, and max_stream_bytes in all) while reading it, and refuses a stream
answer that is not text/event-stream. Providers litellm reaches through its own HTTP handler are checked on
the parsed answer instead (the cap still holds, but what was read was buffered first).
"""
from __future__ import annotations

import logging
import os
import re
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import aiohttp
import httpx
import litellm  # gateway/__init__.py has set LITELLM_LOCAL_MODEL_COST_MAP: no price-map fetch
import orjson

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
from gateway.backends.guard import (
    ANSWER_LIMITS,
    AnswerLimits,
    AnswerRejected,
    GuardedTransport,
    guarded_client,
    too_large,
)
from gateway.backends.openai_wire_fast import fast_wire
from gateway.redact import redact

if TYPE_CHECKING:
    from gateway.policy import BackendSpec

litellm.suppress_debug_info = True
litellm.telemetry = False
litellm.success_callback = []
litellm.failure_callback = []
litellm.callbacks = []
# litellm counts a stream's tokens with the model family's Hugging Face tokenizer, fetched from the Hub on first use
# (a "llama…" model name: Xenova/llama-3-tokenizer). Nothing downloads at run time: offline, that fetch retried for
# ~27 s and stalled the first stream of such a model. Its bundled tiktoken counts instead (usage comes from the
# upstream anyway).
litellm.disable_hf_tokenizer_download = True
# Retries are ours. litellm's OpenAI embedding (and Azure) path reads `max_retries or DEFAULT_MAX_RETRIES`, so
# our max_retries=0 became the SDK's 2 hidden retries per attempt: its default is 0 here too.
litellm.DEFAULT_MAX_RETRIES = 0
logging.getLogger("LiteLLM").setLevel(logging.WARNING)
if litellm.aclient_session is None:  # the OpenAI-wire providers' HTTP: answers read within each backend's caps
    litellm.aclient_session = guarded_client()

# Keys litellm adds to OpenAI objects; dropped so clients see the OpenAI format.
_EXTRA_TOP = ("provider_specific_fields", "citations", "moderation", "obfuscation")
_EXTRA_CHOICE = ("provider_specific_fields",)
# Request fields we set ourselves.
_OURS = frozenset({"model", "stream", "stream_options", "timeout", "api_base", "api_key", "num_retries",
                   "max_retries", "extra_body", "metadata"})
# Endpoints whose litellm function takes `metadata` and `user` as its own parameters (sent as given).
_NATIVE_FIELDS = frozenset({"embeddings", "responses"})
_FUNCTIONS = {"chat": "acompletion", "completions": "atext_completion", "embeddings": "aembedding",
              "responses": "aresponses"}
# litellm's own additions to a Responses usage object.
_EXTRA_USAGE = ("cost",)
# litellm providers that speak OpenAI's own wire (the request body goes out as OpenAI JSON).
_PASSTHROUGH_PROVIDERS = frozenset({"openai", "custom_openai", "hosted_vllm", "openai_like", "lm_studio",
                                    "text-completion-openai", "llamafile", "litellm_proxy"})


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
        self._passthrough = _provider(spec.model) in _PASSTHROUGH_PROVIDERS
        self._fast = fast_wire(spec)  # None: every call goes through litellm

    def _fast_key(self, endpoint: Endpoint) -> str | None:
        """The key for a fast-path call, or None when this call is litellm's (not an OpenAI-wire provider or
        endpoint, or no key to send: litellm then reports the missing credentials as it always did)."""
        if self._fast is None or endpoint not in self._fast.endpoints:
            return None
        return self._fast.api_key()

    async def _fast_call(self, payload: dict, endpoint: Endpoint, key: str, stream: bool) -> Any:
        try:
            if stream:
                return self._fast.stream(payload, endpoint, key)  # type: ignore[union-attr]
            return await self._fast.complete(payload, endpoint, key)  # type: ignore[union-attr]
        except UpstreamError:
            raise
        except Exception as e:  # litellm's translation refused the request (e.g. UnsupportedParamsError): typed
            raise map_litellm_error(e, self.name, None, [key]) from e

    def _kwargs(self, payload: dict, endpoint: Endpoint = "chat") -> dict:
        native = endpoint in _NATIVE_FIELDS
        kwargs = {k: v for k, v in payload.items() if k not in _OURS or (native and k == "metadata")}
        kwargs.update(self._fixed)
        if self._passthrough and not native:
            extra = {k: payload[k] for k in ("metadata", "user") if payload.get(k) is not None}
            messages = payload.get("messages")
            if isinstance(messages, list) and any(
                    isinstance(m, dict) and m.get("role") == "developer" for m in messages):
                extra["messages"] = messages  # as sent: litellm would make `developer` a `system` message
            if extra:
                kwargs["extra_body"] = extra
        if self.spec.api_key_env:  # read per call so a rotated key is picked up without a restart
            key = os.environ.get(self.spec.api_key_env)
            if key:
                kwargs["api_key"] = key
        return kwargs

    def _limits(self, stream: bool) -> AnswerLimits:
        return AnswerLimits(self.spec.max_response_bytes, self.spec.max_stream_bytes, stream)

    def _secrets(self) -> list[str]:
        key = os.environ.get(self.spec.api_key_env) if self.spec.api_key_env else None
        return [key] if key else []

    async def _call(self, kwargs: dict, endpoint: Endpoint, limits: AnswerLimits) -> Any:
        fn = getattr(litellm, _FUNCTIONS[endpoint])
        token = ANSWER_LIMITS.set(limits)
        try:
            return await fn(**kwargs)
        except Exception as e:  # every litellm/provider error becomes a typed UpstreamError
            raise map_litellm_error(e, self.name, limits, self._secrets()) from e
        finally:
            ANSWER_LIMITS.reset(token)

    async def complete(self, payload: dict, endpoint: Endpoint) -> Completion:
        key = self._fast_key(endpoint)
        if key is not None:
            done = await self._fast_call(payload, endpoint, key, False)
            try:
                body = _FAST_CONVERT[endpoint](done.body)
            except (TypeError, ValueError, AttributeError) as e:
                raise _malformed(e, self.name) from e
            return Completion(body, done.usage)
        limits = self._limits(False)
        resp = await self._call(self._kwargs(payload, endpoint), endpoint, limits)
        try:
            if endpoint == "embeddings":
                body = embeddings_dict(resp)
            elif endpoint == "responses":
                body = responses_dict(resp)
            else:
                body = to_openai_dict(resp)
            if limits.status is None and len(orjson.dumps(body)) > limits.max_bytes:
                raise too_large("the answer", limits.max_bytes)  # read by litellm's own handler: checked here
            usage = usage_from_dict(body.get("usage"))
        except (AnswerRejected, TypeError, ValueError, AttributeError) as e:
            raise _malformed(e, self.name) from e
        return Completion(body, usage if usage is not None else Usage())

    async def stream(self, payload: dict, endpoint: Endpoint) -> AsyncIterator[dict]:
        key = self._fast_key(endpoint)
        if key is not None:
            chunks = await self._fast_call(payload, endpoint, key, True)
            try:
                async for chunk in chunks:
                    yield chunk
            finally:
                await chunks.aclose()  # closes the upstream's connection when the client goes
            return
        kwargs = self._kwargs(payload, endpoint)
        kwargs["stream"] = True
        if endpoint != "responses":  # a Responses stream always ends with its usage
            kwargs["stream_options"] = requesting_usage(payload.get("stream_options"))
        convert = responses_dict if endpoint == "responses" else to_openai_dict
        limits = self._limits(True)
        wrapper = await self._call(kwargs, endpoint, limits)
        total = 0
        try:
            async for chunk in wrapper:
                out = convert(chunk)
                if limits.status is None:  # read by litellm's own handler: the caps are checked here
                    size = len(orjson.dumps(out))
                    total += size
                    if size > limits.max_bytes or total > limits.max_stream_bytes:
                        raise too_large("the stream", limits.max_stream_bytes)
                yield out
        except UpstreamError:
            raise
        except Exception as e:
            raise map_litellm_error(e, self.name, limits, self._secrets()) from e
        finally:
            await _close_stream(wrapper)  # closes the provider's HTTP stream


    async def aclose(self) -> None:
        if self._fast is not None:
            await self._fast.aclose()


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
        if "text" in choice and choice["text"] is None:
            choice["text"] = ""  # litellm ends a completions stream with text null; OpenAI sends ""
        for inner in ("message", "delta"):
            part = choice.get(inner)
            if isinstance(part, dict):
                part.pop("provider_specific_fields", None)
    return d


def embeddings_dict(obj: Any) -> dict:
    """litellm's EmbeddingResponse as OpenAI's body (embeddings as floats, or as the base64 strings asked for)."""
    d = obj if isinstance(obj, dict) else obj.model_dump(warnings=False)  # base64 strings: not list[float]
    usage = d.get("usage") or {}
    prompt = int(usage.get("prompt_tokens") or 0)
    d["usage"] = {"prompt_tokens": prompt, "total_tokens": int(usage.get("total_tokens") or prompt)}
    for k in _EXTRA_TOP:
        d.pop(k, None)
    return {"object": "list", **d}


def responses_dict(obj: Any) -> dict:
    """A litellm Response object or Responses stream event as OpenAI's JSON (event types as strings)."""
    d = obj if isinstance(obj, dict) else obj.model_dump(mode="json", warnings=False, exclude_none=False)
    response = d.get("response") if isinstance(d.get("response"), dict) else d
    usage = response.get("usage")
    if isinstance(usage, dict):
        for k in _EXTRA_USAGE:
            usage.pop(k, None)
    return d


# The fast path's answers are the upstream's own OpenAI JSON: the same clean-up as litellm's objects get.
_FAST_CONVERT = {"chat": to_openai_dict, "completions": to_openai_dict, "embeddings": embeddings_dict,
                 "responses": responses_dict}


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


def _provider(model: str) -> str | None:
    try:
        return litellm.get_llm_provider(model)[1]
    except Exception:  # noqa: BLE001 — an unknown provider: no pass-through, litellm reports it on the call
        return None


# litellm's wrapping of a provider's message: "litellm.BadRequestError: OpenAIException - …",
# "litellm.APIConnectionError: APIConnectionError: OpenAIException - …", and its trailers.
_LITELLM_PREFIX = re.compile(r"^(?:litellm\.\w+:\s*|\w*(?:Error|Exception)\s*(?::|-)\s*)+")
_LITELLM_TRAILER = re.compile(r"\s*(?:Received Model Group=|LiteLLM Retried:|Available Model Group Fallbacks=).*$",
                              re.DOTALL)
_MAX_DETAIL = 500


def provider_message(e: BaseException) -> str:
    """The provider's (or the failed check's) own message, without litellm's class names and trailers."""
    body = getattr(e, "body", None)
    if isinstance(body, dict):
        inner = body.get("error") if isinstance(body.get("error"), dict) else body
        if isinstance(inner.get("message"), str) and inner["message"]:
            return inner["message"][:_MAX_DETAIL]
    text = _LITELLM_TRAILER.sub("", _LITELLM_PREFIX.sub("", str(getattr(e, "message", None) or e))).strip()
    return (text or type(e).__name__)[:_MAX_DETAIL]


_LOCAL_ERRORS = (TypeError, ValueError, KeyError, AttributeError, IndexError)


def _raised_locally(e: BaseException) -> bool:
    """Did litellm fail while building the provider's request (a plain Python error, no network behind it)?"""
    seen, cur, local = 0, e, False
    while cur is not None and seen < 10:
        if isinstance(cur, httpx.TransportError | OSError | TimeoutError | httpx.HTTPStatusError) or type(
                cur).__name__ in ("ClientConnectorError", "ClientConnectionError", "ServerDisconnectedError"):
            return False
        if type(cur) in _LOCAL_ERRORS or (isinstance(cur, _LOCAL_ERRORS) and type(cur).__module__ != "openai"
                                          and not type(cur).__module__.startswith("litellm")):
            local = True
        cur = cur.__cause__ or cur.__context__
        seen += 1
    return local


def _in_chain(e: BaseException, kinds: type | tuple[type, ...]) -> BaseException | None:
    seen, cur = 0, e
    while cur is not None and seen < 10:
        if isinstance(cur, kinds):
            return cur
        cur = cur.__cause__ or cur.__context__
        seen += 1
    return None


def _malformed(e: BaseException, backend: str) -> UpstreamError:
    kind = e.kind if isinstance(e, AnswerRejected) else "malformed"
    detail = str(e) if isinstance(e, AnswerRejected) else f"the answer could not be read ({type(e).__name__})"
    return UpstreamError(f"{backend}: {detail}", kind=kind, retryable=True, backend=backend, detail=detail)  # type: ignore[arg-type]


# Errors of the connection itself, after the answer began (a stream cut mid-way).
_TRANSPORT_ERRORS = (httpx.TransportError, aiohttp.ClientError, OSError, ConnectionError)


def map_litellm_error(e: Exception, backend: str, limits: AnswerLimits | None = None,
                      secrets: list[str] | None = None) -> UpstreamError:
    """litellm/openai exceptions → UpstreamError with the upstream status and whether a retry may help.

    `limits`: the call's, whose `status` says whether a 2xx answer had arrived (then litellm's failure to read
    it is the upstream's: "malformed"). `secrets`: masked out of the message with everything key-shaped."""
    import openai

    rejected = _in_chain(e, AnswerRejected)
    if rejected is not None:  # our own cap or SSE check, raised while litellm read the answer
        return _malformed(rejected, backend)
    detail = redact(provider_message(e), secrets or ())
    message = f"{backend}: {type(e).__name__}: {detail}"
    if isinstance(e, openai.APITimeoutError):  # litellm.Timeout
        return UpstreamError(message, kind="timeout", retryable=True, backend=backend, detail=detail)
    answered = limits is not None and limits.status is not None and 200 <= limits.status < 300
    if answered:
        kind = "protocol" if _in_chain(e, _TRANSPORT_ERRORS) is not None else "malformed"  # cut, or unreadable
        return UpstreamError(message, kind=kind, retryable=True, backend=backend, detail=detail)
    if _raised_locally(e):  # e.g. content an integer: nothing was sent, and no retry or backend can fix it
        return UpstreamError(message, kind="request", retryable=False, backend=backend, detail=detail)
    if isinstance(e, openai.APIConnectionError) or _caused_by_connect_error(e):
        return UpstreamError(message, kind="connect", retryable=True, backend=backend, detail=detail)
    status = getattr(e, "status_code", None)
    if not isinstance(status, int):
        # Not an HTTP answer (e.g. a malformed response): another attempt or backend may do better.
        return UpstreamError(message, kind="protocol", retryable=True, backend=backend, detail=detail)
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
                         retry_after=retry_after, backend=backend, detail=detail)


async def stop_litellm_workers() -> None:
    """Stop litellm's background logging worker on this event loop (at gateway shutdown).

    litellm starts it lazily on the loop of the first call; left running, it dies noisily when the
    loop closes. We keep our own ledger, so anything it still holds is discarded.
    """
    from litellm.litellm_core_utils.logging_worker import GLOBAL_LOGGING_WORKER

    session = litellm.aclient_session
    if session is not None and isinstance(session._transport, GuardedTransport):
        await session._transport.aclose()  # this event loop's pooled connections
    try:
        await GLOBAL_LOGGING_WORKER.stop(discard_pending=True, timeout=2.0)
    except RuntimeError as exc:  # started on an earlier event loop that is closed now (tests): nothing to stop
        logging.getLogger("switchyard.backends").debug("litellm logging worker: %s", exc)
