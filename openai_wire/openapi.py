"""The OpenAPI 3.1 document both servers publish at `GET /openapi.json`, assembled from their own parts.

Each server hands in the request-body schemas of the models it validates with (gateway/openapi.py,
hosted/openapi.py: pydantic's JSON Schema of those very models, so the document cannot drift from the checks);
this module adds what both answer alike: OpenAI's error body on every 4xx and 5xx, the `x-request-id` header on
every response, and the success bodies (OpenAI's objects, loosely: providers add fields, so extra fields pass).
Standard library only, like the rest of openai_wire.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

OPENAPI_VERSION = "3.1.0"
REQUEST_ID_HEADER = "x-request-id"

_NULLABLE_STRING = {"type": ["string", "null"]}
_INT = {"type": "integer"}
_STR = {"type": "string"}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _object(required: dict[str, Any], optional: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"type": "object", "required": list(required), "properties": {**required, **(optional or {})}}


_USAGE = {"anyOf": [{"type": "null"}, _object({}, {"prompt_tokens": _INT, "completion_tokens": _INT,
                                                   "total_tokens": _INT})]}

# Success bodies (what the OpenAI SDKs read); `additionalProperties` stays open: upstreams add fields.
RESPONSE_SCHEMAS: dict[str, dict[str, Any]] = {
    "ErrorBody": _object({"error": _object({"message": _STR, "type": _STR, "param": _NULLABLE_STRING,
                                            "code": _NULLABLE_STRING})}),
    "ChatCompletion": _object(
        {"id": _STR, "object": {"const": "chat.completion"}, "created": _INT, "model": _STR,
         "choices": {"type": "array", "items": _object(
             {"index": _INT, "message": _object({"role": _STR}, {"content": _NULLABLE_STRING}),
              "finish_reason": _NULLABLE_STRING})}},
        {"usage": _USAGE}),
    "TextCompletion": _object(
        {"id": _STR, "object": {"const": "text_completion"}, "created": _INT, "model": _STR,
         "choices": {"type": "array", "items": _object({"index": _INT, "text": _STR,
                                                        "finish_reason": _NULLABLE_STRING})}},
        {"usage": _USAGE}),
    "Embeddings": _object(
        {"object": {"const": "list"}, "model": _STR,
         "data": {"type": "array", "items": _object(
             {"object": {"const": "embedding"}, "index": _INT,
              "embedding": {"anyOf": [{"type": "array", "items": {"type": "number"}}, _STR]}})}},
        {"usage": _USAGE}),
    "Response": _object({"id": _STR, "object": {"const": "response"}, "status": _STR, "model": _STR,
                         "output": {"type": "array", "items": {"type": "object"}}}),
    "Model": _object({"id": _STR, "object": {"const": "model"}, "created": _INT, "owned_by": _STR}),
    "ModelList": _object({"object": {"const": "list"}, "data": {"type": "array", "items": _ref("Model")}}),
    "Health": _object({"status": _STR}),
}

_ID_HEADER = {"description": "This request's id (also in the server's log and, on the gateway, its ledger row).",
              "required": True, "schema": _STR}
# One server-sent event (what `schema` of an event stream describes before OpenAPI 3.2's `itemSchema`): `data` is
# a JSON chunk (OpenAI's `*.chunk` objects; typed `response.*` events on /v1/responses), or `[DONE]` at the end.
_SSE = {"schema": _object({"data": {**_STR, "contentMediaType": "application/json"}},
                          {"event": _STR, "id": _STR, "retry": _INT})}
_SSE_NOTE = (" With `stream: true`, server-sent events (`text/event-stream`): each `data` a JSON chunk, and "
             "`data: [DONE]` last (the Responses API ends with its `response.completed` event instead).")


@dataclass(frozen=True, slots=True)
class Operation:
    """One path and method: `request` is the body's schema (a `$ref` into the given schemas), `answer` the
    name of the success body in RESPONSE_SCHEMAS; `streams`: a 200 may be server-sent events instead."""

    path: str
    method: str
    summary: str
    answer: str
    request: dict[str, Any] | None = None
    streams: bool = False
    public: bool = False  # no API key needed (documents security: [] on a server that has keys)
    parameters: list[dict[str, Any]] = field(default_factory=list)
    other_statuses: dict[str, str] = field(default_factory=dict)  # status -> success body name (e.g. a 503)


def _answer(name: str, description: str, streams: bool = False) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": _ref(name)}}
    if streams:
        content["text/event-stream"] = _SSE
        description += _SSE_NOTE
    return {"description": description, "headers": {REQUEST_ID_HEADER: {"$ref": "#/components/headers/RequestId"}},
            "content": content}


def _operation(op: Operation, keyed: bool) -> dict[str, Any]:
    responses: dict[str, Any] = {"200": _answer(op.answer, "Success.", op.streams)}
    for status, name in op.other_statuses.items():
        responses[status] = _answer(name, f"A `{name}` body.")
    responses.setdefault("4XX", {"$ref": "#/components/responses/Error"})
    responses.setdefault("5XX", {"$ref": "#/components/responses/Error"})
    out: dict[str, Any] = {"summary": op.summary, "operationId": op.method + op.path.replace("/", "_"),
                           "responses": responses}
    if op.parameters:
        out["parameters"] = op.parameters
    if op.request is not None:
        out["requestBody"] = {"required": True, "content": {"application/json": {"schema": op.request}}}
    if keyed and op.public:
        out["security"] = []
    return out


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("switchyard")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "0"


def document(*, title: str, version: str, description: str, operations: list[Operation],
             request_schemas: dict[str, Any], keyed: bool) -> dict[str, Any]:
    """The whole document. `request_schemas`: the components the operations' `request` refer to; `keyed`: the
    server wants `Authorization: Bearer KEY` (every operation but the public ones)."""
    clash = set(request_schemas) & set(RESPONSE_SCHEMAS)
    if clash:
        raise ValueError(f"request schema names clash with response schema names: {sorted(clash)}")
    paths: dict[str, dict[str, Any]] = {}
    for op in operations:
        paths.setdefault(op.path, {})[op.method] = _operation(op, keyed)
    components: dict[str, Any] = {
        "schemas": {**request_schemas, **RESPONSE_SCHEMAS},
        "headers": {"RequestId": _ID_HEADER},
        "responses": {"Error": {
            "description": "OpenAI's error body: `error.message` says what went wrong, `error.param` names the "
                           "field at fault, `error.code` is stable for programs.",
            "headers": {REQUEST_ID_HEADER: {"$ref": "#/components/headers/RequestId"}},
            "content": {"application/json": {"schema": _ref("ErrorBody")}}}},
    }
    doc: dict[str, Any] = {"openapi": OPENAPI_VERSION,
                           "info": {"title": title, "version": version, "description": description},
                           "paths": paths, "components": components}
    if keyed:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc
