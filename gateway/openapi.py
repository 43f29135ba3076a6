"""The gateway's OpenAPI 3.1 document (`GET /openapi.json`, no key needed).

The request bodies are the JSON Schema of gateway/request_schema.py's models — the ones every request is
validated with — so the document and the 400s cannot disagree on a field's type or range. Checks that run as
code (a `prompt` that is a string or token ids, `metadata` limits, cross-field rules such as `top_logprobs`
needing `logprobs`) are described by the models' own schema as far as pydantic can say, and enforced as
before. Built once, on the first request for it.

Where a field is checked by a function (gateway/request_schema.py's AfterValidators: a `prompt` that is text or
token ids, `stop`, `metadata`, `logit_bias`, function names), pydantic knows only "any value"; `_DESCRIBED`
gives the JSON Schema of what that function accepts, keyed by the function itself, so removing or renaming a
validator breaks this module at import rather than leaving the document stale. The document may be stricter than
the code in corners (a `metadata` with the gateway's own `reference` key may hold 17 pairs), never looser.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import orjson
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue, models_json_schema
from starlette.requests import Request
from starlette.responses import Response

from gateway import request_schema as rs
from openai_wire.openapi import Operation, document, package_version

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


_TEXT = {"type": "string", "minLength": 1}
_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer"}}


def _texts_or_ids(*, empty_strings: bool, max_items: int | None = None) -> dict[str, Any]:
    arrays: list[dict[str, Any]] = [
        {"type": "array", "minItems": 1, "items": {"type": "string"} if empty_strings else _TEXT}, _IDS,
        {"type": "array", "minItems": 1, "items": _IDS}]
    if max_items is not None:
        arrays = [{**a, "maxItems": max_items} for a in arrays]
    return {"anyOf": [_TEXT, *arrays]}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


_STRINGS_TO = {"type": "object", "propertyNames": {"maxLength": rs.METADATA_MAX_KEY},
               "properties": {rs.REFERENCE_KEY: {"type": "string"}},
               "additionalProperties": {"type": "string", "maxLength": rs.METADATA_MAX_VALUE}}

# A function-checked field: the JSON Schema of what the function accepts.
_DESCRIBED: dict[Callable, dict[str, Any]] = {
    rs._prompt: _texts_or_ids(empty_strings=True),
    rs._embedding_input: _texts_or_ids(empty_strings=False, max_items=rs.EMBEDDING_MAX_INPUTS),
    rs._stop: _nullable({"anyOf": [{"type": "string"},
                                   {"type": "array", "maxItems": 4, "items": {"type": "string"}}]}),
    rs._metadata: _nullable({**_STRINGS_TO, "maxProperties": rs.METADATA_MAX_PAIRS}),
    rs._logit_bias: _nullable({"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
                               "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}),
    rs._function_name: {"type": "string", "pattern": rs._NAME.pattern},
    rs._not_streamed: {"enum": [None, False], "description": "Embeddings are not streamed."},
}


def _refused_fields(schema: dict[str, Any]) -> dict[str, Any]:
    """ResponsesRequest's fields that need what the gateway lacks: absent, or empty."""
    properties = schema.setdefault("properties", {})
    for name, why in rs._REFUSED_RESPONSE_FIELDS.items():
        properties[name] = {"enum": [None, False, [], ""], "description": "Not supported: " + why.split(": ", 1)[-1]}
    return schema


# A model checked by a function after its fields: the model's schema, amended.
_AMENDED: dict[Callable, Callable[[dict[str, Any]], dict[str, Any]]] = {
    rs.ResponsesRequest._refused: _refused_fields,
}


class _ValidatorSchemas(GenerateJsonSchema):
    def function_after_schema(self, schema: Any) -> JsonSchemaValue:
        function = schema["function"]["function"]
        if function in _DESCRIBED:
            return dict(_DESCRIBED[function])
        inner = super().function_after_schema(schema)
        return _AMENDED[function](inner) if function in _AMENDED else inner

    def function_before_schema(self, schema: Any) -> JsonSchemaValue:
        if schema["function"]["function"].__name__ == "_refuse":  # request_schema._refuse: never accepted
            return {"not": {}, "description": "Not supported by this gateway."}
        return super().function_before_schema(schema)


@functools.cache
def build() -> dict:
    refs, defs = models_json_schema([(model, "validation") for _, _, model, _, _ in _ENDPOINTS],
                                    ref_template="#/components/schemas/{model}", schema_generator=_ValidatorSchemas)
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
