"""Completions and Responses requests served by a chat-only upstream (llama.cpp, older vLLM, many
OpenAI-compatible providers) as chat completions, and their answers translated back.

Which backends are chat-only: those whose policy entry lists `endpoints:` without `completions` (or without
`responses`), and those that answered 404 on /v1/completions or /v1/responses. After such a 404 the request is
retried once as a chat completion; if the upstream answers that (anything but another 404), the endpoint is
marked missing on that backend for the life of the process, and later requests go straight to chat. A chat 404
too means a wrong model name or base URL, not a missing endpoint: nothing is learned, the 404 stands.

Completions → chat: the prompt (one string) becomes the one user message, and the upstream applies its chat
template, so the model answers the prompt as a chat turn rather than continuing the raw text. Every other field
(max_tokens, temperature, n, stop, seed, logit_bias, user, stream_options…) is carried over. What a chat
completion cannot carry is refused with a 400 naming the parameter, never dropped: `echo`, `logprobs`,
`suffix`, `best_of` above `n`, and a prompt of token ids or of several prompts. The answer comes back as a
`text_completion` (streams: `text_completion` chunks), with the upstream's usage.

Responses → chat: gateway/responses_api.py (the translation engines use), plain and streamed as typed events.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from gateway import responses_api
from gateway.backends.base import Completion, Endpoint, UpstreamError

if TYPE_CHECKING:
    from gateway.backends.base import Backend

log = logging.getLogger("switchyard.backends")

TRANSLATABLE = frozenset({"completions", "responses"})
SERVED_AS = "chat"

# Completions parameters a chat completion cannot carry, and why (the 400's message).
_WHY = {
    "echo": "a chat completion does not return the prompt with the answer",
    "logprobs": "completions log probabilities (tokens, text offsets) are not translated from chat's",
    "suffix": "a chat completion has no text after the insertion point",
    "best_of": "a chat completion cannot generate more choices than it returns (best_of above n)",
    "prompt": "only one text prompt can be sent as a chat message (not token ids, not several prompts)",
}
_NOT_CARRIED = frozenset({"prompt", "echo", "logprobs", "suffix", "best_of"})


# ---------------------------------------------------------------- requests


def untranslatable(body: dict) -> str | None:
    """The first parameter of a completions body that a chat completion cannot carry (None: it translates)."""
    if body.get("echo"):
        return "echo"
    if body.get("logprobs") is not None:
        return "logprobs"
    if body.get("suffix"):
        return "suffix"
    best_of, n = body.get("best_of"), body.get("n") or 1
    if isinstance(best_of, int) and best_of > n:
        return "best_of"
    if _prompt_text(body.get("prompt")) is None:
        return "prompt"
    return None


def refusal_message(param: str) -> str:
    return (f"'{param}' cannot be served by a chat-only backend (it lacks /v1/completions, and the request is "
            f"sent as a chat completion): {_WHY[param]}.")


def _prompt_text(prompt: Any) -> str | None:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    return None


def completions_to_chat(body: dict) -> dict:
    """A translatable (`untranslatable(body) is None`) completions request as a chat completions request."""
    chat = {k: v for k, v in body.items() if k not in _NOT_CARRIED}
    chat["messages"] = [{"role": "user", "content": _prompt_text(body.get("prompt"))}]
    return chat


# ---------------------------------------------------------------- answers


def _completion_choice(choice: dict, text: str | None) -> dict:
    return {"index": choice.get("index", 0), "text": text or "", "logprobs": None,
            "finish_reason": choice.get("finish_reason")}


def _completion_head(chat: dict) -> dict:
    rid = str(chat.get("id") or "")
    head = {"id": "cmpl-" + rid.removeprefix("chatcmpl-") if rid else "cmpl-chat", "object": "text_completion",
            "created": chat.get("created"), "model": chat.get("model")}
    if chat.get("system_fingerprint"):
        head["system_fingerprint"] = chat["system_fingerprint"]
    return head


def chat_to_completion(chat: dict) -> dict:
    """A chat completion as the text_completion it answers."""
    body = _completion_head(chat)
    body["choices"] = [_completion_choice(c, (c.get("message") or {}).get("content")) for c in chat.get("choices")
                       or ()]
    for key in ("usage", "switchyard"):  # switchyard: an engine's device time, for accounting (popped later)
        if key in chat:
            body[key] = chat[key]
    return body


def chat_chunk_to_completion(chunk: dict) -> dict | None:
    """A chat stream chunk as a completions stream chunk; None for one that carries nothing (the role-only first
    chunk of a chat stream)."""
    choices = [_completion_choice(c, (c.get("delta") or {}).get("content")) for c in chunk.get("choices") or ()]
    if not chunk.get("usage") and "switchyard" not in chunk and not any(
            c["text"] or c["finish_reason"] for c in choices):
        return None
    out = _completion_head(chunk)
    out["choices"] = choices
    for key in ("usage", "switchyard"):
        if key in chunk:
            out[key] = chunk[key]
    return out


async def _completion_chunks(chunks: AsyncIterator[dict]) -> AsyncIterator[dict]:
    async with contextlib.aclosing(chunks):  # type: ignore[type-var]
        async for chunk in chunks:
            out = chat_chunk_to_completion(chunk)
            if out is not None:
                yield out


def ledger_endpoint(endpoint: str, served_as: str | None) -> str:
    """A ledger row's `endpoint`: the client's (ledger/record.py ENDPOINT_NAMES), with " via chat" when a chat-only
    backend served it as a chat completion, e.g. "completions via chat", "responses via chat"."""
    return f"{endpoint} via {served_as}" if served_as else endpoint


# ---------------------------------------------------------------- serving


def _translates(backend: Backend, endpoint: Endpoint) -> bool:
    return endpoint in backend.served_as_chat


def _endpoint_missing(e: UpstreamError) -> bool:
    return e.kind == "http" and e.status == 404


def _learn(backend: Backend, endpoint: Endpoint, chat_outcome: UpstreamError | None) -> None:
    """The endpoint 404'd and chat then answered (a success, or an HTTP error other than 404): it is missing."""
    if (chat_outcome is None or (chat_outcome.kind == "http" and chat_outcome.status != 404)) \
            and endpoint not in backend.served_as_chat:
        backend.served_as_chat.add(endpoint)
        log.warning("backend %s answered 404 on /v1/%s and serves chat: its %s requests go out as chat completions "
                    "from now on (set `endpoints:` in the policy to say so up front)", backend.name, endpoint, endpoint)


class Untranslatable(UpstreamError):
    """A completions request a chat-only backend cannot serve: the client's 400, naming the parameter. Another
    backend of the chain (one with /v1/completions) may serve it, so it falls back; the breaker does not move."""

    def __init__(self, backend: Backend, param: str):
        message = refusal_message(param)
        super().__init__(f"{backend.name}: {message}", kind="http", status=400, retryable=False,
                         backend=backend.name, detail=message,
                         body={"error": {"message": message, "type": "invalid_request_error", "param": param,
                                         "code": "unsupported_parameter"}})
        self.fallback = True


async def _complete_as_chat(backend: Backend, payload: dict, endpoint: Endpoint) -> Completion:
    if endpoint == "responses":
        done = await backend.complete(responses_api.to_chat(payload), "chat")
        body = responses_api.to_response(done.body, payload)
    else:
        param = untranslatable(payload)
        if param is not None:
            raise Untranslatable(backend, param)
        done = await backend.complete(completions_to_chat(payload), "chat")
        body = chat_to_completion(done.body)
    return Completion(body, done.usage, done.device_seconds, done.utilisation, served_as=SERVED_AS,
                      device_kind=done.device_kind)


async def complete(backend: Backend, payload: dict, endpoint: Endpoint) -> Completion:
    """`backend.complete`, with completions and Responses requests sent as chat where the backend lacks them."""
    if endpoint not in TRANSLATABLE:
        return await backend.complete(payload, endpoint)
    if _translates(backend, endpoint):
        return await _complete_as_chat(backend, payload, endpoint)
    try:
        return await backend.complete(payload, endpoint)
    except UpstreamError as missing:
        if not _endpoint_missing(missing):
            raise
        try:
            done = await _complete_as_chat(backend, payload, endpoint)
        except UpstreamError as e:
            if not isinstance(e, Untranslatable):  # refused before chat was tried: nothing learned
                _learn(backend, endpoint, e)
            raise (missing if _endpoint_missing(e) else e) from None
        _learn(backend, endpoint, None)
        return done


def _stream_as_chat(backend: Backend, payload: dict, endpoint: Endpoint) -> AsyncIterator[dict]:
    if endpoint == "responses":
        return responses_api.stream_events(backend.stream(responses_api.to_chat(payload), "chat"), payload)
    param = untranslatable(payload)
    if param is not None:
        raise Untranslatable(backend, param)
    return _completion_chunks(backend.stream(completions_to_chat(payload), "chat"))


class TranslatingStream:
    """`backend.stream`, with completions and Responses streams served as chat where the backend lacks them.
    `served_as` is "chat" once the first chunk came from a translated chat stream. Closing it closes the
    upstream stream."""

    __slots__ = ("_gen", "served_as")

    def __init__(self, backend: Backend, payload: dict, endpoint: Endpoint):
        self.served_as: str | None = None
        self._gen = self._run(backend, payload, endpoint)

    def __aiter__(self) -> TranslatingStream:
        return self

    async def __anext__(self) -> dict:
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        await self._gen.aclose()

    async def _run(self, backend: Backend, payload: dict, endpoint: Endpoint) -> AsyncIterator[dict]:
        if _translates(backend, endpoint):
            chat = _stream_as_chat(backend, payload, endpoint)
            self.served_as = SERVED_AS
            async with contextlib.aclosing(chat):  # type: ignore[type-var]
                async for chunk in chat:
                    yield chunk
            return
        native = backend.stream(payload, endpoint)
        async with contextlib.aclosing(native):  # type: ignore[type-var]
            try:
                first = await native.__anext__()
            except UpstreamError as e:
                if not _endpoint_missing(e):
                    raise
                missing = e
            except StopAsyncIteration:
                return
            else:
                yield first
                async for chunk in native:
                    yield chunk
                return
        chat, first = await self._open_as_chat(backend, payload, endpoint, missing)
        self.served_as = SERVED_AS
        async with contextlib.aclosing(chat):  # type: ignore[type-var]
            yield first
            async for chunk in chat:
                yield chunk

    @staticmethod
    async def _open_as_chat(backend: Backend, payload: dict, endpoint: Endpoint,
                            missing: UpstreamError) -> tuple[AsyncIterator[dict], dict]:
        """The chat stream and its first chunk after the endpoint's 404, learning from how chat answered."""
        chat = _stream_as_chat(backend, payload, endpoint)  # Untranslatable: refused, nothing learned
        try:
            first = await chat.__anext__()
        except UpstreamError as e:
            await chat.aclose()  # type: ignore[attr-defined]
            _learn(backend, endpoint, e)
            raise (missing if _endpoint_missing(e) else e) from None
        except BaseException:
            await chat.aclose()  # type: ignore[attr-defined]
            raise
        _learn(backend, endpoint, None)
        return chat, first


def stream(backend: Backend, payload: dict, endpoint: Endpoint) -> AsyncIterator[dict]:
    """`backend.stream`, translated where needed (see TranslatingStream)."""
    if endpoint not in TRANSLATABLE:
        return backend.stream(payload, endpoint)
    return TranslatingStream(backend, payload, endpoint)
