"""Request validation and the estimates admission control needs (before any backend is called)."""
from __future__ import annotations

from dataclasses import dataclass

from gateway import errors, request_schema, responses_api
from openai_wire import messages_text

DEFAULT_MAX_TOKENS_ESTIMATE = 4096  # a request without max_tokens may run this long; reserve for it


def validate(body: object, endpoint: str) -> dict:
    """Check the request against OpenAI's request schema (gateway/request_schema.py) before any routing: a
    400 naming the field, whichever backend the route would pick. The body itself is passed on unchanged."""
    if not isinstance(body, dict):
        raise errors.invalid_request("The request body must be a JSON object.")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise errors.invalid_request("'model' is required and must be a non-empty string.", param="model")
    if endpoint == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise errors.invalid_request("'messages' must be a non-empty array of messages.", param="messages")
    request_schema.check(body, endpoint)
    return body


def prompt_text(body: dict, endpoint: str) -> str:
    """The text the model will see, flattened (for token estimates, opt-in logging and shadow rows): each
    message's text by `openai_wire.content_text`, the completions prompt or the embeddings input ("" for token
    ids); a Responses request in its chat form."""
    if endpoint == "chat":
        return messages_text(body["messages"])
    if endpoint == "responses":
        return messages_text(responses_api.to_chat(body)["messages"])
    if endpoint == "embeddings":
        return completions_prompt_text(body["input"]) or ""
    return completions_prompt_text(body["prompt"]) or ""


@dataclass(frozen=True, slots=True)
class PromptView:
    """The request as routing and admission read it, worked out once per request: a Responses body in its chat
    form, the flattened prompt text, and the (deliberately high) prompt-token estimate."""

    body: dict
    endpoint: str
    text: str
    estimated_tokens: int

    @classmethod
    def of(cls, body: dict, endpoint: str) -> PromptView:
        if endpoint == "responses":
            body, endpoint = responses_api.to_chat(body), "chat"
        text = prompt_text(body, endpoint)
        return cls(body, endpoint, text, estimate_prompt_tokens(body, endpoint, text))


def completions_prompt_text(prompt: object) -> str | None:
    """A completions `prompt` as text: a string as is, a list of strings joined by newlines; None for token ids."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return "\n".join(prompt)
    return None


def estimate_prompt_tokens(body: dict, endpoint: str, text: str | None = None) -> int:
    """A deliberately high estimate (about 3 characters a token, plus per-message overhead); `text`: the
    body's prompt_text, when the caller has it already."""
    if endpoint in ("completions", "embeddings"):
        ids = body["prompt" if endpoint == "completions" else "input"]
        if isinstance(ids, list) and ids and isinstance(ids[0], int):
            return len(ids)
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            return sum(len(p) for p in ids)
    if endpoint == "responses":
        return estimate_prompt_tokens(responses_api.to_chat(body), "chat")
    overhead = 8 * len(body["messages"]) if endpoint == "chat" else 0
    return len(prompt_text(body, endpoint) if text is None else text) // 3 + 1 + overhead


def max_tokens(body: dict, endpoint: str = "chat") -> int:
    """The most output tokens the request may produce (what budgets reserve for); embeddings produce none."""
    if endpoint == "embeddings":
        return 0
    return (body.get("max_completion_tokens") or body.get("max_tokens") or body.get("max_output_tokens")
            or DEFAULT_MAX_TOKENS_ESTIMATE)


def wants_usage_chunk(body: dict) -> bool:
    options = body.get("stream_options") or {}
    return bool(options.get("include_usage"))
