"""OpenAI request bodies (validated with pydantic) for the engine's own server; errors are openai_wire.APIError.

Unknown fields are accepted and ignored (clients send `user`, `metadata`, ...); known fields with invalid
values are refused with a 400 that names the field. Extensions beyond OpenAI, as vLLM spells them:
`top_k`, `stop_token_ids`, `ignore_eos` (and `add_generation_prompt`, `chat_template_kwargs` for chat).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from hosted.sampling_params import MAX_TOP_LOGPROBS
from openai_wire import APIError

MAX_N = 64  # choices per request; each one is a sequence in the batch
MAX_STOP_STRINGS = 16


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "json-or-python"})


def param_path(loc: tuple | list) -> str | None:
    """pydantic's loc as OpenAI writes a `param`: ('messages', 0, 'content', 'str') → messages[0].content (list
    indexes in brackets; union-member tags — type names, model class names — left out)."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isdigit() or (part == part.lower() and part not in _TYPE_TAGS and "[" not in part
                                and not part.startswith("function-")):
            path += f".{part}" if path else part
    return path or None


def validation_error(exc: ValidationError) -> APIError:
    """The first pydantic error, as a 400 naming the field."""
    err = exc.errors()[0]
    param = param_path(err.get("loc", ()))
    msg = err.get("msg", "invalid value")
    text = f"invalid value for {param!r}: {msg}" if param else msg
    code = "missing_required_parameter" if err.get("type") == "missing" else "invalid_value"
    return APIError(400, text, param=param, code=code)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


StopField = Annotated[str | list[str] | None, Field(default=None)]


class _SamplingRequest(BaseModel):
    """Fields shared by chat and completions requests."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # extension; 0 or -1 = off
    n: int = Field(default=1, ge=1, le=MAX_N)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    max_tokens: int | None = Field(default=None, ge=1)
    stop: StopField
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None  # extension
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    ignore_eos: bool = False  # extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else list(value)
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @property
    def stop_list(self) -> list[str]:
        return list(self.stop or [])  # type: ignore[arg-type]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, tool_call_id, reasoning_content ...
    role: str = Field(min_length=1)
    content: str | list[TextPart] | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it: text parts joined, extra fields kept."""
        data = self.model_dump(exclude_none=False)
        if isinstance(self.content, list):
            data["content"] = "\n".join(part.text for part in self.content)
        return data


_NAME = r"^[A-Za-z0-9_\-]{1,64}$"  # OpenAI's rule for function and json_schema names


class JSONSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(pattern=_NAME)
    description: str | None = None
    # `schema` shadows a BaseModel attribute in pydantic, hence the alias.
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's text / json_object / json_schema (one model rather than a tagged union, so that a 400 names the
    field as the client wrote it; request_plan checks that json_schema comes with its type)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaSpec | None = None


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(pattern=_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @property
    def tool_choice_name(self) -> str | None:
        """"none" / "auto" / "required", or the forced function's name; None when tools are absent."""
        if not self.tools:
            return None
        choice = self.tool_choice
        if choice is None:
            return "auto"
        return choice if isinstance(choice, str) else choice.function.name

    def tool_dicts(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools or []]
    add_generation_prompt: bool = True  # extension
    chat_template_kwargs: dict[str, Any] | None = None  # extension

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


PromptField = str | list[str] | list[Annotated[int, Field(ge=0)]] | list[list[Annotated[int, Field(ge=0)]]]


class CompletionRequest(_SamplingRequest):
    prompt: PromptField
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts, each text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return []
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


def parse_request(model: type[_SamplingRequest], payload: Any) -> Any:
    if not isinstance(payload, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise validation_error(exc) from None
