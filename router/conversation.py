"""Turn a request (OpenAI `messages` list or a plain prompt) into the text the router looks at.

Scoring must never fail on a request the gateway accepted, so this is lenient: unknown roles,
content-part lists (text parts are kept, images and audio are counted but have no text), None
content (tool calls) and stray non-dict items are all tolerated.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Conversation:
    query: str          # the last user message: what must be answered now
    context: str        # everything else (system prompt, earlier turns), joined by newlines
    n_messages: int
    n_user: int
    n_assistant: int
    system_chars: int
    n_non_text_parts: int  # images, audio, files


def _content_text(content: object) -> tuple[str, int]:
    if content is None:
        return "", 0
    if isinstance(content, str):
        return content, 0
    if isinstance(content, list):
        texts: list[str] = []
        other = 0
        for part in content:
            if isinstance(part, dict):
                if part.get("type") in (None, "text") and isinstance(part.get("text"), str):
                    texts.append(part["text"])
                else:
                    other += 1
            elif isinstance(part, str):
                texts.append(part)
        return "\n".join(texts), other
    return str(content), 0


def parse(request: list[dict] | str) -> Conversation:
    if isinstance(request, str):
        return Conversation(query=request, context="", n_messages=1, n_user=1, n_assistant=0,
                            system_chars=0, n_non_text_parts=0)
    texts: list[tuple[str, str]] = []
    n_user = n_assistant = system_chars = other = 0
    for m in request or []:
        if not isinstance(m, dict):
            continue
        role = str(m.get("role", "user"))
        text, n_other = _content_text(m.get("content"))
        other += n_other
        if role == "user":
            n_user += 1
        elif role == "assistant":
            n_assistant += 1
        elif role in ("system", "developer"):
            system_chars += len(text)
        texts.append((role, text))
    last_user = max((i for i, (role, _) in enumerate(texts) if role == "user"), default=None)
    if last_user is None:  # no user turn: treat the last message of any role as the query
        last_user = len(texts) - 1
    query = texts[last_user][1] if texts else ""
    context = "\n".join(t for i, (_, t) in enumerate(texts) if i != last_user and t)
    return Conversation(query=query, context=context, n_messages=len(texts), n_user=n_user,
                        n_assistant=n_assistant, system_chars=system_chars, n_non_text_parts=other)
