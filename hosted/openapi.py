"""The engine server's OpenAPI 3.1 document (`GET /openapi.json`).

The request bodies are the JSON Schema of openai_wire/engine_requests.py's pydantic models — the ones the server
parses every request with (OpenAI's rules, the gateway's too, and the engine's extensions) — so the document and
the 400s cannot disagree. The models let unknown fields through
so that request_plan.reject_unsupported can refuse each by name; the document says what that function accepts:
no field beyond the models' own but those it takes as they are. Built once, on first request.
"""
from __future__ import annotations

import functools
import json

from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import Response

from hosted.request_plan import _ACCEPTED_AS_IS
from openai_wire.engine_requests import EngineChatRequest, EngineCompletionRequest
from openai_wire.openapi import Operation, document, package_version
from openai_wire.request_json_schema import RequestSchemas

_DESCRIPTION = ("Switchyard's inference engine: OpenAI's chat and text completions for the one model it serves "
                "(`GET /v1/models`). Extensions as vLLM spells them: `top_k`, `stop_token_ids`, `ignore_eos`. "
                "Every response carries `x-request-id`; every error is OpenAI's error body.")

_ENDPOINTS = (
    ("/v1/chat/completions", "Create a chat completion", EngineChatRequest, "ChatCompletion"),
    ("/v1/completions", "Create a text completion", EngineCompletionRequest, "TextCompletion"),
)


def _closed(schema: dict) -> None:
    """A request model's schema as request_plan enforces it: OpenAI fields it takes without acting on them (any
    value, or only the values listed), and no other field."""
    properties = schema.setdefault("properties", {})
    for name, accepted in _ACCEPTED_AS_IS.items():
        note = {"description": "Accepted; the engine does not act on it."}
        properties.setdefault(name, note if accepted is None else {**note, "enum": list(accepted)})
    schema["additionalProperties"] = False


@functools.cache
def build() -> dict:
    refs, defs = models_json_schema([(model, "validation") for _, _, model, _ in _ENDPOINTS],
                                    ref_template="#/components/schemas/{model}", schema_generator=RequestSchemas)
    schemas = defs.get("$defs", {})
    for _, _, model, _ in _ENDPOINTS:
        _closed(schemas[model.__name__])
    operations = [Operation(path, "post", summary, answer, request=refs[(model, "validation")], streams=True)
                  for path, summary, model, answer in _ENDPOINTS]
    operations += [
        Operation("/v1/models", "get", "The model this engine serves", "ModelList"),
        Operation("/health", "get", "200 once the model is loaded and the engine runs", "Health",
                  other_statuses={"503": "Health"}),
    ]
    return document(title="Switchyard engine", version=package_version(), description=_DESCRIPTION, operations=operations,
                    request_schemas=schemas, keyed=False)


@functools.cache
def _body() -> bytes:
    return json.dumps(build()).encode()


async def serve_document(request: Request) -> Response:
    return Response(_body(), media_type="application/json")
