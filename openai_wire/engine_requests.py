"""The engine's request bodies: OpenAI's schema (openai_wire.requests) plus the engine's extensions, as vLLM spells
them (`top_k`, `stop_token_ids`, `ignore_eos`; for chat `add_generation_prompt`, `chat_template_kwargs`).

Subclasses, so every OpenAI field is held to the very rules the gateway checks before routing: a request the
gateway admits never meets a stricter schema at the engine. The gateway checks the extension fields' types too
(`Extensions`), wherever a client sends them. Unknown fields are kept (`model_extra`): the engine refuses each
by name (hosted/request_plan.py), as it does the OpenAI fields it cannot honour.
"""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from openai_wire.requests import (
    ChatRequest,
    CompletionRequest,
    _NamedToolChoice,
    _Open,
    _RefusalPart,
    _TextPart,
)

TokenId = Annotated[StrictInt, Field(ge=0)]


class SamplingExtensions(_Open):
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None  # 0 or -1: off
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: StrictBool | None = None


class Extensions(SamplingExtensions):
    """Every extension field (what the gateway checks when a body carries any of them)."""

    add_generation_prompt: StrictBool | None = None  # None: true
    chat_template_kwargs: dict[str, Any] | None = None


EXTENSION_FIELDS = frozenset(Extensions.model_fields)


class _Sampling:
    """What the engine reads of either request, with OpenAI's defaults filled in."""

    @property
    def stop_list(self) -> list[str]:
        stop = self.stop  # type: ignore[attr-defined]
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        return [s for s in stops if s]  # an empty stop sequence cannot end anything

    @property
    def include_usage(self) -> bool:
        options = self.stream_options  # type: ignore[attr-defined]
        return bool(options and options.include_usage)


class EngineChatRequest(_Sampling, ChatRequest, Extensions):
    model_config = ConfigDict(extra="allow")  # unknown fields kept, for the engine to refuse by name

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def tool_choice_name(self) -> str | None:
        """"none" / "auto" / "required", or the forced function's name; None when tools are absent."""
        if not self.tools:
            return None
        choice = self.tool_choice
        if choice is None:
            return "auto"
        return choice.function.name if isinstance(choice, _NamedToolChoice) else choice

    def tool_dicts(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    def template_messages(self) -> list[dict[str, Any]]:
        return [template_dict(m) for m in self.messages]


class EngineCompletionRequest(_Sampling, CompletionRequest, SamplingExtensions):
    model_config = ConfigDict(extra="allow")  # unknown fields kept, for the engine to refuse by name

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts, each text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


def part_text(part: BaseModel) -> str | None:
    """A content part's text: a text part's text, an assistant's refusal; None for images, audio and files."""
    if isinstance(part, _TextPart):
        return part.text
    if isinstance(part, _RefusalPart):
        return part.refusal
    return None


def template_dict(message: BaseModel) -> dict[str, Any]:
    """The message as the chat template sees it: the fields the client sent (unknown ones included), text parts
    joined by newlines, `content` always present."""
    data = message.model_dump(exclude_unset=True, by_alias=True)
    content = getattr(message, "content", None)
    if isinstance(content, list):
        data["content"] = "\n".join(t for t in map(part_text, content) if t is not None)
    data.setdefault("content", None)
    return data
