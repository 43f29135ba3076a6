"""Tools on the engine: how tool definitions and tool history reach the prompt, the grammar that constrains the
model's tool calls, and the parser that turns its text back into OpenAI `tool_calls` (whole or streamed).

The call syntax is the Hermes / Qwen one, the same for every model::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The grammar (xgrammar structural tags, hosted/structured.py) fixes everything but the arguments, which follow the
function's `parameters` schema:

* `tool_choice: "required"`: only calls, one or more (exactly one with `parallel_tool_calls: false`), separated
  by newlines; no free text.
* a named function: exactly one call of that function.
* `"auto"`: free text, in which `<tool_call>` starts a call that then must be well formed (text may come before
  and between calls; with `response_format` the text part must be that JSON instead). So "auto" is honest: the
  model decides, and whatever call it starts is valid.
* `"none"`: the tools are left out of the prompt and nothing is constrained (as vLLM does by default).

Prompt: a chat template that mentions `tools` renders the definitions and the history itself (assistant
`tool_calls` with `arguments` parsed to objects, `tool` messages as they are). A template that does not (SmolLM2's)
gets the documented fallback: a system block listing the functions and the exact syntax above (merged into the
first system message, or added before the conversation); an assistant turn's `tool_calls` become that syntax in
its content, and `tool` messages become a user turn of `<tool_response>` blocks.
"""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

TRIGGER = "<tool_call>"
END_TAG = "</tool_call>"


def _begin(name: str) -> str:
    return f'{TRIGGER}\n{{"name": "{name}", "arguments": '


_END = "}\n" + END_TAG
_HEADER = re.compile(r'<tool_call>\n\{"name": "([A-Za-z0-9_.\-]{1,64})", "arguments": ')


def call_text(name: str, arguments: Any) -> str:
    """One call in the syntax the grammar enforces (also how history is rendered by the fallback)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f"{_begin(name)}{args}{_END}"


# ---------------------------------------------------------------------------------------------- grammar
def tool_format(tools: Sequence[Mapping[str, Any]], choice: str | None, parallel: bool,
                text_format: dict[str, Any] | None = None) -> dict[str, Any]:
    """The xgrammar structural-tag format for these tools and tool_choice ("auto", "required", or a function
    name). `text_format`: what the non-call answer must be under "auto" (a response_format), else free text."""
    def tag(fn: Mapping[str, Any]) -> dict[str, Any]:
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        # At most one blank in a row (as json_object mode's compact JSON): a small model cannot loop on blanks.
        return {"type": "tag", "begin": _begin(fn["name"]), "end": _END,
                "content": {"type": "json_schema", "json_schema": params, "max_whitespace_cnt": 1}}

    fns = [t["function"] for t in tools]
    if choice not in ("auto", "required"):
        fn = next(f for f in fns if f["name"] == choice)
        return tag(fn)
    calls = {"type": "tags_with_separator", "tags": [tag(f) for f in fns], "separator": "\n",
             "at_least_one": True, "stop_after_first": not parallel}
    if choice == "required":
        return calls
    if text_format is not None:
        return {"type": "or", "elements": [text_format, calls]}
    return {"type": "triggered_tags", "triggers": [TRIGGER], "tags": [tag(f) for f in fns],
            "at_least_one": False, "stop_after_first": not parallel}


# ---------------------------------------------------------------------------------------------- prompt
def template_supports_tools(source: str) -> bool:
    return re.search(r"\btools\b", source) is not None


def fallback_system_block(tools: Sequence[Mapping[str, Any]], choice: str | None) -> str:
    lines = ["# Tools", "", "You may call one or more functions to assist with the user query.", "",
             "You are provided with function signatures within <tools></tools> XML tags:", "<tools>"]
    lines += [json.dumps(t, ensure_ascii=False) for t in tools]
    lines += ["</tools>", "", ("For each function call, return a json object with function name and arguments "
              "within <tool_call></tool_call> XML tags:"), "<tool_call>",
              '{"name": <function-name>, "arguments": <args-json-object>}', "</tool_call>"]
    if choice == "required":
        lines += ["", "You must call at least one function."]
    elif choice not in (None, "auto"):
        lines += ["", f"You must call the function {choice!r}."]
    return "\n".join(lines)


def prepare_messages(messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                     choice: str | None, native: bool) -> list[dict[str, Any]]:
    """The conversation as the chat template should see it (see the module docstring)."""
    if native:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [_native_call(c) for c in m["tool_calls"]]
            out.append(m)
        return out
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        if role == "tool":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_tool_responses"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_responses": True})
            continue
        m = dict(m)
        if role == "assistant" and m.get("tool_calls"):
            calls = [call_text(c.get("function", {}).get("name", ""), c.get("function", {}).get("arguments", {}))
                     for c in m.pop("tool_calls")]
            m["content"] = "\n".join(([m["content"]] if m.get("content") else []) + calls)
        if m.get("content") is None:
            m["content"] = ""
        out.append(m)
    for m in out:
        m.pop("_tool_responses", None)
    if tools:
        block = fallback_system_block(tools, choice)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{block}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _native_call(call: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call as HF chat templates expect it: `arguments` an object, not a JSON string."""
    call = dict(call)
    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            pass
    call["function"] = fn
    return call


# ---------------------------------------------------------------------------------------------- output
def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str = ""
    complete: bool = False

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class Delta:
    """What one piece of model text adds: content text, and tool-call deltas in OpenAI's streaming shape."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class ToolCallParser:
    """Incremental: feed the model's text as it comes; get content and tool-call deltas. The grammar guarantees
    the syntax, so a call's header names the function, and its arguments are one JSON object (the function's
    parameters are an object), complete exactly when it parses."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self.content_parts: list[str] = []
        self._buf = ""
        self._state = "text"  # text | header | args | end
        self._blank = ""  # whitespace-only content held until something else follows

    def feed(self, text: str) -> Delta:
        delta = Delta()
        self._buf += text
        while True:
            if self._state == "text":
                at = self._buf.find(TRIGGER)
                if at < 0:
                    keep = _partial_suffix(self._buf, TRIGGER)
                    self._content(delta, self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return delta
                self._content(delta, self._buf[:at])
                self._buf = self._buf[at:]
                self._state = "header"
            elif self._state == "header":
                m = _HEADER.match(self._buf)
                if m is None:
                    return delta  # the header is still coming (the grammar fixes it)
                call = ToolCall(len(self.calls), new_call_id(), m.group(1))
                self.calls.append(call)
                delta.tool_calls.append({"index": call.index, "id": call.id, "type": "function",
                                         "function": {"name": call.name, "arguments": ""}})
                self._buf = self._buf[m.end():]
                self._state = "args"
            elif self._state == "args":
                call = self.calls[-1]
                done = _json_end(call.arguments + self._buf)
                if done is None:  # the arguments object is still open: all of it is arguments
                    piece, self._buf = self._buf, ""
                else:
                    cut = done - len(call.arguments)
                    piece, self._buf = self._buf[:cut], self._buf[cut:]
                if piece:
                    call.arguments += piece
                    delta.tool_calls.append({"index": call.index, "function": {"arguments": piece}})
                if done is None:
                    return delta
                call.complete = True
                self._state = "end"
            else:  # end: "}\n</tool_call>"
                at = self._buf.find(END_TAG)
                if at < 0:
                    return delta
                self._buf = self._buf[at + len(END_TAG):]
                self._state = "text"

    def finish(self) -> Delta:
        """The end of the output: text still held back is content (a call cut short keeps what it got)."""
        delta = Delta()
        if self._state in ("text", "header"):
            self._content(delta, self._buf)
        self._buf = ""
        return delta

    def _content(self, delta: Delta, text: str) -> None:
        if not text:
            return
        if not (self._blank + text).strip():
            self._blank += text
            return
        text, self._blank = self._blank + text, ""
        if not self.content_parts:
            text = text.lstrip()
        self.content_parts.append(text)
        delta.content += text

    @property
    def content(self) -> str | None:
        text = "".join(self.content_parts).rstrip()
        return text or None


_DECODER = json.JSONDecoder()


def _json_end(text: str) -> int | None:
    """Where the JSON object at the start of text ends, or None while it is incomplete."""
    try:
        _, end = _DECODER.raw_decode(text)
    except json.JSONDecodeError:
        return None
    return end


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
