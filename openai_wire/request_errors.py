"""A pydantic ValidationError of a request body as the API's 400 (`invalid_request_error`, `param` the field's
path): the one converter both servers answer schema errors with, and the parse both run a body through."""
from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from openai_wire import APIError

M = TypeVar("M", bound=BaseModel)

_PLAIN = {
    "missing": "is required",
    "string_type": "must be a string",
    "int_type": "must be an integer",
    "bool_type": "must be a boolean",
    "float_type": "must be a number",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
    "list_type": "must be an array",
}


def field_path(loc: tuple[Any, ...]) -> str:
    """pydantic's loc as the client's field path: ('messages', 1, '~user', 'content') → messages[1].content
    (union-member tags start with "~": openai_wire.requests tags every union that way)."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif isinstance(part, str) and not part.startswith("~"):
            path += f".{part}" if path else part
    return path


def to_api_error(exc: ValidationError) -> APIError:
    """The first error, in our words: "Invalid request: 'top_p' must be less than or equal to 1." naming the field
    (a cross-field rule names its own field through the error's `field` context; a rule with an API error code
    of its own gives it through `code`)."""
    err = exc.errors(include_url=False)[0]
    path = field_path(tuple(err["loc"]))
    ctx = err.get("ctx") or {}
    if ctx.get("field"):
        path = f"{path}.{ctx['field']}" if path else ctx["field"]
    name = path or "body"
    return APIError(400, f"Invalid request: '{name}' {_detail(err, ctx)}.", param=path or None, code=ctx.get("code"))


def _detail(err: dict[str, Any], ctx: dict[str, Any]) -> str:
    kind = err["type"]
    if kind in _PLAIN:
        return _PLAIN[kind]
    if kind == "literal_error":
        return "must be " + str(ctx.get("expected", "one of the allowed values"))
    if kind == "too_short":
        return "must not be empty"
    if kind == "too_long":
        return f"must have at most {ctx.get('max_length')} items"
    return err["msg"].replace("Input should be", "must be")


def parse(model: type[M], payload: Any) -> M:
    """`payload` as a `model`, or the 400 naming the first field that breaks its schema."""
    if not isinstance(payload, dict):
        raise APIError(400, "The request body must be a JSON object.")
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise to_api_error(exc) from None
