"""The gateway's OpenAPI 3.1 document (`GET /openapi.json`, no key needed).

The request bodies are the JSON Schema of openai_wire/requests.py's models — the ones every request is
validated with (gateway/request_schema.py) — so the document and the 400s cannot disagree on a field's type or
range; fields checked by a function are described by openai_wire/request_json_schema.py. Built once, on the
first request for it.
"""
from __future__ import annotations

import functools

import orjson
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import Response

from openai_wire import requests as rs
from openai_wire.openapi import Operation, document, package_version
from openai_wire.request_json_schema import RequestSchemas

_DESCRIPTION = ("Switchyard: a cost-aware, OpenAI-compatible gateway. Send `Authorization: Bearer KEY`; "
                "`model` names a route of the gateway's policy (`GET /v1/models` lists the key's routes). Every "
                "response carries `x-request-id`; every error is OpenAI's error body.")

# (path, summary, request model, success body name, may stream)
_ENDPOINTS = (
    ("/v1/chat/completions", "Create a chat completion", rs.ChatRequest, "ChatCompletion", True),
    ("/v1/completions", "Create a text completion", rs.CompletionRequest, "TextCompletion", True),
    ("/v1/embeddings", "Create embeddings", rs.EmbeddingRequest, "Embeddings", False),
    ("/v1/responses", "Create a response (text in, text out)", rs.ResponsesRequest, "Response", True),
)


@functools.cache
def build() -> dict:
    refs, defs = models_json_schema([(model, "validation") for _, _, model, _, _ in _ENDPOINTS],
                                    ref_template="#/components/schemas/{model}", schema_generator=RequestSchemas)
    operations = [Operation(path, "post", summary, answer, request=refs[(model, "validation")], streams=streams)
                  for path, summary, model, answer, streams in _ENDPOINTS]
    operations += [
        Operation("/v1/models", "get", "List the models (routes) this key may use", "ModelList"),
        Operation("/v1/models/{model}", "get", "Retrieve one model (route)", "Model",
                  parameters=[{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]),
        Operation("/health", "get", "The gateway's health (200 while it serves)", "Health", public=True),
    ]
    return document(title="Switchyard gateway", version=package_version(), description=_DESCRIPTION,
                    operations=operations, request_schemas=defs.get("$defs", {}), keyed=True)


@functools.cache
def _body() -> bytes:
    return orjson.dumps(build())


async def serve_document(request: Request) -> Response:
    return Response(_body(), media_type="application/json")
