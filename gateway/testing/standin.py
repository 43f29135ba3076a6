"""A stand-in OpenAI-compatible upstream for tests and benchmarks, on a bare asyncio HTTP/1.1 server.

It is the baseline the gateway-overhead benchmark measures against, so it does as little as possible per
request: no framework, one `transport.write` per response when no delay is asked for, keep-alive always.
It speaks the real wire format (JSON bodies, SSE with `data: …` and `data: [DONE]`, chunked transfer), so
the official `openai` SDK and litellm's `openai/…` provider work against it unchanged.

Responses are deterministic: `max_tokens` tokens "tok0 tok1 …"; `prompt_tokens` is the number of
whitespace-separated words in the prompt. `/v1/responses` (the Responses API, plain and streamed with its
typed events) answers the same text, `max_output_tokens` long; `/v1/embeddings` answers one vector per input
(`dimensions` long, default 8) from a hash of that input, as floats or base64 (`encoding_format`). With
`chat_only` it plays an upstream without /v1/completions and /v1/responses (both answer 404). Faults and
delays are set at start or through the control endpoint: `POST /_control` with JSON options (see
`StandinOptions`; `{"reset": true}` restores the start options and zeroes the counters);
`GET /_control` returns counters, options and the last payload.

    with run_standin(engine_extension=True) as base_url:      # "http://127.0.0.1:PORT/v1"
        standin_control(base_url, fail_next=2, fail_status=503, retry_after=0.1)
        ...
        standin_stats(base_url)["requests"]

    python -m gateway.testing.standin --port 8100 [--engine-extension]
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import json
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
            408: "Request Timeout", 411: "Length Required", 413: "Content Too Large", 422: "Unprocessable Entity", 429: "Too Many Requests",
            500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout"}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "invalid_request_error",
                422: "invalid_request_error", 429: "rate_limit_error"}
_SSE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
             b"transfer-encoding: chunked\r\n\r\n")
_DONE = b"data: [DONE]\n\n"
FAULTS = frozenset({"not_json", "not_sse", "bad_sse", "no_done", "huge", "huge_stream", "hang"})
_KINDS = {"/chat/completions": "chat", "/completions": "completions", "/responses": "responses",
          "/embeddings": "embeddings"}


@dataclass(slots=True)
class StandinOptions:
    engine_extension: bool = False  # add the engine's "switchyard": {device_seconds, utilisation} object
    fail_next: int = 0  # answer the next N completion requests with fail_status
    fail_status: int = 500
    retry_after: float | None = None  # seconds, sent as Retry-After with injected failures
    drop_next: int = 0  # close the connection without answering the next N completion requests
    first_byte_delay_ms: float = 0.0
    token_delay_ms: float = 0.0  # between streamed tokens (for disconnect tests)
    drop_after_tokens: int | None = None  # streams: cut the connection after this many tokens
    cached_tokens: int = 0  # reported as prompt_tokens_details.cached_tokens (capped at prompt_tokens)
    default_max_tokens: int = 16
    device_seconds_per_token: float = 0.001  # engine extension: (prompt + completion) × this
    utilisation: float = 0.5  # engine extension
    device_kind: str | None = None  # engine extension: "cpu" | "gpu" (what served the request), omitted if None
    # Malformed answers (the upstream is not trusted): the next `fault_next` completion requests get `fault`:
    #   not_json   a 200 whose body is not JSON (an HTML error page), for plain and streamed requests alike
    #   not_sse    streams: a 200 text/html body, no SSE at all (plain requests: as not_json)
    #   bad_sse    streams: two tokens, then an SSE event whose data is not JSON (plain: truncated JSON)
    #   no_done    streams: two tokens, then a clean end of the body without [DONE] (plain: as not_json)
    #   huge       a valid answer `huge_bytes` long: plain, one JSON body; streamed, one SSE event that size
    #   huge_stream  streams: many normal-sized events adding up to `huge_bytes`
    #   hang       plain: never answer; streams: two tokens, then nothing (until the client leaves)
    fault: str | None = None
    fault_next: int = 0
    huge_bytes: int = 50_000_000
    # The message of injected failures (fail_next); "{authorization}" is replaced by the request's
    # Authorization header, the way some providers quote the key they refused.
    fail_message: str | None = None
    # An upstream that serves chat completions only (llama.cpp, older vLLM, many OpenAI-compatible providers):
    # /v1/completions and /v1/responses answer 404, as those servers do for a path they lack.
    chat_only: bool = False
    # A prefix cache, as an engine's KV cache (for fleet benchmarks and tests): with prefill_ms_per_token > 0
    # the prompt's words (each chat message's role, then its words) are cut into blocks of prefix_block_words,
    # each block's hash chained to the one before; blocks seen before (an LRU of prefix_cache_blocks) are the
    # answer's cached_tokens, and its first byte waits for the others' prefill, prefill_ms_per_token a word,
    # one prefill at a time (later requests queue behind it). /metrics then reports requests running.
    prefill_ms_per_token: float = 0.0
    prefix_block_words: int = 16
    prefix_cache_blocks: int = 4096


@dataclass(slots=True)
class StandinStats:
    requests: int = 0  # model requests received (chat, completions, responses, embeddings), failed ones included
    chat_requests: int = 0
    completion_requests: int = 0
    responses_requests: int = 0
    embedding_requests: int = 0
    not_found: int = 0  # requests to an endpoint the stand-in lacks (chat_only), counted in their kind too
    completed: int = 0  # responses written in full
    failed: int = 0  # injected failures and drops
    disconnects: int = 0  # clients that went away before their response was complete
    open_connections: int = 0
    connections_total: int = 0
    in_flight: int = 0
    prompt_tokens: int = 0  # prefix-cache model: prompt tokens received, and how many of them were cached
    cached_tokens: int = 0
    last_payload: Any = None


class _State:
    def __init__(self, options: StandinOptions):
        self.initial = dataclasses.replace(options)
        self.options = options
        self.stats = StandinStats()
        self.seq = 0
        self.connections: set[_Connection] = set()
        self.prefix: OrderedDict[int, None] = OrderedDict()  # the prefix-cache model's blocks, LRU order
        self.prefill_free_at = 0.0  # when the prefill queue empties (time.monotonic())

    def prefill_ms(self, payload: dict, kind: str, req: _Request) -> float:
        """The prefix-cache model (StandinOptions.prefill_ms_per_token): set the request's cached tokens, and
        return how long its first byte waits (its queue wait plus its uncached words' prefill)."""
        opts, words = self.options, _prompt_words(payload, kind)
        size = max(opts.prefix_block_words, 1)
        cached, h, hit = 0, 0, True
        for start in range(0, len(words) - len(words) % size, size):
            h = hash((h, tuple(words[start:start + size])))
            if hit and h in self.prefix:
                cached += size
            else:
                hit = False
            self.prefix[h] = None
            self.prefix.move_to_end(h)
        while len(self.prefix) > opts.prefix_cache_blocks:
            self.prefix.popitem(last=False)
        cached = min(cached, req.prompt)
        req.usage["prompt_tokens_details"]["cached_tokens"] = cached
        self.stats.prompt_tokens += req.prompt
        self.stats.cached_tokens += cached
        now = time.monotonic()
        self.prefill_free_at = max(now, self.prefill_free_at) + (len(words) - cached) * opts.prefill_ms_per_token / 1000
        return (self.prefill_free_at - now) * 1000

    def control(self, update: dict) -> None:
        if update.pop("reset", False):
            self.options = dataclasses.replace(self.initial)
            open_now = self.stats.open_connections
            self.stats = StandinStats(open_connections=open_now)
            self.prefix.clear()
            self.prefill_free_at = 0.0
        names = {f.name for f in dataclasses.fields(StandinOptions)}
        unknown = set(update) - names
        if unknown:
            raise ValueError(f"unknown option(s) {sorted(unknown)}; known: {sorted(names)}")
        if update.get("fault") not in FAULTS | {None}:
            raise ValueError(f"unknown fault {update['fault']!r}; known: {sorted(FAULTS)}")
        for k, v in update.items():
            setattr(self.options, k, v)

    def snapshot(self) -> dict:
        return {**dataclasses.asdict(self.stats), "options": dataclasses.asdict(self.options)}


def _count_words(value: Any) -> int:
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, list):
        return sum(1 if isinstance(v, int) else _count_words(v) for v in value)
    if isinstance(value, dict):  # a content part {"type": "text", "text": …}
        return _count_words(value.get("text", ""))
    return 0


def _words(value: Any) -> list[str]:
    if isinstance(value, str):
        return value.split()
    if isinstance(value, list):
        return [w for v in value for w in _words(v)]
    if isinstance(value, dict):
        return _words(value.get("text", ""))
    return []


def _prompt_words(payload: dict, kind: str) -> list[str]:
    """The prompt as the prefix-cache model sees it: each chat message's role, then its words."""
    if kind == "chat":
        return [w for m in payload.get("messages") or () if isinstance(m, dict)
                for w in [str(m.get("role")), *_words(m.get("content"))]]
    if kind == "responses":
        return _words(payload.get("instructions") or "") + _words(payload.get("input"))
    return _words(payload.get("prompt", ""))


def _prompt_tokens(payload: dict, kind: str) -> int:
    if kind == "chat":
        return sum(_count_words(m.get("content")) for m in payload.get("messages") or () if isinstance(m, dict))
    if kind == "responses":
        items = payload.get("input")
        if isinstance(items, list):
            items = [i.get("content") if isinstance(i, dict) else i for i in items]
        return _count_words(payload.get("instructions") or "") + _count_words(items)
    return _count_words(payload.get("prompt", ""))


def _choices(payload: dict, kind: str) -> tuple[int, int]:
    """(choices answered, sequences generated): n per prompt, and completions' best_of per prompt at least."""
    if kind not in ("chat", "completions"):
        return 1, 1
    prompt = payload.get("prompt") if kind == "completions" else None
    prompts = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list) else 1
    n = payload.get("n") if isinstance(payload.get("n"), int) and payload.get("n") > 0 else 1
    best_of = payload.get("best_of") if kind == "completions" and isinstance(payload.get("best_of"), int) else 1
    return prompts * n, prompts * max(n, best_of)


def embedding_vector(item: Any, dimensions: int = 8) -> list[float]:
    """The stand-in's vector for one embeddings input: `dimensions` floats in [-1, 1] from its SHA-256."""
    seed = json.dumps(item, separators=(",", ":")).encode()
    raw = b"".join(hashlib.sha256(seed + b"%d" % i).digest() for i in range(dimensions // 32 + 1))
    return [round(b / 127.5 - 1.0, 6) for b in raw[:dimensions]]


def _embeddings_body(payload: dict) -> dict:
    items = payload.get("input")
    if isinstance(items, str) or (isinstance(items, list) and items and isinstance(items[0], int)):
        items = [items]
    dims = payload.get("dimensions") if isinstance(payload.get("dimensions"), int) else 8
    data = []
    for i, item in enumerate(items or ()):
        vector: Any = embedding_vector(item, dims)
        if payload.get("encoding_format") == "base64":
            vector = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        data.append({"object": "embedding", "index": i, "embedding": vector})
    tokens = sum(len(item) if isinstance(item, list) else _count_words(item) for item in items or ())
    return {"object": "list", "data": data, "model": payload.get("model", "standin"),
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _response(status: int, body: bytes, content_type: bytes = b"application/json", extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n%s\r\n"
            % (status, _REASONS.get(status, "Error").encode(), content_type, len(body), extra)) + body


def _error(status: int, message: str, extra: bytes = b"") -> bytes:
    body = {"error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"),
                      "param": None, "code": None}}
    return _response(status, json.dumps(body).encode(), extra=extra)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _event(obj: dict) -> bytes:
    return _chunk(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")


class _Request:
    __slots__ = (
        "chat",
        "choices",
        "created",
        "ext",
        "include_usage",
        "kind",
        "model",
        "n",
        "payload",
        "prefill_ms",
        "prompt",
        "rid",
        "seq",
        "stream",
        "usage",
    )

    def __init__(self, state: _State, payload: dict, kind: str):
        opts = state.options
        state.seq += 1
        self.seq = state.seq
        self.kind = kind
        self.chat = kind == "chat"
        chat = self.chat
        self.payload = payload
        self.model = payload.get("model", "standin")
        n = payload.get("max_completion_tokens") or payload.get("max_tokens") or payload.get("max_output_tokens")
        self.n = int(n) if isinstance(n, int) and n >= 0 else opts.default_max_tokens
        self.prompt = _prompt_tokens(payload, kind)
        # `n` choices per prompt (a completions list holds several prompts); best_of generates (and bills) that many
        self.choices, generated = _choices(payload, kind)
        completion = generated * self.n
        self.usage = {"prompt_tokens": self.prompt, "completion_tokens": completion,
                      "total_tokens": self.prompt + completion,
                      "prompt_tokens_details": {"cached_tokens": min(opts.cached_tokens, self.prompt)}}
        self.ext = ({"device_seconds": (self.prompt + completion) * opts.device_seconds_per_token,
                     "utilisation": opts.utilisation} if opts.engine_extension else None)
        if self.ext is not None and opts.device_kind is not None:
            self.ext["device_kind"] = opts.device_kind
        self.rid = f"{'chatcmpl' if chat else 'cmpl'}-standin-{state.seq}"
        self.created = int(time.time())
        self.stream = bool(payload.get("stream"))
        so = payload.get("stream_options")
        self.include_usage = bool(isinstance(so, dict) and so.get("include_usage"))
        self.prefill_ms = 0.0  # the prefix-cache model's wait before the first byte

    def finish_reason(self) -> str:
        return "length" if "max_tokens" in self.payload or "max_completion_tokens" in self.payload else "stop"

    def text(self) -> str:
        return " ".join(f"tok{i}" for i in range(self.n))

    # ---- the Responses API (/v1/responses): one message item with one output_text part

    def response_object(self, done: bool) -> dict:
        incomplete = done and "max_output_tokens" in self.payload
        out = {"id": f"resp_standin{self.seq}", "object": "response", "created_at": self.created,
               "status": ("incomplete" if incomplete else "completed") if done else "in_progress",
               "model": self.model, "output": [self.message_item(done)] if done else [],
               "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "error": None,
               "instructions": self.payload.get("instructions"), "metadata": self.payload.get("metadata") or {},
               "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
               "temperature": self.payload.get("temperature"), "top_p": self.payload.get("top_p"),
               "max_output_tokens": self.payload.get("max_output_tokens"),
               "text": self.payload.get("text") or {"format": {"type": "text"}}, "usage": None}
        if done:
            out["usage"] = {"input_tokens": self.prompt, "output_tokens": self.n,
                            "total_tokens": self.prompt + self.n,
                            "input_tokens_details": {"cached_tokens": min(self.usage["prompt_tokens_details"]
                                                                          ["cached_tokens"], self.prompt),
                                                     "cache_write_tokens": 0},
                            "output_tokens_details": {"reasoning_tokens": 0}}
        return out  # no engine extension: the engine serves no /v1/responses of its own

    def message_item(self, done: bool) -> dict:
        content = [{"type": "output_text", "text": self.text(), "annotations": []}] if done else []
        return {"type": "message", "id": f"msg_standin{self.seq}", "role": "assistant",
                "status": "completed" if done else "in_progress", "content": content}

    def response_event(self, kind: str, seq: int, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": seq, **fields}
        return _chunk(b"event: " + kind.encode() + b"\ndata: " + json.dumps(body, separators=(",", ":")).encode()
                      + b"\n\n")

    def response_head_events(self) -> bytes:
        item = {"item_id": f"msg_standin{self.seq}", "output_index": 0, "content_index": 0}
        return b"".join((
            self.response_event("response.created", 0, response=self.response_object(False)),
            self.response_event("response.in_progress", 1, response=self.response_object(False)),
            self.response_event("response.output_item.added", 2, output_index=0, item=self.message_item(False)),
            self.response_event("response.content_part.added", 3, **item,
                                part={"type": "output_text", "text": "", "annotations": []})))

    def response_delta_event(self, i: int) -> bytes:
        return self.response_event("response.output_text.delta", 4 + i, item_id=f"msg_standin{self.seq}",
                                   output_index=0, content_index=0, delta=f"tok{i}" if i == 0 else f" tok{i}",
                                   logprobs=[])

    def response_tail_events(self) -> bytes:
        seq = 4 + self.n
        item = {"item_id": f"msg_standin{self.seq}", "output_index": 0, "content_index": 0}
        part = {"type": "output_text", "text": self.text(), "annotations": []}
        final = self.response_object(True)
        return b"".join((
            self.response_event("response.output_text.done", seq, **item, text=self.text(), logprobs=[]),
            self.response_event("response.content_part.done", seq + 1, **item, part=part),
            self.response_event("response.output_item.done", seq + 2, output_index=0, item=self.message_item(True)),
            self.response_event("response.completed" if final["status"] == "completed" else "response.incomplete",
                                seq + 3, response=final),
            b"0\r\n\r\n"))

    def head_events(self) -> bytes:
        return _SSE_HEAD + (self.response_head_events() if self.kind == "responses" else b"")

    def stream_event(self, i: int) -> bytes:
        return self.response_delta_event(i) if self.kind == "responses" else self.token_event(i)

    def stream_tail(self) -> bytes:
        return self.response_tail_events() if self.kind == "responses" else self.tail_events()

    def full_body(self) -> bytes:
        if self.kind == "responses":
            return json.dumps(self.response_object(True), separators=(",", ":")).encode()
        text = self.text()
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": self.finish_reason()}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": self.finish_reason()}
            obj = "text_completion"
        body = {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                "choices": [{**choice, "index": i} for i in range(self.choices)], "usage": self.usage}
        if self.ext is not None:
            body["switchyard"] = self.ext
        return json.dumps(body, separators=(",", ":")).encode()

    def _base(self) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        base = {"id": self.rid, "object": obj, "created": self.created, "model": self.model}
        if self.include_usage:
            base["usage"] = None
        return base

    def token_event(self, i: int) -> bytes:
        piece = f"tok{i}" if i == 0 else f" tok{i}"
        if self.chat:
            delta = {"content": piece} if i else {"role": "assistant", "content": piece}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        else:
            choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": None}
        return b"".join(_event({**self._base(), "choices": [{**choice, "index": c}]}) for c in range(self.choices))

    def piece_event(self, text: str) -> bytes:
        """A chat or completions chunk carrying `text` (the fault modes' filler)."""
        choice = {"index": 0, "delta": {"content": text}} if self.chat else {"index": 0, "text": text}
        return _event({**self._base(), "choices": [{**choice, "logprobs": None, "finish_reason": None}]})

    def tail_events(self) -> bytes:
        """The finish chunk, the usage chunk when asked for, and [DONE]; the extension rides on the last."""
        if self.chat:
            choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": self.finish_reason()}
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": self.finish_reason()}
        finish = {**self._base(), "choices": [choice]}
        out = [_event({**self._base(), "choices": [{**choice, "index": c}]}) for c in range(1, self.choices)]
        if self.include_usage:
            out.append(_event(finish))
            last = {**self._base(), "choices": [], "usage": self.usage}
        else:
            last = finish
        if self.ext is not None:
            last["switchyard"] = self.ext
        out.append(_event(last))
        out.append(_chunk(_DONE))
        out.append(b"0\r\n\r\n")
        return b"".join(out)


class _Connection(asyncio.Protocol):
    def __init__(self, state: _State):
        self.state = state
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.busy = False  # a request is being answered asynchronously
        self.in_flight = False  # a response has been started but not finished
        self.closed = False
        self.lost = asyncio.Event()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.state.connections.add(self)
        self.state.stats.open_connections += 1
        self.state.stats.connections_total += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.state.connections.discard(self)
        self.state.stats.open_connections -= 1
        if self.in_flight:
            self.state.stats.disconnects += 1
            self.state.stats.in_flight -= 1
            self.in_flight = False
        self.lost.set()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._process()

    def _process(self) -> None:
        while not self.busy and not self.closed:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
            try:
                method, target, _ = head[0].split(" ", 2)
            except ValueError:
                self._write_close(_error(400, "malformed request line"))
                return
            headers = {}
            for line in head[1:]:
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip()
            if "chunked" in headers.get("transfer-encoding", ""):
                self._write_close(_error(411, "send a content-length"))
                return
            length = int(headers.get("content-length") or 0)
            if len(self.buf) < end + 4 + length:
                return
            body = bytes(self.buf[end + 4:end + 4 + length])
            del self.buf[:end + 4 + length]
            self._dispatch(method, target.split("?", 1)[0], body, headers)
            if headers.get("connection", "").lower() == "close" and not self.busy:
                self.transport.close()
                return

    def _write_close(self, data: bytes) -> None:
        self.transport.write(data)
        self.transport.close()

    def _dispatch(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> None:
        if path.startswith("/v1/"):
            path = path[3:]
        if path in _KINDS and method == "POST":
            if self.state.options.chat_only and _KINDS[path] in ("completions", "responses"):
                self._not_found(method, path, _KINDS[path])
                return
            self._completion(body, _KINDS[path], headers)
        elif path == "/_control":
            self._control(method, body)
        elif path == "/models" and method == "GET":
            self.transport.write(_response(200, b'{"object":"list","data":[{"id":"standin","object":"model",'
                                                b'"created":0,"owned_by":"standin"}]}'))
        elif path == "/health":
            self.transport.write(_response(200, b'{"status":"ok"}'))
        elif path == "/metrics" and method == "GET":  # answers the gateway's load monitor: up, no load figures
            text = b"# a stand-in: no engine series\nstandin_up 1\n"
            if self.state.options.prefill_ms_per_token > 0:  # the prefix-cache model: what it is working on
                text += b"switchyard_engine_requests_running %d\n" % self.state.stats.in_flight
            self.transport.write(_response(200, text, b"text/plain; version=0.0.4"))
        else:
            self.transport.write(_error(404, f"no route {method} {path}"))

    def _not_found(self, method: str, path: str, kind: str) -> None:
        stats = self.state.stats
        stats.requests += 1
        stats.not_found += 1
        counter = "completion_requests" if kind == "completions" else "responses_requests"
        setattr(stats, counter, getattr(stats, counter) + 1)
        self.transport.write(_error(404, f"no route {method} /v1{path}"))

    def _control(self, method: str, body: bytes) -> None:
        if method == "POST":
            try:
                self.state.control(json.loads(body or b"{}"))
            except (ValueError, TypeError, AttributeError) as e:
                self.transport.write(_error(400, str(e)))
                return
        self.transport.write(_response(200, json.dumps(self.state.snapshot()).encode()))

    def _completion(self, body: bytes, kind: str, headers: dict[str, str]) -> None:
        state, stats, opts = self.state, self.state.stats, self.state.options
        stats.requests += 1
        counter = {"chat": "chat_requests", "completions": "completion_requests", "responses": "responses_requests",
                   "embeddings": "embedding_requests"}[kind]
        setattr(stats, counter, getattr(stats, counter) + 1)
        try:
            payload = json.loads(body)
            if not isinstance(payload, dict):
                raise TypeError("body must be a JSON object")
        except (ValueError, TypeError) as e:
            self.transport.write(_error(400, f"invalid JSON body: {e}"))
            return
        stats.last_payload = payload
        if opts.drop_next > 0:
            opts.drop_next -= 1
            stats.failed += 1
            self.transport.abort()
            return
        if opts.fail_next > 0:
            opts.fail_next -= 1
            stats.failed += 1
            extra = b"retry-after: %s\r\n" % str(opts.retry_after).encode() if opts.retry_after is not None else b""
            message = f"standin: injected {opts.fail_status}" if opts.fail_message is None else \
                opts.fail_message.replace("{authorization}", headers.get("authorization", ""))
            self.transport.write(_error(opts.fail_status, message, extra))
            return
        if opts.fault_next > 0 and opts.fault:
            opts.fault_next -= 1
            stats.failed += 1
            self._fault(opts.fault, _Request(state, payload, kind))
            return
        if kind == "embeddings":
            self.transport.write(_response(200, json.dumps(_embeddings_body(payload)).encode()))
            stats.completed += 1
            return
        req = _Request(state, payload, kind)
        if opts.prefill_ms_per_token > 0:
            req.prefill_ms = state.prefill_ms(payload, kind, req)
        if opts.first_byte_delay_ms or opts.token_delay_ms or opts.drop_after_tokens is not None or req.prefill_ms:
            self.busy = True
            self._begin()
            asyncio.get_running_loop().create_task(self._answer_slowly(req))
            return
        if req.stream:
            parts = [req.head_events()]
            parts.extend(req.stream_event(i) for i in range(req.n))
            parts.append(req.stream_tail())
            self.transport.write(b"".join(parts))
        else:
            self.transport.write(_response(200, req.full_body()))
        stats.completed += 1

    def _fault(self, fault: str, req: _Request) -> None:
        """Answer with one of FAULTS (see StandinOptions.fault)."""
        opts = self.state.options
        if fault == "huge":
            if req.stream:
                self.transport.write(req.head_events() + req.piece_event("x" * opts.huge_bytes) + req.stream_tail())
            else:
                body = json.loads(req.full_body())
                body["choices"][0]["message" if req.chat else "text"] = (
                    {"role": "assistant", "content": "x" * opts.huge_bytes} if req.chat else "x" * opts.huge_bytes)
                self.transport.write(_response(200, json.dumps(body).encode()))
            return
        if fault == "huge_stream" and req.stream:
            count = opts.huge_bytes // 16384 + 1  # distinct pieces: litellm stops a stream that repeats itself
            events = b"".join(req.piece_event(f"{i:08d}" + "x" * 16376) for i in range(count))
            self.transport.write(req.head_events() + events + req.stream_tail())
            return
        if fault in ("bad_sse", "no_done", "hang") and req.stream:
            self.transport.write(req.head_events() + req.stream_event(0) + req.stream_event(1))
            if fault == "bad_sse":
                self.transport.write(_chunk(b"data: {\"choices\": [{\"delta\": \n\n") + req.stream_tail())
            elif fault == "no_done":
                self.transport.write(b"0\r\n\r\n")
            else:
                self._hang()
            return
        if fault == "hang":
            self._hang()
        elif fault == "not_sse" and req.stream:
            page = b"<html><body>upstream proxy: service temporarily unavailable</body></html>\n"
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ntransfer-encoding: chunked\r\n\r\n"
                                 + _chunk(page) + b"0\r\n\r\n")
        elif fault == "bad_sse":
            self.transport.write(_response(200, req.full_body()[:40]))
        else:  # not_json, and the stream-only faults on a plain request
            self.transport.write(_response(200, b"<html><body>502 Bad Gateway</body></html>", b"application/json"))

    def _hang(self) -> None:
        """Send nothing more on this connection until the client goes away."""
        self.busy = True
        self._begin()

        async def wait() -> None:
            await self.lost.wait()
            self.busy = False

        asyncio.get_running_loop().create_task(wait())

    def _begin(self) -> None:
        self.in_flight = True
        self.state.stats.in_flight += 1

    def _end(self) -> None:
        if self.in_flight:
            self.in_flight = False
            self.state.stats.in_flight -= 1

    async def _sleep_or_lost(self, ms: float) -> bool:
        """Sleep; True if the client went away meanwhile."""
        if ms > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.lost.wait(), ms / 1000)
        return self.closed

    async def _answer_slowly(self, req: _Request) -> None:
        opts = self.state.options
        try:
            if await self._sleep_or_lost(opts.first_byte_delay_ms + req.prefill_ms):
                return
            if not req.stream:
                self.transport.write(_response(200, req.full_body()))
                self._end()
                self.state.stats.completed += 1
                return
            self.transport.write(req.head_events())
            for i in range(req.n):
                if i and await self._sleep_or_lost(opts.token_delay_ms):
                    return
                if opts.drop_after_tokens is not None and i >= opts.drop_after_tokens:
                    self._end()
                    self.state.stats.failed += 1
                    self.transport.abort()
                    return
                self.transport.write(req.stream_event(i))
                if self.closed:
                    return
            if await self._sleep_or_lost(opts.token_delay_ms):
                return
            self.transport.write(req.stream_tail())
            self._end()
            self.state.stats.completed += 1
        finally:
            self.busy = False
            if not self.closed:
                self._process()


async def serve_standin(host: str = "127.0.0.1", port: int = 0, options: StandinOptions | None = None,
                        ) -> asyncio.Server:
    """Start the stand-in on the running loop; the caller owns the returned server
    (`close_standin(server)` also drops its open keep-alive connections)."""
    state = _State(options or StandinOptions())
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Connection(state), host, port, backlog=1024)
    server._standin_state = state  # type: ignore[attr-defined]
    return server


async def close_standin(server: asyncio.Server) -> None:
    server.close()
    for conn in list(server._standin_state.connections):  # type: ignore[attr-defined]
        conn.transport.abort()
    await asyncio.sleep(0)
    await server.wait_closed()


def _base_url(server: asyncio.Server) -> str:
    host, port = server.sockets[0].getsockname()[:2]
    return f"http://{host}:{port}/v1"


@contextlib.contextmanager
def run_standin(port: int = 0, *, subprocess_mode: bool = False, host: str = "127.0.0.1",
                **opts: Any) -> Iterator[str]:
    """Run the stand-in in a background thread (default) or a child process; yields "http://HOST:PORT/v1".

    `opts` are StandinOptions fields. Use the subprocess mode for benchmarks so the stand-in does not share
    a GIL with the code being measured.
    """
    options = StandinOptions(**opts)
    if subprocess_mode:
        yield from _run_in_subprocess(host, port, options)
        return
    ready = threading.Event()
    holder: dict[str, Any] = {}

    def main() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            server = loop.run_until_complete(serve_standin(host, port, options))
        except OSError as e:  # surface bind errors to the caller
            holder["error"] = e
            ready.set()
            loop.close()
            return
        holder.update(loop=loop, url=_base_url(server))
        ready.set()
        loop.run_forever()
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.run_until_complete(close_standin(server))
        loop.close()

    thread = threading.Thread(target=main, name="standin", daemon=True)
    thread.start()
    ready.wait(10)
    if "error" in holder:
        raise holder["error"]
    try:
        yield holder["url"]
    finally:
        holder["loop"].call_soon_threadsafe(holder["loop"].stop)
        thread.join(5)


def _run_in_subprocess(host: str, port: int, options: StandinOptions) -> Iterator[str]:
    args = [sys.executable, "-m", "gateway.testing.standin", "--host", host, "--port", str(port),
            "--options", json.dumps(dataclasses.asdict(options))]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.startswith("standin listening on "):
            raise RuntimeError(f"stand-in failed to start (exit {proc.poll()}): {line!r}")
        yield line.removeprefix("standin listening on ").strip()
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _control_url(base_url: str) -> str:
    return base_url.rstrip("/").removesuffix("/v1") + "/_control"


def standin_control(base_url: str, **opts: Any) -> dict:
    """Set options (or `reset=True`) on a running stand-in; returns its state."""
    import httpx

    r = httpx.post(_control_url(base_url), json=opts, timeout=5)
    r.raise_for_status()
    return r.json()


def standin_stats(base_url: str) -> dict:
    """Counters, options and the last payload of a running stand-in."""
    import httpx

    r = httpx.get(_control_url(base_url), timeout=5)
    r.raise_for_status()
    return r.json()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gateway.testing.standin",
                                description="A fast stand-in OpenAI-compatible upstream (tests, benchmarks).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--engine-extension", action="store_true",
                   help='add the engine\'s "switchyard": {device_seconds, utilisation} object')
    p.add_argument("--chat-only", action="store_true",
                   help="serve chat completions only: 404 on /v1/completions and /v1/responses")
    p.add_argument("--token-delay-ms", type=float, default=0.0)
    p.add_argument("--first-byte-delay-ms", type=float, default=0.0)
    p.add_argument("--options", default=None, help="StandinOptions as JSON (overrides the flags)")
    args = p.parse_args(argv)
    options = StandinOptions(engine_extension=args.engine_extension, token_delay_ms=args.token_delay_ms,
                             first_byte_delay_ms=args.first_byte_delay_ms, chat_only=args.chat_only)
    if args.options:
        options = StandinOptions(**json.loads(args.options))

    async def run() -> None:
        server = await serve_standin(args.host, args.port, options)
        print(f"standin listening on {_base_url(server)}", flush=True)
        async with server:
            await server.serve_forever()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
