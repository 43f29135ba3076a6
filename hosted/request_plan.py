"""Turn a validated OpenAI request into a plan: the prompt token ids, sampling parameters and output options
of every engine sequence it asks for, or a 400 naming what is wrong."""
from __future__ import annotations

import dataclasses
import threading
import uuid
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from hosted import tool_calls
from hosted.async_llm_engine import AsyncLLMEngine
from hosted.sampling_params import SamplingParams
from hosted.schema_support import StrictSchemaError, check_strict, grammar_schema
from hosted.structured import GrammarCompiler, SchemaError, check_schema
from hosted.tokenizer import ChatTemplateError, Tokenizer
from openai_wire import APIError
from openai_wire.engine_requests import EngineChatRequest, EngineCompletionRequest, part_text

_COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(slots=True)
class PromptJob:
    ids: list[int]
    params: SamplingParams
    context_ids: list[int]  # left context for detokenizing (completions: the prompt)
    echo_text: str = ""


@dataclass(slots=True)
class Plan:
    kind: str  # "chat" | "completion"
    request_id: str
    jobs: list[PromptJob]
    n: int
    stop: list[str]
    logprobs: bool
    top_logprobs: int
    stream: bool
    include_usage: bool
    tools: bool = False  # parse the output into tool_calls (hosted/tool_calls.py)


def plan_request(kind: str, req: EngineChatRequest | EngineCompletionRequest, tokenizer: Tokenizer,
                 engine: AsyncLLMEngine) -> Plan:
    reject_unsupported(req)
    if kind == "chat":
        return plan_chat(req, tokenizer, engine)  # type: ignore[arg-type]
    return plan_completion(req, tokenizer, engine)  # type: ignore[arg-type]


# OpenAI request fields the engine takes without acting on them, when they ask for nothing it cannot do:
# `metadata` and `user` describe the request (the gateway logs them), and these values change nothing.
_ACCEPTED_AS_IS: dict[str, Any] = {"metadata": None, "user": None, "store": (None, False),
                                   "service_tier": (None, "auto", "default"), "modalities": (None, ["text"]),
                                   "logit_bias": (None, {}), "reasoning_effort": (None,)}
# Fields it cannot honour, and what to do instead.
_UNSUPPORTED = {
    "functions": "use `tools` (the legacy `functions` are not supported)",
    "function_call": "use `tool_choice` (the legacy `function_call` is not supported)",
    "logit_bias": "logit_bias is not supported by this engine",
    "audio": "audio output is not supported by this engine",
    "modalities": "only text output is supported by this engine",
    "prediction": "predicted outputs are not supported by this engine",
    "web_search_options": "web search is not supported by this engine",
    "reasoning_effort": "this model does not reason: remove reasoning_effort",
    "store": "this engine does not store completions (store must be false)",
    "service_tier": "this engine has one service tier (auto)",
}


def reject_unsupported(req: EngineChatRequest | EngineCompletionRequest) -> None:
    """Nothing is silently ignored: a field the engine does not know, or cannot honour, is a 400 naming it."""
    for name, value in _not_acted_on(req):
        accepted = _ACCEPTED_AS_IS.get(name, ())
        if name in _ACCEPTED_AS_IS and (accepted is None or value in accepted):
            continue
        hint = _UNSUPPORTED.get(name)
        message = hint or f"unknown field {name!r}: this engine does not support it"
        raise APIError(400, message, param=name, code="unsupported_parameter")


def _not_acted_on(req: EngineChatRequest | EngineCompletionRequest) -> Iterator[tuple[str, Any]]:
    """(name, value) of each field the request sets that the engine does not act on by itself: the OpenAI fields
    it takes as they are or cannot honour (a null asks for nothing), then every field it does not know."""
    for name in type(req).model_fields:
        if (name in _ACCEPTED_AS_IS or name in _UNSUPPORTED) and name in req.model_fields_set:
            value = getattr(req, name)
            if value is not None:
                yield name, value
    yield from (req.model_extra or {}).items()


def too_long(prompt_len: int, max_tokens: int, engine: AsyncLLMEngine, param: str) -> APIError | None:
    total = prompt_len + max_tokens
    if total > engine.max_model_len:
        return APIError(400, f"the prompt has {prompt_len} tokens and max_tokens is {max_tokens}: together "
                             f"{total} tokens, more than this model's context length of {engine.max_model_len} "
                             f"tokens; shorten the prompt or lower max_tokens", param=param,
                        code="context_length_exceeded")
    if total > engine.max_request_tokens:
        return APIError(400, f"the prompt has {prompt_len} tokens and max_tokens is {max_tokens}: together "
                             f"{total} tokens, more than the engine's KV cache can hold for one request "
                             f"({engine.max_request_tokens}); shorten the prompt or lower max_tokens",
                        param=param, code="context_length_exceeded")
    return None


def _check_length(prompt_len: int, max_tokens: int, engine: AsyncLLMEngine, param: str) -> None:
    err = too_long(prompt_len, max_tokens, engine, param)
    if err:
        raise err


def build_sampling_params(req: EngineChatRequest | EngineCompletionRequest, max_tokens: int, tokenizer: Tokenizer,
                          engine: AsyncLLMEngine, logprobs: bool, top_logprobs: int) -> SamplingParams:
    stop_ids = list(req.stop_token_ids or [])
    if not req.ignore_eos:
        # The tokenizer's EOS (tokenizer_config / generation_config) ends generation even when the model's
        # config.json does not list it.
        for tid in tokenizer.eos_token_ids:
            if tid not in engine.engine.eos_token_ids and tid not in stop_ids:
                stop_ids.append(tid)
    top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
    top_p = 1.0 if req.top_p is None else float(req.top_p)
    if top_p == 0.0:  # OpenAI's top_p 0: the smallest nucleus, the one most likely token (the sampler needs p > 0)
        top_p, top_k = 1.0, 1
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=top_p,
        top_k=top_k,
        seed=req.seed,
        presence_penalty=float(req.presence_penalty or 0.0),
        frequency_penalty=float(req.frequency_penalty or 0.0),
        stop_token_ids=stop_ids,
        ignore_eos=bool(req.ignore_eos),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )
    try:
        params.validate(engine.engine.model_config.vocab_size)
    except ValueError as exc:
        raise APIError(400, str(exc), param=str(exc).split(" ", 1)[0], code="invalid_value") from None
    return params


# ---------------------------------------------------------------------------------------------- size
# A token stands for at most `tokenizer.max_token_bytes` bytes of text; the factor covers normalizers that shrink
# text. A prompt longer than this many bytes per allowed token cannot fit and is refused without tokenizing it.
_BYTES_SLACK = 4


def check_text_size(nbytes: int, tokenizer: Tokenizer, engine: AsyncLLMEngine, param: str) -> None:
    limit = engine.max_request_tokens * tokenizer.max_token_bytes * _BYTES_SLACK
    if nbytes > limit:
        raise APIError(400, f"the prompt is {nbytes} bytes long: far more than the {engine.max_request_tokens} "
                            f"tokens one request can hold on this engine (context length {engine.max_model_len}); "
                            f"shorten it", param=param, code="context_length_exceeded")


# ---------------------------------------------------------------------------------------------- grammars
_COMPILERS: weakref.WeakKeyDictionary[Tokenizer, GrammarCompiler] = weakref.WeakKeyDictionary()
_COMPILERS_LOCK = threading.Lock()


def grammar_compiler(tokenizer: Tokenizer, engine: AsyncLLMEngine) -> GrammarCompiler:
    """The (cached) xgrammar compiler for this tokenizer and the engine's logits width."""
    with _COMPILERS_LOCK:
        compiler = _COMPILERS.get(tokenizer)
        if compiler is None:
            stops = list(engine.engine.eos_token_ids) + list(tokenizer.eos_token_ids)
            compiler = GrammarCompiler(tokenizer, engine.engine.model_config.vocab_size, stops)
            _COMPILERS[tokenizer] = compiler
        return compiler


def _response_schema(req: EngineChatRequest) -> Any:
    """The JSON schema response_format asks for, or None for free text."""
    rf = req.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return {"type": "object"}
    if rf.json_schema is None:
        raise APIError(400, "response_format of type json_schema needs response_format.json_schema",
                       param="response_format.json_schema", code="missing_required_parameter")
    schema = rf.json_schema.schema_  # a JSON object (OpenAI's schema; the engine once also took true and false)
    if schema is None:
        raise APIError(400, "response_format.json_schema.schema is required", param="response_format.json_schema.schema",
                       code="missing_required_parameter")
    _check(schema, "response_format.json_schema.schema", strict=rf.json_schema.strict is True)
    return schema


def _check(schema: Any, param: str, strict: bool) -> None:
    """A 400 for an invalid schema (naming `param`); under strict, also for any keyword the grammar would not
    enforce (hosted/schema_support.py's allow-list), naming the keyword's own path. Non-strict schemas are
    best effort: what the grammar cannot enforce is not refused there unless check_schema knows it."""
    try:
        if strict:  # first: the allow-list names the keyword's own path
            check_strict(schema, param)
        check_schema(schema, param)
    except StrictSchemaError as exc:
        raise APIError(400, f"strict schema: {exc}", param=exc.path, code="invalid_value") from None
    except SchemaError as exc:
        raise APIError(400, f"invalid schema: {exc}", param=param, code="invalid_value") from None


def _tools(req: EngineChatRequest) -> tuple[list[dict[str, Any]] | None, str | None]:
    """(the tool definitions the prompt and grammar use, tool choice) or a 400. A forced choice without tools is
    the schema's 400 (openai_wire/requests.py); "none" or "auto" without tools asks for no tool."""
    choice = req.tool_choice_name
    if choice is None or choice == "none":
        return None, choice
    tools = req.tool_dicts()
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tools holds two functions with the same name", param="tools", code="invalid_value")
    if choice not in ("auto", "required") and choice not in names:
        raise APIError(400, f"tool_choice names the function {choice!r}, which is not among the tools",
                       param="tool_choice.function.name", code="invalid_value")
    for i, tool in enumerate(tools):
        params = tool["function"].get("parameters")
        param = f"tools[{i}].function.parameters"
        if params is not None:
            if params.get("type", "object") != "object":
                raise APIError(400, "a function's parameters must be a JSON schema of type 'object'", param=param,
                               code="invalid_value")
            _check(params, param, strict=tool["function"].get("strict") is True)
    return tools, choice


def _chat_grammar(req: EngineChatRequest, tools: list[dict[str, Any]] | None, choice: str | None,
                  tokenizer: Tokenizer, engine: AsyncLLMEngine) -> Any:
    schema = _response_schema(req)
    if tools is None and schema is None:
        return None
    compiler = grammar_compiler(tokenizer, engine)
    schema = None if schema is None else grammar_schema(schema)
    try:
        if tools is None:
            return compiler.json_schema(schema)
        tools = [_grammar_tool(t) for t in tools]
        text = None
        if schema is not None:
            text = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}
        parallel = req.parallel_tool_calls is True  # default one call: small models otherwise repeat calls
        return compiler.structural_tag(tool_calls.tool_format(tools, choice, parallel, text))
    except SchemaError as exc:
        param = "tools" if tools is not None and schema is None else "response_format.json_schema.schema"
        raise APIError(400, f"invalid schema: {exc}", param=param, code="invalid_value") from None


def _grammar_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """The tool as the grammar sees it: its parameters' loosely enforced formats made exact (the prompt keeps
    the client's schema)."""
    params = tool["function"].get("parameters")
    if params is None:
        return tool
    return {**tool, "function": {**tool["function"], "parameters": grammar_schema(params)}}


# ---------------------------------------------------------------------------------------------- chat
def plan_chat(req: EngineChatRequest, tokenizer: Tokenizer, engine: AsyncLLMEngine) -> Plan:
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs", code="invalid_value")
    tools, choice = _tools(req)
    _refuse_media(req)
    nbytes = sum(len(m.content.encode()) if isinstance(m.content, str) else
                 sum(len(part_text(p).encode()) for p in m.content or []) for m in req.messages)
    check_text_size(nbytes, tokenizer, engine, "messages")
    ids = _chat_prompt_ids(req, tokenizer, tools, choice)
    max_tokens = req.max_output_tokens
    if max_tokens is None:
        max_tokens = engine.max_request_tokens - len(ids)  # all the room left (max_request_tokens <= context)
        if max_tokens < 1:
            raise APIError(400, f"the messages have {len(ids)} tokens, which leaves no room to answer within "
                                f"this model's context length of {engine.max_model_len} tokens",
                           param="messages", code="context_length_exceeded")
    _check_length(len(ids), max_tokens, engine, "messages")
    top = int(req.top_logprobs or 0)
    params = build_sampling_params(req, max_tokens, tokenizer, engine, bool(req.logprobs), top)
    grammar = _chat_grammar(req, tools, choice, tokenizer, engine)
    if grammar is not None:
        params = dataclasses.replace(params, grammar=grammar, stop_token_ids=list(params.stop_token_ids))
    return Plan("chat", f"chatcmpl-{uuid.uuid4().hex}", [PromptJob(ids, params, [])], req.n or 1, req.stop_list,
                bool(req.logprobs), top, bool(req.stream), req.include_usage, tools=tools is not None)


def _refuse_media(req: EngineChatRequest) -> None:
    """The engine reads text: an image, audio or file part (the schema's for a user message) is a 400 naming it."""
    for i, message in enumerate(req.messages):
        for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
            if part_text(part) is None:
                raise APIError(400, f"{part.type} content parts are not supported by this engine (text only)",
                               param=f"messages[{i}].content[{j}]", code="unsupported_parameter")


def _chat_prompt_ids(req: EngineChatRequest, tokenizer: Tokenizer, tools: list[dict[str, Any]] | None,
                     choice: str | None) -> list[int]:
    """The conversation rendered through the chat template (tools as hosted/tool_calls.py describes), as ids."""
    messages = req.template_messages()
    for i, m in enumerate(messages):
        if m.get("role") == "function":
            raise APIError(400, "the legacy `function` role is not supported: send tool results as `tool` "
                                "messages", param=f"messages[{i}].role", code="unsupported_parameter")
    try:
        source = tokenizer.chat_template_source(tools)
        if "developer" not in (source or ""):  # OpenAI's `developer` is the system prompt of newer models
            messages = [dict(m, role="system") if m.get("role") == "developer" else m for m in messages]
        native = tool_calls.template_supports_tools(source)
        if tools is not None or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
            messages = tool_calls.prepare_messages(messages, tools, choice, native)
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt is not False,
                                             tools=tools if native else None, **(req.chat_template_kwargs or {}))
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param="messages", code="invalid_value") from None
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise APIError(400, "the rendered conversation is empty", param="messages", code="empty_prompt")
    return ids


# ---------------------------------------------------------------------------------------------- completions
def plan_completion(req: EngineCompletionRequest, tokenizer: Tokenizer, engine: AsyncLLMEngine) -> Plan:
    _check_completion_options(req)
    prompts = req.prompts()
    if not prompts:
        raise APIError(400, "prompt is empty", param="prompt", code="empty_prompt")
    max_tokens = req.max_output_tokens if req.max_output_tokens is not None else _COMPLETION_DEFAULT_MAX_TOKENS
    logprobs = req.logprobs is not None
    top = int(req.logprobs or 0)
    params = build_sampling_params(req, max_tokens, tokenizer, engine, logprobs, top)
    jobs = []
    for i, prompt in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if isinstance(prompt, str):
            check_text_size(len(prompt.encode()), tokenizer, engine, param)
        ids, echo_text = _completion_prompt(req, prompt, param, tokenizer, engine.engine.model_config.vocab_size)
        _check_length(len(ids), max_tokens, engine, param)
        jobs.append(PromptJob(ids, params, ids, echo_text if req.echo else ""))
    return Plan("completion", f"cmpl-{uuid.uuid4().hex}", jobs, req.n or 1, req.stop_list, logprobs, top,
                bool(req.stream), req.include_usage)


def _check_completion_options(req: EngineCompletionRequest) -> None:
    if req.suffix:
        raise APIError(400, "suffix is not supported by this engine", param="suffix", code="invalid_value")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise APIError(400, "best_of other than n is not supported by this engine", param="best_of",
                       code="invalid_value")
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo together with logprobs is not supported (prompt logprobs are not computed)",
                       param="echo", code="invalid_value")


def _completion_prompt(req: EngineCompletionRequest, prompt: str | list[int], param: str, tokenizer: Tokenizer,
                       vocab: int) -> tuple[list[int], str]:
    """(token ids, echo text) of one prompt, text or token ids."""
    if isinstance(prompt, str):
        if prompt == "":
            raise APIError(400, "prompt is empty", param=param, code="empty_prompt")
        return tokenizer.encode(prompt), prompt
    ids = list(prompt)
    if not ids:
        raise APIError(400, "prompt is empty", param=param, code="empty_prompt")
    bad = next((t for t in ids if t >= vocab), None)
    if bad is not None:
        raise APIError(400, f"prompt holds token id {bad}, outside this model's vocabulary of {vocab}",
                       param=param, code="invalid_value")
    return ids, tokenizer.decode(ids) if req.echo else ""
