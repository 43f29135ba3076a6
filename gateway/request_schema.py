"""The gateway's check of a request body against OpenAI's request schema (openai_wire/requests.py, the rules the
engine holds a body to as well), before any routing.

Every request is checked here, whichever backend kind the route picks, so a bad request gets the same 400
everywhere and nothing reaches a backend; the body is then passed on exactly as the client sent it. The engine
extensions the gateway lets through (gateway/unknown_fields.py) are checked for their types when present, so
the engine never refuses for a schema reason a request the gateway admitted.
"""
from __future__ import annotations

from pydantic import ValidationError

from openai_wire.engine_requests import EXTENSION_FIELDS, Extensions
from openai_wire.request_errors import to_api_error
from openai_wire.requests import _TOKEN_LIMITS, MODELS, _TokenFields


def _plain_token_fields(body: dict) -> bool:
    """True when every token field present is what _TokenFields accepts without a doubt (an int, not a bool, in
    range): the common request skips a second pydantic pass; anything else goes to _TokenFields for its 400."""
    for name, limit in _TOKEN_LIMITS.items():
        value = body.get(name)
        if value is not None and not (type(value) is int and 1 <= value <= limit):
            return False
    return True


def check(body: dict, endpoint: str) -> None:
    """Raise the 400 (APIError) for the first field that breaks OpenAI's request schema. The token fields come
    first and on every endpoint, whether or not its schema names them: budgets do arithmetic with them."""
    try:
        if not _plain_token_fields(body):
            _TokenFields.model_validate(body)  # the 400 naming the field
        MODELS[endpoint].model_validate(body)
        if not EXTENSION_FIELDS.isdisjoint(body):  # rare: a second pass only when a body carries one
            Extensions.model_validate(body)
    except ValidationError as exc:
        raise to_api_error(exc) from None
