"""Turn a request (OpenAI `messages` list or a plain prompt) into the text the router looks at.

Scoring must never fail on a request the gateway accepted, so this is lenient: unknown roles,
content-part lists (text parts are kept, images and audio are counted but have no text), None
content (tool calls) and stray non-dict items are all tolerated. What counts as a message's text is
`openai_wire.content_text`, the rule the gateway uses too.
"""
from __future__ import annotations

from dataclasses import dataclass

from openai_wire import content_text, is_text_part


@dataclass(frozen=True, slots=True)
class Conversation:
    query: str          # the last user message: what must be answered now
    context: str        # everything else (system prompt, earlier turns), joined by newlines
    n_messages: int
    n_user: int
    n_assistant: int
    system_chars: int
    n_non_text_parts: int  # images, audio, files


def _non_text_parts(content: object) -> int:
    """Images, audio and files in a content-part list (the text rule itself is openai_wire's)."""
    if not isinstance(content, list):
        return 0
    return sum(1 for part in content if isinstance(part, dict) and not is_text_part(part))


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
        content = m.get("content")
        text = content_text(content)
        other += _non_text_parts(content)
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
