"""OpenAI response bodies for a generation: the whole body of a plain response, the SSE chunks of a streamed
one, and logprobs in the chat and completions shapes (clamped: JSON has no -inf).

Every response carries OpenAI `usage` (with `prompt_tokens_details.cached_tokens` from the prefix cache) and
the extension `"switchyard": {"device_seconds", "utilisation", "device_kind"}`; when streaming, both ride on the final chunk
(the usage chunk if `stream_options.include_usage`, else the last choice's finish chunk).
"""
from __future__ import annotations

import json
import math
import time
from json.encoder import encode_basestring
from typing import Any

from hosted.generation import Event, Generation
from hosted.server_state import ServerState
from hosted.tool_calls import ToolCallParser
from openai_wire import SSE_DONE, sse_event

_MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI clamps the same way
_TEXT_SLOT = "\x00"  # where a text delta's template takes the text (ChunkWriter.text_chunk)


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def _clamp(lp: float) -> float:
    return lp if math.isfinite(lp) and lp > _MIN_LOGPROB else _MIN_LOGPROB


def chat_logprobs(state: ServerState, entries) -> dict[str, Any]:
    content = []
    for token_id, lp, top in entries:
        text, raw = state.token_text(token_id)
        tops = []
        for tid, tlp in top:
            ttext, traw = state.token_text(tid)
            tops.append({"token": ttext, "logprob": _clamp(tlp), "bytes": traw})
        content.append({"token": text, "logprob": _clamp(lp), "bytes": raw, "top_logprobs": tops})
    return {"content": content}


def completion_logprobs(state: ServerState, entries, offset: int) -> tuple[dict[str, Any], int]:
    tokens, token_lps, tops, offsets = [], [], [], []
    for token_id, lp, top in entries:
        text, _ = state.token_text(token_id)
        tokens.append(text)
        token_lps.append(_clamp(lp))
        tops.append({state.token_text(tid)[0]: _clamp(tlp) for tid, tlp in top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset


def final_body(state: ServerState, gen: Generation) -> dict[str, Any]:
    plan = gen.plan
    choices = []
    for c in gen.choices:
        text = "".join(c.text_parts)
        lp = None
        if plan.kind == "chat":
            if plan.logprobs:
                lp = chat_logprobs(state, c.logprobs)
            message: dict[str, Any] = {"role": "assistant", "content": text}
            finish = c.finish_reason
            if plan.tools:
                parser = ToolCallParser()
                parser.feed(text)
                parser.finish()
                if parser.calls:
                    message = {"role": "assistant", "content": parser.content,
                               "tool_calls": [call.openai() for call in parser.calls]}
                    finish = _tool_finish(finish)
            choices.append({"index": c.index, "message": message, "logprobs": lp, "finish_reason": finish})
        else:
            if plan.logprobs:
                lp, _ = completion_logprobs(state, c.logprobs, len(c.job.echo_text))
            choices.append({"index": c.index, "text": c.job.echo_text + text, "logprobs": lp,
                            "finish_reason": c.finish_reason})
    return {
        "id": plan.request_id,
        "object": "chat.completion" if plan.kind == "chat" else "text_completion",
        "created": int(time.time()),
        "model": state.model_name,
        "choices": choices,
        "usage": gen.usage(),
        "switchyard": gen.extension(),
    }


class ChunkWriter:
    """Formats SSE chunks for one streamed request."""

    def __init__(self, state: ServerState, gen: Generation) -> None:
        self.state = state
        self.gen = gen
        self.plan = gen.plan
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if self.plan.kind == "chat" else "text_completion"
        self.offsets = {c.index: len(c.job.echo_text) for c in gen.choices}
        self.parsers = {c.index: ToolCallParser() for c in gen.choices} if self.plan.tools else {}
        self._text_templates: dict[int, tuple[bytes, bytes]] = {}

    def text_chunk(self, index: int, text: str) -> bytes:
        """The chunk of a text delta without logprobs -- most of a stream: the bytes around the text are rendered
        once per choice (by chunk() itself, around a placeholder) and the text alone is encoded per token."""
        around = self._text_templates.get(index)
        if around is None:
            # NUL stands for the text: JSON escapes it, and the last occurrence is the choice's (the id and model
            # name before it could hold one too)
            slot = encode_basestring(_TEXT_SLOT).encode()
            before, _, after = self.chunk([self._text_choice(index, _TEXT_SLOT, None)]).rpartition(slot)
            around = self._text_templates[index] = (before, after)
        return around[0] + encode_basestring(text).encode() + around[1]

    def _text_choice(self, index: int, text: str, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        if self.plan.kind == "chat":
            return {"index": index, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": None}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        body: dict[str, Any] = {"id": self.plan.request_id, "object": self.object, "created": self.created,
                                "model": self.state.model_name, "choices": choices}
        if self.plan.include_usage:
            body["usage"] = None
        body.update(extra)
        return sse_event(dumps(body))

    def opening(self) -> list[bytes]:
        if self.plan.kind == "chat":
            return [self.chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}]) for c in self.gen.choices]
        return [self.chunk([{"index": c.index, "text": c.job.echo_text, "logprobs": None, "finish_reason": None}])
                for c in self.gen.choices if c.job.echo_text]

    def _tool_event(self, ev: Event, last: bool) -> list[bytes]:
        """A chat event with tools: content and `delta.tool_calls` chunks, as OpenAI streams them."""
        c = ev.choice
        parser = self.parsers[c.index]
        deltas = [parser.feed(ev.text)] if ev.text else []
        if ev.finish_reason is not None:
            deltas.append(parser.finish())
        lp = chat_logprobs(self.state, ev.logprobs) if self.plan.logprobs and ev.logprobs else None
        pieces: list[dict[str, Any]] = []
        for d in deltas:
            if d.content:
                pieces.append({"content": d.content})
            pieces.extend({"tool_calls": [tc]} for tc in d.tool_calls)
        if lp is not None and not pieces:
            pieces.append({})
        out = []
        for i, delta in enumerate(pieces):
            out.append(self.chunk([{"index": c.index, "delta": delta, "logprobs": lp if i == 0 else None,
                                    "finish_reason": None}]))
        if ev.finish_reason is not None:
            extra = {"switchyard": self.gen.extension()} if last and not self.plan.include_usage else {}
            finish = _tool_finish(ev.finish_reason) if parser.calls else ev.finish_reason
            out.append(self.chunk([{"index": c.index, "delta": {}, "logprobs": None, "finish_reason": finish}],
                                  **extra))
        return out

    def event(self, ev: Event, last: bool) -> list[bytes]:
        if self.parsers:
            return self._tool_event(ev, last)
        out = []
        c = ev.choice
        if ev.text and not self.plan.logprobs:
            out.append(self.text_chunk(c.index, ev.text))
        elif ev.text or ev.logprobs:  # (logprobs are only there when the request asked for them)
            if self.plan.kind == "chat":
                lp = chat_logprobs(self.state, ev.logprobs)
            else:
                lp, self.offsets[c.index] = completion_logprobs(self.state, ev.logprobs, self.offsets[c.index])
            out.append(self.chunk([self._text_choice(c.index, ev.text, lp)]))
        if ev.finish_reason is not None:
            extra = {"switchyard": self.gen.extension()} if last and not self.plan.include_usage else {}
            if self.plan.kind == "chat":
                choice = {"index": c.index, "delta": {}, "logprobs": None, "finish_reason": ev.finish_reason}
            else:
                choice = {"index": c.index, "text": "", "logprobs": None, "finish_reason": ev.finish_reason}
            out.append(self.chunk([choice], **extra))
        return out

    def closing(self) -> list[bytes]:
        out = []
        if self.plan.include_usage:
            body = {"id": self.plan.request_id, "object": self.object, "created": self.created,
                    "model": self.state.model_name, "choices": [], "usage": self.gen.usage(),
                    "switchyard": self.gen.extension()}
            out.append(sse_event(dumps(body)))
        out.append(SSE_DONE)
        return out


def _tool_finish(reason: str | None) -> str | None:
    """A choice that made tool calls and ended on its own ends with "tool_calls"; one cut short keeps "length"."""
    return "tool_calls" if reason == "stop" else reason
