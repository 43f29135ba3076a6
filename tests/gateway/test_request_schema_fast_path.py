"""Issue 36 #2: the token fields' fast path (request_schema._plain_token_fields) skips the second pydantic pass
only for values _TokenFields itself accepts; everything else still gets _TokenFields' 400 naming the field."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from gateway import request_schema as rs
from openai_wire import APIError
from openai_wire.requests import MAX_TOKENS_LIMIT, TOKEN_FIELDS, _TokenFields

VALUES = st.one_of(st.none(), st.booleans(), st.integers(min_value=-5, max_value=MAX_TOKENS_LIMIT + 5),
                   st.integers(), st.floats(allow_nan=True), st.text(max_size=3),
                   st.lists(st.integers(), max_size=2))


def _accepted(body: dict) -> bool:
    try:
        _TokenFields.model_validate(body)
    except ValidationError:
        return False
    return True


@given(st.dictionaries(st.sampled_from(TOKEN_FIELDS), VALUES, max_size=5))
def test_the_fast_path_never_accepts_what_the_schema_refuses(fields):
    body = {"model": "m", **fields}
    if rs._plain_token_fields(body):
        assert _accepted(body)


@pytest.mark.parametrize("value", [True, 0, -1, 1.5, "8", MAX_TOKENS_LIMIT + 1])
def test_a_bad_token_field_is_still_the_400_naming_it(value):
    with pytest.raises(APIError) as caught:
        rs.check({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": value}, "chat")
    assert caught.value.status == 400 and caught.value.param == "max_tokens"
