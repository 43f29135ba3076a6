"""The JSON Schema of openai_wire/requests.py's models as both servers publish it (their OpenAPI documents).

Where a field is checked by a function (the AfterValidators: a `prompt` that is text or token ids, `stop`,
`metadata`, `logit_bias`, function names), pydantic knows only "any value"; `_DESCRIBED` gives the JSON Schema of
what that function accepts, keyed by the function itself, so removing or renaming a validator breaks this module
at import rather than leaving a document stale. A document may be stricter than the code in corners (a `metadata`
with the gateway's own `reference` key may hold 17 pairs), never looser.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue

from openai_wire import requests as rs

_TEXT = {"type": "string", "minLength": 1}
_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}


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


class RequestSchemas(GenerateJsonSchema):
    """pydantic's JSON Schema generator, with what each function-checked field accepts."""

    def function_after_schema(self, schema: Any) -> JsonSchemaValue:
        function = schema["function"]["function"]
        if function in _DESCRIBED:
            return dict(_DESCRIBED[function])
        inner = super().function_after_schema(schema)
        return _AMENDED[function](inner) if function in _AMENDED else inner

    def function_before_schema(self, schema: Any) -> JsonSchemaValue:
        if schema["function"]["function"].__name__ == "_refuse":  # requests._refuse: never accepted
            return {"not": {}, "description": "Not supported by this gateway."}
        return super().function_before_schema(schema)
