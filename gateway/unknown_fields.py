"""Unknown request fields: refused alike on every route kind, as OpenAI refuses them.

A top-level field is known when OpenAI's API has it for the endpoint (the installed openai SDK's own request
types say which: the one list that moves with the API), when the gateway's request schema names it, or when it
is one of the documented engine extensions (vLLM's spellings). Anything else is a 400 `unknown_parameter`
naming the field, before any backend is tried — where before an engine refused it and a hosted API received it
(or litellm dropped it silently), so the same request got a 400 or a 200 depending on the route. Fields OpenAI
knows but a backend cannot honour are the backend's to refuse (the engine's 400 `unsupported_parameter`).
"""
from __future__ import annotations

from gateway import errors
from openai_wire.engine_requests import EXTENSION_FIELDS
from openai_wire.requests import MODELS

# Engine extensions the in-house engine honours (openai_wire/engine_requests.py), as vLLM spells them.
EXTENSIONS = EXTENSION_FIELDS


def _sdk_fields() -> dict[str, frozenset[str]]:
    from openai.types import completion_create_params, embedding_create_params
    from openai.types.chat import completion_create_params as chat_params
    from openai.types.responses import response_create_params

    def keys(params: type) -> frozenset[str]:
        return frozenset(params.__required_keys__ | params.__optional_keys__)  # type: ignore[attr-defined]

    return {"chat": keys(chat_params.CompletionCreateParamsBase),
            "completions": keys(completion_create_params.CompletionCreateParamsBase),
            "embeddings": keys(embedding_create_params.EmbeddingCreateParams),
            "responses": keys(response_create_params.ResponseCreateParamsBase)}


def _known() -> dict[str, frozenset[str]]:
    sdk = _sdk_fields()
    return {endpoint: sdk[endpoint] | frozenset(model.model_fields) | {"model", "stream"} | EXTENSIONS
            for endpoint, model in MODELS.items()}


KNOWN = _known()  # decided once, at import


def check(body: dict, endpoint: str) -> None:
    """Raise the 400 for the first top-level field `endpoint` does not know."""
    known = KNOWN[endpoint]
    for name in body:
        if name not in known:
            shown = errors.clip(name, 64)
            raise errors.invalid_request(f"Unrecognized request argument supplied: '{shown}'.", param=shown,
                                         code="unknown_parameter")
