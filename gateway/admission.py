"""Request validation and the estimates admission control needs (before any backend is called)."""
from __future__ import annotations

from dataclasses import dataclass

from gateway import errors, request_schema, responses_api
from gateway.pricing import TokenDemand
from openai_wire import messages_text


def validate(body: object, endpoint: str) -> dict:
    """Check the request against OpenAI's request schema (openai_wire/requests.py) before any routing: a
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
    """A deliberately high estimate (about 3 characters a token, plus per-message overhead); every prompt of a
    completions request and every embeddings input counted on its own; `text`: the body's prompt_text, when the
    caller has it already."""
    if endpoint in ("completions", "embeddings"):
        ids = body["prompt" if endpoint == "completions" else "input"]
        if isinstance(ids, list) and ids and isinstance(ids[0], int):
            return len(ids)
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            return sum(len(p) for p in ids)
        if isinstance(ids, list):
            return sum(len(p) // 3 + 1 for p in ids)
    if endpoint == "responses":
        return estimate_prompt_tokens(responses_api.to_chat(body), "chat")
    overhead = 8 * len(body["messages"]) if endpoint == "chat" else 0
    return len(prompt_text(body, endpoint) if text is None else text) // 3 + 1 + overhead


# The field(s) that bound one output on each endpoint; an upstream may ignore a field its endpoint does not define.
_OWN_CAPS = {"chat": ("max_completion_tokens", "max_tokens"), "completions": ("max_tokens",),
             "responses": ("max_output_tokens",), "embeddings": ()}
_CAPS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def output_cap(body: dict, endpoint: str) -> int | None:
    """The most tokens one output may run to, as the request bounds it: None when it sets none of its endpoint's
    own fields; else the largest of every max-tokens field it sets (an upstream may honour any of them)."""
    if not any(body.get(name) is not None for name in _OWN_CAPS[endpoint]):
        return None
    return max(body[name] for name in _CAPS if body.get(name) is not None)


def cap_param(endpoint: str) -> str:
    """The field a client sets to bound one output on `endpoint` (named in errors asking for it)."""
    return (_OWN_CAPS[endpoint] or ("max_tokens",))[0]


def prompt_count(body: dict, endpoint: str) -> int:
    """How many prompts a request carries: a completions list of strings or of token-id lists holds several
    (each generates its own choices); everything else is one."""
    prompt = body.get("prompt") if endpoint == "completions" else None
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        return len(prompt)
    return 1


def token_demand(body: dict, endpoint: str, prompt_tokens: int) -> TokenDemand:
    """The most the request may make a backend process (what budgets reserve for): every prompt's tokens, and
    prompts × choices outputs, each up to the request's cap. Choices: the larger of `n` and `best_of` on any
    endpoint (completions' best_of generates best_of per prompt; elsewhere an upstream may honour either).
    The token fields are integers here: request_schema checked them before anything else."""
    choices = max(body.get("n") or 1, body.get("best_of") or 1)
    return TokenDemand(prompt_tokens, choices, prompt_count(body, endpoint), output_cap(body, endpoint),
                       outputs=endpoint != "embeddings")


def wants_usage_chunk(body: dict) -> bool:
    options = body.get("stream_options") or {}
    return bool(options.get("include_usage"))
