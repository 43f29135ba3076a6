"""What every backend returns and raises: the OpenAI JSON body, token usage, and a typed upstream error."""
from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from gateway.responses_api import END_EVENTS
from openai_wire import chunk_text

if TYPE_CHECKING:
    from gateway.policy import BackendSpec

# "embeddings" is served by `complete` only; "responses" bodies are the Responses API's (gateway/responses_api.py).
Endpoint = Literal["chat", "completions", "embeddings", "responses"]
# "request": refused before it left the gateway (e.g. litellm could not build the provider's request from it).
# "malformed": a 2xx answer that is not what the wire format says (not JSON, not SSE, bad SSE data);
# "too_large": an answer (or one SSE event, or a whole stream) past the backend's size cap. Both are the
# upstream's fault: retried, fallen back from, counted by the breaker. "circuit_open": no attempt was made,
# every backend of the chain had its breaker open.
ErrorKind = Literal["timeout", "connect", "http", "protocol", "request", "malformed", "too_large", "circuit_open"]

# 408 (request timeout), 409 (OpenAI's lock timeout), 429 (rate limit) and 5xx are worth another try.
RETRYABLE_STATUSES = frozenset({408, 409, 429})


# The upstream rejected *our* credentials or model name: retrying the same backend is useless, but the
# request itself may be fine, so the next backend in the chain is tried. It is our misconfiguration, not the
# client's fault (a 502 if no backend serves it) and not an outage: it does not count against the breaker
# (opening it would not heal a bad key), so the next request tries the backend again.
BACKEND_FAULT_STATUSES = frozenset({401, 403, 404})

# Only these say the backend itself is unwell and count against its circuit breaker: no connection, a
# timeout (408 included), a malformed answer, a 5xx. A 4xx is about the request (or our configuration), and
# a 409/429 says "busy": retried, but a busy provider is not a broken one.
_TRANSPORT_KINDS = frozenset({"timeout", "connect", "protocol", "malformed", "too_large"})


def is_retryable_status(status: int) -> bool:
    return status >= 500 or status in RETRYABLE_STATUSES


class UpstreamError(Exception):
    """A backend call that failed.

    `retryable`: another attempt on the same backend may succeed (429, 5xx, timeouts, connection errors).
    `fallback`: another backend may succeed — true when retryable, and for 401/403/404 (a backend
    misconfigured with a bad key or model name). False for any other 4xx and for kind "request" (refused
    before it was sent): the request itself is at fault, and would fail everywhere.
    `counts_against_backend`: the failure says the backend is unwell (transport errors, 408, 5xx): only these
    move its circuit breaker.
    """

    def __init__(self, message: str, *, kind: ErrorKind, status: int | None = None, retryable: bool = True,
                 body: dict | None = None, retry_after: float | None = None, backend: str | None = None,
                 detail: str | None = None):
        super().__init__(message)
        self.message = message  # for the gateway's log: names the backend
        self.detail = detail  # the upstream's own words (no litellm wrapping), quotable to the client
        self.kind = kind
        self.status = status
        self.retryable = retryable
        self.fallback = retryable or status in BACKEND_FAULT_STATUSES
        self.counts_against_backend = kind in _TRANSPORT_KINDS or (status is not None and (
            status >= 500 or status == 408))
        self.body = body  # the upstream's OpenAI error body, when it sent one
        self.retry_after = retry_after  # seconds, from the upstream's Retry-After header
        self.backend = backend
        self.attempts = 0  # set by the fallback loop: attempts made before giving up

    def __repr__(self) -> str:
        return (f"UpstreamError({self.message!r}, kind={self.kind!r}, status={self.status}, "
                f"retryable={self.retryable}, backend={self.backend!r})")


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    # Engines with KV tiers: prompt tokens restored from host memory / disk (already in cached_prompt_tokens);
    # None when the backend does not say (usage.switchyard_prompt_tokens).
    restored_host_tokens: int | None = None
    restored_disk_tokens: int | None = None


@dataclass(slots=True)
class Completion:
    body: dict  # the OpenAI response: chat.completion, text_completion, an embeddings list or a Response
    usage: Usage
    device_seconds: float | None = None  # engine backends: device time spent on this request
    utilisation: float | None = None  # engine backends: the engine's measured busy fraction
    served_as: str | None = None  # "chat": a completions/Responses request sent as chat (backends/translate.py)
    device_kind: str | None = None  # engine backends: "cpu" | "gpu", what the engine says served this request


def usage_from_dict(usage: dict | None) -> Usage | None:
    """An OpenAI `usage` object as Usage (None when absent): chat/completions/embeddings `prompt_tokens`…, or
    the Responses API's `input_tokens`/`output_tokens`."""
    if not usage:
        return None
    if "input_tokens" in usage:
        details = usage.get("input_tokens_details") or {}
        return Usage(int(usage.get("input_tokens") or 0), int(usage.get("output_tokens") or 0),
                     int(details.get("cached_tokens") or 0))
    details = usage.get("prompt_tokens_details") or {}
    split = usage.get("switchyard_prompt_tokens")
    host, disk = (_count(split.get("restored_host")), _count(split.get("restored_disk"))) \
        if isinstance(split, dict) else (None, None)
    return Usage(int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0),
                 int(details.get("cached_tokens") or 0), host, disk)


def _count(value: object) -> int | None:
    """A token count from an upstream's extension field; anything but a non-negative integer is None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def usage_from_chunk(chunk: dict) -> Usage | None:
    """The usage carried by a response body or stream chunk (the last chunk, with include_usage)."""
    return usage_from_dict(chunk.get("usage"))


_DEVICE_KINDS = frozenset({"cpu", "gpu"})


def engine_stats(body: dict) -> tuple[float | None, float | None, str | None]:
    """(device_seconds, utilisation, device_kind) from the engine's top-level "switchyard" extension object.
    A device kind other than cpu/gpu is ignored (the row then takes the scraped or the policy's kind)."""
    ext = body.get("switchyard")
    if not isinstance(ext, dict):
        return None, None, None
    ds, ut, kind = ext.get("device_seconds"), ext.get("utilisation"), ext.get("device_kind")
    return (float(ds) if ds is not None else None, float(ut) if ut is not None else None,
            kind if kind in _DEVICE_KINDS else None)


def requesting_usage(stream_options: object) -> dict:
    """A stream's `stream_options` with `include_usage` forced on: every backend needs the final usage chunk
    to account for the request (the relay drops it again for clients that did not ask for it)."""
    return {**stream_options, "include_usage": True} if isinstance(stream_options, dict) else {"include_usage": True}


class StreamTally:
    """Follows a stream's chunks: the final usage and engine figures, or a count of what was produced.

    When a stream ends early (client gone, upstream cut) there is no usage chunk; `usage()` then falls back
    to one completion token per content-bearing chunk, which is what engines and OpenAI send.
    """

    __slots__ = ("_usage", "chunks", "content_chunks", "device_kind", "device_seconds", "keep_text", "parts",
                 "utilisation")

    def __init__(self, keep_text: bool = False):
        self._usage: Usage | None = None
        self.chunks = 0
        self.content_chunks = 0
        self.device_seconds: float | None = None
        self.utilisation: float | None = None
        self.device_kind: str | None = None
        self.keep_text = keep_text
        self.parts: list[str] = []

    def observe(self, chunk: dict) -> None:
        self.chunks += 1
        kind = chunk.get("type")
        if kind is None:  # a chat or completions chunk
            text, usage = chunk_text(chunk), chunk.get("usage")
        else:  # a Responses API event: text in its deltas, usage in the response that ends it
            text = chunk.get("delta") if kind == "response.output_text.delta" else None
            usage = (chunk.get("response") or {}).get("usage") if kind in END_EVENTS else None
        if text:
            self.content_chunks += 1
            if self.keep_text:
                self.parts.append(text)
        if usage:
            self._usage = usage_from_dict(usage)
        if chunk.get("switchyard"):
            self.device_seconds, self.utilisation, self.device_kind = engine_stats(chunk)

    @property
    def complete_usage(self) -> bool:
        return self._usage is not None

    def usage(self, prompt_tokens: int = 0) -> Usage:
        """The upstream's usage if it arrived, else `prompt_tokens` (the caller's count) and chunks seen."""
        if self._usage is not None:
            return self._usage
        return Usage(prompt_tokens, self.content_chunks, 0)

    def text(self) -> str:
        return "".join(self.parts)


class Backend(abc.ABC):
    """One upstream. Implementations are safe to share between concurrent requests."""

    def __init__(self, spec: BackendSpec):
        self.name = spec.name
        self.spec = spec
        # Endpoints ("completions", "responses") this upstream lacks, served as chat (gateway/backends/translate.py):
        # those the policy's `endpoints:` leaves out, plus those learned from a 404 while the process runs.
        declared = getattr(spec, "endpoints", None)
        self.served_as_chat: set[str] = set() if declared is None else \
            {e for e in ("completions", "responses") if e not in declared}

    @abc.abstractmethod
    async def complete(self, payload: dict, endpoint: Endpoint) -> Completion:
        """Send a non-streaming request; raise UpstreamError on failure."""

    @abc.abstractmethod
    def stream(self, payload: dict, endpoint: Endpoint) -> AsyncIterator[dict]:
        """Yield OpenAI chunk dicts; the last one carries usage (include_usage is always requested).

        Callers must close the iterator (`aclose()`, or `contextlib.aclosing`) when they stop early; closing
        or cancelling it closes the upstream connection, so the upstream sees the disconnect.
        """

    async def aclose(self) -> None:
        """Release pooled connections."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} model={self.spec.model!r}>"
