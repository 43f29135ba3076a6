"""OpenAI's request schema for `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings` and `/v1/responses`:
the one set of rules both servers hold a request body to (the gateway before routing, the engine before planning).

The rules are OpenAI's API reference (its published OpenAPI document) wherever the two servers once disagreed:
`top_p` from 0 to 1, `n` from 1 to 128, `seed` a signed 64-bit integer, `stop` at most 4 strings, `logprobs` of
a completion at most 5. The engine's own extensions (vLLM's spellings) are subclasses in
`openai_wire.engine_requests`; the converter from a validation error to the API's 400 is
`openai_wire.request_errors`. pydantic and the standard library only: both servers import this.

Only the shape is checked: the gateway passes the request on exactly as the client sent it (the models below are
thrown away there). Unknown top-level fields pass this schema (each server decides about them); every known
field is checked for its type and range. The 400's `param` is the field's path, e.g. `messages[1].content` or
`tools[0].function.name`.

Pydantic runs in strict mode (no "1" → 1 coercion; a bool is not a number). Unions are tagged by callable
discriminators whose tags start with "~", so one bad value gives one error, not one per union member,
and the tags are dropped from the path.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    Tag,
    model_validator,
)
from pydantic_core import PydanticCustomError

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
METADATA_MAX_PAIRS, METADATA_MAX_KEY, METADATA_MAX_VALUE = 16, 64, 512
REFERENCE_KEY = "reference"  # the gateway's own metadata key (gateway/shadow/reference.py): not capped, never sent on
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")

Number = StrictFloat  # strict: an int is a number too, a bool or a string is not


class _Open(BaseModel):
    """Unknown fields are allowed (and ignored: the client's body is forwarded as sent)."""

    model_config = ConfigDict(strict=True, extra="ignore")


def _fail(kind: str, message: str, **ctx: Any) -> PydanticCustomError:
    return PydanticCustomError(kind, message, ctx or None)


# ---------------------------------------------------------------- content parts


class _ImageURL(_Open):
    url: StrictStr
    detail: Literal["auto", "low", "high"] | None = None


class _InputAudio(_Open):
    data: StrictStr
    format: StrictStr


class _File(_Open):
    file_id: StrictStr | None = None
    file_data: StrictStr | None = None
    filename: StrictStr | None = None


class _TextPart(_Open):
    type: Literal["text"]
    text: StrictStr


class _ImagePart(_Open):
    type: Literal["image_url"]
    image_url: _ImageURL


class _AudioPart(_Open):
    type: Literal["input_audio"]
    input_audio: _InputAudio


class _FilePart(_Open):
    type: Literal["file"]
    file: _File


class _RefusalPart(_Open):
    type: Literal["refusal"]
    refusal: StrictStr


def _part_tag(allowed: tuple[str, ...]):
    def tag(value: Any) -> str | None:
        kind = value.get("type") if isinstance(value, dict) else None
        return "~" + kind if kind in allowed else None
    return tag


def _parts(*parts: tuple[str, type]) -> Any:
    names = tuple(name for name, _ in parts)
    listed = ", ".join(names[:-1]) + (" or " if len(names) > 1 else "") + names[-1]
    return Annotated[
        _union(*(Annotated[model, Tag("~" + name)] for name, model in parts)),
        Discriminator(_part_tag(names), custom_error_type="invalid_content_part",
                      custom_error_message=f"must be a content part object with a 'type' of {listed}"),
    ]


def _union(*members: Any) -> Any:
    from typing import Union

    return Union[tuple(members)]  # noqa: UP007 — built at run time


def _content_tag(value: Any) -> str | None:
    if isinstance(value, str):
        return "~text"
    if isinstance(value, list):
        return "~parts"
    return None


def _content(part: Any) -> Any:
    return Annotated[
        _union(Annotated[StrictStr, Tag("~text")], Annotated[list[part], Tag("~parts")]),
        Discriminator(_content_tag, custom_error_type="invalid_content",
                      custom_error_message="must be a string or an array of content parts"),
    ]


_TEXT = ("text", _TextPart)
TextContent = _content(_parts(_TEXT))
UserContent = _content(_parts(_TEXT, ("image_url", _ImagePart), ("input_audio", _AudioPart), ("file", _FilePart)))
AssistantContent = _content(_parts(_TEXT, ("refusal", _RefusalPart)))


# ---------------------------------------------------------------- messages


class _FunctionCall(_Open):
    name: StrictStr
    arguments: StrictStr


class _ToolCall(_Open):
    id: StrictStr
    type: Literal["function"]
    function: _FunctionCall


class _Message(_Open):
    """A message keeps fields the schema does not name: the engine's chat template may read them (e.g. a
    `reasoning_content` or a template-specific key); the gateway passes the body on as sent either way."""

    model_config = ConfigDict(extra="allow")


class _SystemMessage(_Message):
    role: Literal["system", "developer"]
    content: TextContent
    name: StrictStr | None = None


class _UserMessage(_Message):
    role: Literal["user"]
    content: UserContent
    name: StrictStr | None = None


class _AssistantMessage(_Message):
    role: Literal["assistant"]
    content: AssistantContent | None = None
    refusal: StrictStr | None = None
    name: StrictStr | None = None
    tool_calls: list[_ToolCall] | None = None
    function_call: _FunctionCall | None = None
    audio: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _needs_content_or_calls(self) -> _AssistantMessage:
        if self.content is None and not self.tool_calls and self.function_call is None and self.audio is None:
            raise _fail("missing_content", "is required in an assistant message without 'tool_calls'",
                        field="content")
        return self


class _ToolMessage(_Message):
    role: Literal["tool"]
    content: TextContent
    tool_call_id: StrictStr


class _FunctionMessage(_Message):
    role: Literal["function"]
    content: StrictStr | None
    name: StrictStr


def _role_tag(value: Any) -> str | None:
    role = value.get("role") if isinstance(value, dict) else None
    if role in ("system", "developer"):
        return "~system"
    return "~" + role if role in ROLES else None


Message = Annotated[
    _union(Annotated[_SystemMessage, Tag("~system")], Annotated[_UserMessage, Tag("~user")],
           Annotated[_AssistantMessage, Tag("~assistant")], Annotated[_ToolMessage, Tag("~tool")],
           Annotated[_FunctionMessage, Tag("~function")]),
    Discriminator(_role_tag, custom_error_type="invalid_message",
                  custom_error_message="must be a message object with a 'role' of " + ", ".join(ROLES[:-1])
                  + " or " + ROLES[-1]),
]


# ---------------------------------------------------------------- tools and formats


def _function_name(value: str) -> str:
    if not _NAME.match(value):
        raise _fail("invalid_name", "must be 1 to 64 characters of a-z, A-Z, 0-9, '_' and '-'")
    return value


FunctionName = Annotated[StrictStr, AfterValidator(_function_name)]


class _FunctionDef(_Open):
    name: FunctionName
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class _Tool(_Open):
    type: Literal["function"]
    function: _FunctionDef


class _NamedFunction(_Open):
    name: StrictStr


class _NamedToolChoice(_Open):
    type: Literal["function"]
    function: _NamedFunction


def _choice_tag(value: Any) -> str | None:
    if isinstance(value, str):
        return "~mode"
    if isinstance(value, dict):
        return "~named"
    return None


ToolChoice = Annotated[
    _union(Annotated[Literal["none", "auto", "required"], Tag("~mode")], Annotated[_NamedToolChoice, Tag("~named")]),
    Discriminator(_choice_tag, custom_error_type="invalid_tool_choice",
                  custom_error_message="must be 'none', 'auto', 'required' or "
                                       "{\"type\": \"function\", \"function\": {\"name\": …}}"),
]
FunctionCallChoice = Annotated[
    _union(Annotated[Literal["none", "auto"], Tag("~mode")], Annotated[_NamedFunction, Tag("~named")]),
    Discriminator(_choice_tag, custom_error_type="invalid_function_call",
                  custom_error_message="must be 'none', 'auto' or {\"name\": …}"),
]


class _JSONSchema(_Open):
    name: FunctionName
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class _TextFormat(_Open):
    type: Literal["text"]


class _JSONObjectFormat(_Open):
    type: Literal["json_object"]


class _JSONSchemaFormat(_Open):
    type: Literal["json_schema"]
    json_schema: _JSONSchema


_FORMATS = ("text", "json_object", "json_schema")


def _formats(json_schema: type, error_type: str) -> Any:
    """text | json_object | json_schema (chat's and the Responses API's json_schema shapes differ)."""
    return Annotated[
        _union(Annotated[_TextFormat, Tag("~text")], Annotated[_JSONObjectFormat, Tag("~json_object")],
               Annotated[json_schema, Tag("~json_schema")]),
        Discriminator(_part_tag(_FORMATS), custom_error_type=error_type,
                      custom_error_message="must be an object with a 'type' of text, json_object or json_schema"),
    ]


ResponseFormat = _formats(_JSONSchemaFormat, "invalid_response_format")


class _StreamOptions(_Open):
    include_usage: StrictBool | None = None
    include_obfuscation: StrictBool | None = None


# ---------------------------------------------------------------- field checks


def _stop(value: Any) -> Any:
    """OpenAI's StopConfiguration: a string or up to 4 strings (the engine took 16); an empty string is a string
    there too (the engine refused it; it now ignores it: an empty stop sequence cannot end anything)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and len(value) <= 4 and all(isinstance(s, str) for s in value):
        return value
    raise _fail("invalid_stop", "must be a string or an array of at most 4 strings")


def _metadata(value: Any) -> Any:
    if value is None:
        return value
    if not isinstance(value, dict):
        raise _fail("invalid_metadata", "must be an object of string keys and string values")
    pairs = {k: v for k, v in value.items() if k != REFERENCE_KEY}
    if REFERENCE_KEY in value and not isinstance(value[REFERENCE_KEY], str):
        raise _fail("invalid_metadata", f"'{REFERENCE_KEY}' must be a string")
    if len(pairs) > METADATA_MAX_PAIRS:
        raise _fail("invalid_metadata", f"must have at most {METADATA_MAX_PAIRS} key-value pairs")
    for key, item in pairs.items():
        if len(key) > METADATA_MAX_KEY:
            raise _fail("invalid_metadata", f"keys must be at most {METADATA_MAX_KEY} characters")
        if not isinstance(item, str) or len(item) > METADATA_MAX_VALUE:
            raise _fail("invalid_metadata", f"values must be strings of at most {METADATA_MAX_VALUE} characters")
    return value


def _logit_bias(value: Any) -> Any:
    if value is None:
        return value
    if not isinstance(value, dict):
        raise _fail("invalid_logit_bias", "must be an object mapping token ids to numbers from -100 to 100")
    for key, bias in value.items():
        if not key.isdigit():
            raise _fail("invalid_logit_bias", "keys must be token ids (strings of digits)")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise _fail("invalid_logit_bias", "values must be numbers from -100 to 100")
    return value


def _token_ids(value: Any) -> bool:
    """Token ids index a vocabulary: integers from 0 (the engine refused negative ones, the gateway sent them on)."""
    return all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


def _text_or_tokens(value: Any, *, empty_strings: bool) -> bool:
    """A non-empty string, or a non-empty array of strings, of token ids, or of non-empty token-id arrays."""
    if isinstance(value, str):
        return bool(value)
    if not isinstance(value, list) or not value:
        return False
    return (all(isinstance(p, str) and (empty_strings or p) for p in value) or _token_ids(value)
            or all(isinstance(p, list) and p and _token_ids(p) for p in value))


def _prompt(value: Any) -> Any:
    if _text_or_tokens(value, empty_strings=True):
        return value
    # `code`: the API error's code (openai_wire.request_errors), the engine's name for an empty prompt
    empty = {"code": "empty_prompt"} if value in ("", []) else {}
    raise _fail("invalid_prompt", "must be a non-empty string, array of strings, array of token ids, "
                                  "or array of token-id arrays", **empty)


# Token fields (budgets multiply them: gateway/admission.py): integers within bounds, on every endpoint.
MAX_TOKENS_LIMIT = 10_000_000  # far past any model's output limit; keeps the worst-case arithmetic finite
MAX_CHOICES = 128  # n and best_of: OpenAI's n allows 1 to 128 (the engine capped it at 64)
# The fields budgets reserve by, with the largest value each accepts (TOKEN_FIELDS: their names).
_TOKEN_LIMITS = {"max_tokens": MAX_TOKENS_LIMIT, "max_completion_tokens": MAX_TOKENS_LIMIT,
                 "max_output_tokens": MAX_TOKENS_LIMIT, "n": MAX_CHOICES, "best_of": MAX_CHOICES}
TOKEN_FIELDS = tuple(_TOKEN_LIMITS)
TokenCap = Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS_LIMIT)]
Choices = Annotated[StrictInt, Field(ge=1, le=MAX_CHOICES)]


class _TokenFields(_Open):
    """The fields budgets reserve by, checked on every endpoint, including where the endpoint's own schema does
    not name them (they still reach the upstream, which may honour them)."""

    max_tokens: TokenCap | None = None
    max_completion_tokens: TokenCap | None = None
    max_output_tokens: TokenCap | None = None
    n: Choices | None = None
    best_of: Choices | None = None


Stop = Annotated[Any, AfterValidator(_stop)]
Metadata = Annotated[Any, AfterValidator(_metadata)]
LogitBias = Annotated[Any, AfterValidator(_logit_bias)]
Temperature = Annotated[Number, Field(ge=0, le=2)]
Penalty = Annotated[Number, Field(ge=-2, le=2)]
PositiveInt = Annotated[StrictInt, Field(ge=1)]
# OpenAI's top_p is 0 to 1, 0 included (the engine refused 0: it now keeps the single most likely token).
TopP = Annotated[Number, Field(ge=0, le=1)]
# OpenAI's seed is a signed 64-bit integer (the gateway took any integer, the engine up to 2**64 - 1).
Seed = Annotated[StrictInt, Field(ge=-(2**63), le=2**63 - 1)]


class _Common(_Open):
    model: Annotated[StrictStr, Field(min_length=1)]
    stream: StrictBool | None = None
    stream_options: _StreamOptions | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: Choices | None = None
    max_tokens: TokenCap | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    stop: Stop = None
    seed: Seed | None = None
    user: StrictStr | None = None
    logit_bias: LogitBias = None
    metadata: Metadata = None
    service_tier: StrictStr | None = None


class ChatRequest(_Common):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: TokenCap | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[_Tool], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    functions: list[_FunctionDef] | None = None
    function_call: FunctionCallChoice | None = None
    store: StrictBool | None = None
    reasoning_effort: StrictStr | None = None
    modalities: list[StrictStr] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _cross_field(self) -> ChatRequest:
        # A forced tool needs tools to force; "none" and "auto" without tools ask for nothing (OpenAI's schema
        # states no rule there, and the engine, which refused them, now takes them).
        if self.top_logprobs is not None and not self.logprobs:
            raise _fail("invalid_top_logprobs", "requires 'logprobs': true", field="top_logprobs")
        choice = self.tool_choice
        if isinstance(choice, _NamedToolChoice) or choice == "required":
            if not self.tools:
                raise _fail("invalid_tool_choice", "needs 'tools' to choose from", field="tool_choice")
            if isinstance(choice, _NamedToolChoice) and choice.function.name not in {
                    t.function.name for t in self.tools}:
                raise _fail("invalid_tool_choice", "names a function that is not in 'tools'",
                            field="tool_choice.function.name")
        return self


class CompletionRequest(_Common):
    prompt: Annotated[Any, AfterValidator(_prompt)]
    logprobs: Annotated[StrictInt, Field(ge=0, le=5)] | None = None  # OpenAI's maximum (the engine took 20)
    echo: StrictBool | None = None
    best_of: Choices | None = None
    suffix: StrictStr | None = None


# ---------------------------------------------------------------- /v1/embeddings

EMBEDDING_MAX_INPUTS = 2048


def _embedding_input(value: Any) -> Any:
    if isinstance(value, list) and len(value) > EMBEDDING_MAX_INPUTS:
        raise _fail("invalid_input", f"must have at most {EMBEDDING_MAX_INPUTS} items")
    if _text_or_tokens(value, empty_strings=False):
        return value
    raise _fail("invalid_input", "must be a non-empty string, array of non-empty strings, array of token ids, "
                                 "or array of token-id arrays")


def _not_streamed(value: Any) -> Any:
    if value:
        raise _fail("unsupported_parameter", "is not supported: embeddings are not streamed")
    return value


MAX_EMBEDDING_DIMENSIONS = 65_536


class EmbeddingRequest(_Open):
    model: Annotated[StrictStr, Field(min_length=1)]
    input: Annotated[Any, AfterValidator(_embedding_input)]
    encoding_format: Literal["float", "base64"] | None = None
    # No embedding model has more than a few thousand dimensions; the bound keeps a hostile value from making an
    # upstream (or a stand-in) allocate gigabytes.
    dimensions: Annotated[PositiveInt, Field(le=MAX_EMBEDDING_DIMENSIONS)] | None = None
    user: StrictStr | None = None
    stream: Annotated[Any, AfterValidator(_not_streamed)] = None


# ---------------------------------------------------------------- /v1/responses (text in, text out)


class _InputTextPart(_Open):
    type: Literal["input_text"]
    text: StrictStr


class _OutputTextPart(_Open):
    type: Literal["output_text"]
    text: StrictStr


def _refuse(message: str) -> type[_Open]:
    class _Refused(_Open):
        @model_validator(mode="before")
        @classmethod
        def _refuse(cls, value: Any) -> Any:
            raise _fail("unsupported_content", message)
    return _Refused


_MEDIA_PARTS = ("input_image", "input_file", "input_audio")
_MediaPart = _refuse("is not supported: this gateway serves text input only on /v1/responses "
                     "(images, files and audio are not accepted)")


def _response_part_tag(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind in _MEDIA_PARTS:
        return "~media"
    return "~" + kind if kind in ("input_text", "output_text") else None


ResponsePart = Annotated[
    _union(Annotated[_InputTextPart, Tag("~input_text")], Annotated[_OutputTextPart, Tag("~output_text")],
           Annotated[_MediaPart, Tag("~media")]),
    Discriminator(_response_part_tag, custom_error_type="invalid_content_part",
                  custom_error_message="must be a content part object with a 'type' of input_text or output_text"),
]


class _InputMessage(_Open):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: _content(ResponsePart)


_OtherItem = _refuse("is not supported: only message items (a 'role' and text 'content') are accepted on "
                     "/v1/responses; function calls, tool outputs and item references are not")


def _item_tag(value: Any) -> str | None:
    if not isinstance(value, dict):
        return None
    return "~message" if value.get("type", "message") == "message" else "~other"


InputItem = Annotated[
    _union(Annotated[_InputMessage, Tag("~message")], Annotated[_OtherItem, Tag("~other")]),
    Discriminator(_item_tag, custom_error_type="invalid_input_item",
                  custom_error_message="must be an input item object with a 'role' and 'content'"),
]


def _input_tag(value: Any) -> str | None:
    if isinstance(value, str):
        return "~text"
    return "~items" if isinstance(value, list) else None


ResponseInput = Annotated[
    _union(Annotated[StrictStr, Tag("~text")], Annotated[Annotated[list[InputItem], Field(min_length=1)],
                                                          Tag("~items")]),
    Discriminator(_input_tag, custom_error_type="invalid_input",
                  custom_error_message="must be a string or an array of input items"),
]


class _ResponseJSONSchema(_Open):
    type: Literal["json_schema"]
    name: FunctionName
    schema_: dict[str, Any] = Field(alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None


_TextFormats = _formats(_ResponseJSONSchema, "invalid_text_format")


class _ResponseText(_Open):
    format: _TextFormats | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


# Fields that need what the gateway does not have: stored state, server-side tools, background jobs.
_STATEFUL = "is not supported: this gateway keeps no conversation state; send the whole conversation in 'input'"
_REFUSED_RESPONSE_FIELDS = {
    "previous_response_id": _STATEFUL,
    "conversation": _STATEFUL,
    "prompt": "is not supported: stored prompts live with OpenAI; send 'instructions' and 'input'",
    "background": "is not supported: responses are answered while the request is open",
    "tools": "is not supported: /v1/responses serves text input and output (no built-in or function tools); "
             "use /v1/chat/completions for tool calls",
    "include": "is not supported: /v1/responses serves text output only",
}


class ResponsesRequest(_Open):
    model: Annotated[StrictStr, Field(min_length=1)]
    input: ResponseInput
    instructions: StrictStr | None = None
    max_output_tokens: Annotated[StrictInt, Field(ge=16, le=MAX_TOKENS_LIMIT)] | None = None  # OpenAI's minimum
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: StrictBool | None = None
    metadata: Metadata = None
    user: StrictStr | None = None
    store: StrictBool | None = None
    text: _ResponseText | None = None
    tool_choice: Literal["none", "auto"] | None = None
    previous_response_id: Any = None
    conversation: Any = None
    prompt: Any = None
    background: Any = None
    tools: Any = None
    include: Any = None

    @model_validator(mode="after")
    def _refused(self) -> ResponsesRequest:
        for name, why in _REFUSED_RESPONSE_FIELDS.items():
            value = getattr(self, name)
            if value not in (None, False, [], ""):
                raise _fail("unsupported_parameter", why, field=name)
        return self


# The model each endpoint's body is validated with.
MODELS: dict[str, type[_Open]] = {"chat": ChatRequest, "completions": CompletionRequest,
                                  "embeddings": EmbeddingRequest, "responses": ResponsesRequest}
