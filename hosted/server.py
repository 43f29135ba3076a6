"""The engine's OpenAI-compatible HTTP server (Starlette + uvicorn).

Routes: POST /v1/chat/completions, POST /v1/completions (plain and SSE), GET /v1/models, GET /health
(200 once the model is loaded, 503 before), GET /metrics (Prometheus text).

Every response carries OpenAI `usage` (with `prompt_tokens_details.cached_tokens` from the prefix cache)
and the extension `"switchyard": {"device_seconds", "utilisation"}`; when streaming, both ride on the
final chunk (the usage chunk if `stream_options.include_usage`, else the last choice's finish chunk).

A request fans out into one engine sequence per (prompt, choice). With `n > 1` the first sequence runs
alone until its prompt is in the KV cache, then the others start and reuse it through the prefix cache.
A client that disconnects aborts every sequence of its request, freeing their blocks.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from hosted.async_engine import Admission, AsyncEngine, EngineDeadError, EngineOverloaded
from hosted.detokenizer import TextStream
from hosted.engine import StepOutput
from hosted.metrics import EngineMetrics
from hosted.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
)
from hosted.sampling import SamplingParams
from hosted.tokenizer import ChatTemplateError, Tokenizer

log = logging.getLogger("switchyard.engine.server")

_MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI clamps the same way


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _status_label(status: int) -> str:
    return {400: "invalid", 404: "not_found", 429: "overloaded"}.get(status, "error")


# ---------------------------------------------------------------------------------------------- state
@dataclass
class ServerState:
    model_name: str
    engine: AsyncEngine | None = None
    tokenizer: Tokenizer | None = None
    metrics: EngineMetrics = field(default_factory=EngineMetrics)
    load_error: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    _token_text: dict[int, tuple[str, list[int]]] = field(default_factory=dict)

    def ready(self) -> tuple[AsyncEngine, Tokenizer]:
        if self.engine is None or self.tokenizer is None:
            msg = f"the model failed to load: {self.load_error}" if self.load_error else "the model is still loading"
            raise APIError(503, msg, type="service_unavailable", code="model_not_ready",
                           headers={"Retry-After": "5"})
        if not self.engine.alive:
            raise APIError(503, f"the engine is not running: {self.engine.dead or 'shutting down'}",
                           type="service_unavailable", code="engine_down")
        return self.engine, self.tokenizer

    def token_text(self, token_id: int) -> tuple[str, list[int]]:
        cached = self._token_text.get(token_id)
        if cached is None:
            assert self.tokenizer is not None
            raw = self.tokenizer.token_bytes(token_id)
            cached = (raw.decode("utf-8", errors="replace"), list(raw))
            if len(self._token_text) < 1_000_000:
                self._token_text[token_id] = cached
        return cached


# ---------------------------------------------------------------------------------------------- planning
@dataclass(slots=True)
class _PromptJob:
    ids: list[int]
    params: SamplingParams
    context_ids: list[int]  # left context for detokenizing (completions: the prompt)
    echo_text: str = ""


@dataclass(slots=True)
class _Plan:
    kind: str  # "chat" | "completion"
    request_id: str
    jobs: list[_PromptJob]
    n: int
    stop: list[str]
    logprobs: bool
    top_logprobs: int
    stream: bool
    include_usage: bool


def _too_long(prompt_len: int, max_tokens: int, engine: AsyncEngine, param: str) -> APIError | None:
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


def _sampling_params(req: ChatCompletionRequest | CompletionRequest, max_tokens: int, tokenizer: Tokenizer,
                     engine: AsyncEngine, logprobs: bool, top_logprobs: int) -> SamplingParams:
    stop_ids = list(req.stop_token_ids or [])
    if not req.ignore_eos:
        # The tokenizer's EOS (tokenizer_config / generation_config) ends generation even when the model's
        # config.json does not list it.
        for tid in tokenizer.eos_token_ids:
            if tid not in engine.engine.eos_token_ids and tid not in stop_ids:
                stop_ids.append(tid)
    top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p),
        top_k=top_k,
        seed=req.seed,
        presence_penalty=float(req.presence_penalty or 0.0),
        frequency_penalty=float(req.frequency_penalty or 0.0),
        stop_token_ids=stop_ids,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )
    try:
        params.validate(engine.engine.model_config.vocab_size)
    except ValueError as exc:
        raise APIError(400, str(exc), param=str(exc).split(" ", 1)[0], code="invalid_value") from None
    return params


def _plan_chat(req: ChatCompletionRequest, tokenizer: Tokenizer, engine: AsyncEngine) -> _Plan:
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs", code="invalid_value")
    if req.tool_choice not in (None, "none", "auto"):
        raise APIError(400, "this engine renders tools into the prompt but does not force tool calls; "
                            "tool_choice must be 'auto' or 'none'", param="tool_choice", code="invalid_value")
    messages = [m.template_dict() for m in req.messages]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                             tools=req.tools, **(req.chat_template_kwargs or {}))
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param="messages", code="invalid_value") from None
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise APIError(400, "the rendered conversation is empty", param="messages", code="empty_prompt")
    max_tokens = req.max_output_tokens
    if max_tokens is None:
        max_tokens = engine.max_request_tokens - len(ids)  # all the room left (max_request_tokens <= context)
        if max_tokens < 1:
            raise APIError(400, f"the messages have {len(ids)} tokens, which leaves no room to answer within "
                                f"this model's context length of {engine.max_model_len} tokens",
                           param="messages", code="context_length_exceeded")
    err = _too_long(len(ids), max_tokens, engine, "messages")
    if err:
        raise err
    top = int(req.top_logprobs or 0)
    params = _sampling_params(req, max_tokens, tokenizer, engine, req.logprobs, top)
    return _Plan("chat", f"chatcmpl-{uuid.uuid4().hex}", [_PromptJob(ids, params, [])], req.n, req.stop_list,
                 req.logprobs, top, req.stream, req.include_usage)


def _plan_completion(req: CompletionRequest, tokenizer: Tokenizer, engine: AsyncEngine) -> _Plan:
    if req.suffix:
        raise APIError(400, "suffix is not supported by this engine", param="suffix", code="invalid_value")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of other than n is not supported by this engine", param="best_of",
                       code="invalid_value")
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo together with logprobs is not supported (prompt logprobs are not computed)",
                       param="echo", code="invalid_value")
    prompts = req.prompts()
    if not prompts:
        raise APIError(400, "prompt is empty", param="prompt", code="empty_prompt")
    vocab = engine.engine.model_config.vocab_size
    max_tokens = req.max_output_tokens if req.max_output_tokens is not None else 16
    logprobs = req.logprobs is not None
    top = int(req.logprobs or 0)
    params = _sampling_params(req, max_tokens, tokenizer, engine, logprobs, top)
    jobs = []
    for i, prompt in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt.{i}"
        if isinstance(prompt, str):
            if prompt == "":
                raise APIError(400, "prompt is empty", param=param, code="empty_prompt")
            ids = tokenizer.encode(prompt)
            echo_text = prompt
        else:
            ids = list(prompt)
            if not ids:
                raise APIError(400, "prompt is empty", param=param, code="empty_prompt")
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise APIError(400, f"prompt holds token id {bad}, outside this model's vocabulary of {vocab}",
                               param=param, code="invalid_value")
            echo_text = tokenizer.decode(ids) if req.echo else ""
        err = _too_long(len(ids), max_tokens, engine, param)
        if err:
            raise err
        jobs.append(_PromptJob(ids, params, ids, echo_text if req.echo else ""))
    return _Plan("completion", f"cmpl-{uuid.uuid4().hex}", jobs, req.n, req.stop_list, logprobs, top,
                 req.stream, req.include_usage)


# ---------------------------------------------------------------------------------------------- generation
@dataclass(slots=True)
class _Choice:
    index: int
    job: _PromptJob
    stream: TextStream
    request_id: str
    num_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    device_seconds: float = 0.0
    finish_reason: str | None = None
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    t_first: float | None = None
    t_last: float | None = None


@dataclass(slots=True)
class _Event:
    choice: _Choice
    text: str
    logprobs: list[tuple[int, float, list[tuple[int, float]]]]
    finish_reason: str | None


class _Generation:
    """Runs every sequence of one request as tasks and merges their events into one queue."""

    def __init__(self, state: ServerState, engine: AsyncEngine, tokenizer: Tokenizer, plan: _Plan,
                 admission: Admission, t_arrival: float) -> None:
        self.state = state
        self.engine = engine
        self.plan = plan
        self.admission = admission
        self.choices: list[_Choice] = []
        for p, job in enumerate(plan.jobs):
            for j in range(plan.n):
                params = job.params
                if params.seed is not None and plan.n > 1:
                    # Distinct but reproducible streams per choice.
                    params = _replace_seed(params, (params.seed + j) % (2**63))
                    job_j = _PromptJob(job.ids, params, job.context_ids, job.echo_text)
                else:
                    job_j = job
                self.choices.append(_Choice(
                    index=p * plan.n + j, job=job_j,
                    stream=TextStream(tokenizer, plan.stop, context_ids=job.context_ids),
                    request_id=f"{plan.request_id}-{p}-{j}"))
        self.events: asyncio.Queue[_Event | BaseException | None] = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []
        self.outcome: str | None = None  # "success" | "error" | "aborted" once the response is decided
        self.t_start = t_arrival
        self.t_first_token: float | None = None

    def start(self) -> None:
        share = self.engine.engine.config.enable_prefix_caching
        block = self.engine.engine.config.block_size
        for p in range(len(self.plan.jobs)):
            group = self.choices[p * self.plan.n:(p + 1) * self.plan.n]
            gate: asyncio.Event | None = None
            if len(group) > 1 and share and len(group[0].job.ids) >= block:
                gate = asyncio.Event()
            for k, choice in enumerate(group):
                opens = gate if k == 0 else None
                waits = gate if k > 0 else None
                self.tasks.append(asyncio.create_task(self._run(choice, opens, waits)))

    def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.admission.release()

    async def _run(self, choice: _Choice, opens: asyncio.Event | None, waits: asyncio.Event | None) -> None:
        try:
            if waits is not None:
                await waits.wait()
            stream = self.engine.generate(choice.request_id, choice.job.ids, choice.job.params,
                                          admission=self.admission)
            async with contextlib.aclosing(stream) as outputs:  # type: ignore[type-var]
                async for out in outputs:
                    if opens is not None:
                        opens.set()
                    event = self._consume(choice, out)
                    if event is not None:
                        self.events.put_nowait(event)
                    if choice.finish_reason is not None:
                        break
        except Exception as exc:  # noqa: BLE001 - reported to the request's consumer
            self.events.put_nowait(exc)
        finally:
            if opens is not None:
                opens.set()
            self.events.put_nowait(None)

    def _consume(self, choice: _Choice, out: StepOutput) -> _Event | None:
        now = time.monotonic()
        tokens = out.new_token_ids
        choice.num_prompt_tokens = out.num_prompt_tokens
        choice.num_cached_tokens = out.num_cached_tokens
        choice.device_seconds = out.device_seconds
        if tokens:
            choice.num_tokens += len(tokens)
            if choice.t_first is None:
                choice.t_first = now
                if self.t_first_token is None:
                    self.t_first_token = now
            choice.t_last = now
        # The token that ended the request with "stop" is EOS or a stop token id: counted, not rendered.
        text_tokens = tokens[:-1] if out.finished and out.finish_reason == "stop" else tokens
        text = choice.stream.push(text_tokens)
        finish = None
        if choice.stream.stopped:
            finish = "stop"
        elif out.finished:
            if out.finish_reason == "abort":
                raise EngineDeadError("the request was aborted inside the engine")
            text += choice.stream.finish()
            finish = "stop" if choice.stream.stopped else out.finish_reason
        lps: list[tuple[int, float, list[tuple[int, float]]]] = []
        if self.plan.logprobs and out.logprobs:
            lps = [(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs]
            choice.logprobs.extend(lps)
        if text:
            choice.text_parts.append(text)
        if finish is not None:
            choice.finish_reason = finish
        if not text and not lps and finish is None:
            return None
        return _Event(choice, text, lps, finish)

    async def iterate(self) -> AsyncIterator[_Event]:
        """Yield events until every sequence is done; re-raise the first failure."""
        remaining = len(self.tasks)
        try:
            while remaining:
                item = await self.events.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            self.admission.release()

    # ---------------------------------------------------------------- summaries
    def usage(self) -> dict[str, Any]:
        prompt = sum(len(job.ids) for job in self.plan.jobs)
        cached = sum(self.choices[p * self.plan.n].num_cached_tokens for p in range(len(self.plan.jobs)))
        completion = sum(c.num_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def extension(self) -> dict[str, float]:
        return {"device_seconds": round(sum(c.device_seconds for c in self.choices), 6),
                "utilisation": round(self.engine.utilisation(), 6)}

    def observe(self, metrics: EngineMetrics) -> None:
        now = time.monotonic()
        if self.t_first_token is not None:
            metrics.ttft.observe(self.t_first_token - self.t_start)
        for c in self.choices:
            if c.t_first is not None and c.t_last is not None and c.num_tokens > 1:
                metrics.tpot.observe((c.t_last - c.t_first) / (c.num_tokens - 1))
        metrics.e2e.observe(now - self.t_start)
        metrics.prompt_tokens.inc(sum(len(job.ids) for job in self.plan.jobs))
        metrics.generation_tokens.inc(sum(c.num_tokens for c in self.choices))


def _replace_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return dataclasses.replace(params, seed=seed, stop_token_ids=list(params.stop_token_ids))


# ---------------------------------------------------------------------------------------------- formatting
def _clamp(lp: float) -> float:
    return lp if math.isfinite(lp) and lp > _MIN_LOGPROB else _MIN_LOGPROB


def _chat_logprobs(state: ServerState, entries) -> dict[str, Any]:
    content = []
    for token_id, lp, top in entries:
        text, raw = state.token_text(token_id)
        tops = []
        for tid, tlp in top:
            ttext, traw = state.token_text(tid)
            tops.append({"token": ttext, "logprob": _clamp(tlp), "bytes": traw})
        content.append({"token": text, "logprob": _clamp(lp), "bytes": raw, "top_logprobs": tops})
    return {"content": content}


def _completion_logprobs(state: ServerState, entries, offset: int) -> tuple[dict[str, Any], int]:
    tokens, token_lps, tops, offsets = [], [], [], []
    for token_id, lp, top in entries:
        text, _ = state.token_text(token_id)
        tokens.append(text)
        token_lps.append(_clamp(lp))
        tops.append({state.token_text(tid)[0]: _clamp(tlp) for tid, tlp in top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset


def _final_body(state: ServerState, gen: _Generation) -> dict[str, Any]:
    plan = gen.plan
    choices = []
    for c in gen.choices:
        text = "".join(c.text_parts)
        lp = None
        if plan.kind == "chat":
            if plan.logprobs:
                lp = _chat_logprobs(state, c.logprobs)
            choices.append({"index": c.index, "message": {"role": "assistant", "content": text},
                            "logprobs": lp, "finish_reason": c.finish_reason})
        else:
            if plan.logprobs:
                lp, _ = _completion_logprobs(state, c.logprobs, len(c.job.echo_text))
            choices.append({"index": c.index, "text": c.job.echo_text + text, "logprobs": lp,
                            "finish_reason": c.finish_reason})
    return {
        "id": plan.request_id,
        "object": "chat.completion" if plan.kind == "chat" else "text_completion",
        "created": int(time.time()),
        "model": state.model_name,
        "choices": choices,
        "usage": gen.usage(),
        "switchyard": gen.extension(),
    }


class _ChunkWriter:
    """Formats SSE chunks for one streamed request."""

    def __init__(self, state: ServerState, gen: _Generation) -> None:
        self.state = state
        self.gen = gen
        self.plan = gen.plan
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if self.plan.kind == "chat" else "text_completion"
        self.offsets = {c.index: len(c.job.echo_text) for c in gen.choices}

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        body: dict[str, Any] = {"id": self.plan.request_id, "object": self.object, "created": self.created,
                                "model": self.state.model_name, "choices": choices}
        if self.plan.include_usage:
            body["usage"] = None
        body.update(extra)
        return f"data: {_dumps(body)}\n\n"

    def opening(self) -> list[str]:
        if self.plan.kind == "chat":
            return [self.chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}]) for c in self.gen.choices]
        return [self.chunk([{"index": c.index, "text": c.job.echo_text, "logprobs": None, "finish_reason": None}])
                for c in self.gen.choices if c.job.echo_text]

    def event(self, ev: _Event, last: bool) -> list[str]:
        out = []
        c = ev.choice
        if ev.text or ev.logprobs:
            if self.plan.kind == "chat":
                lp = _chat_logprobs(self.state, ev.logprobs) if self.plan.logprobs else None
                out.append(self.chunk([{"index": c.index, "delta": {"content": ev.text}, "logprobs": lp,
                                        "finish_reason": None}]))
            else:
                lp = None
                if self.plan.logprobs:
                    lp, self.offsets[c.index] = _completion_logprobs(self.state, ev.logprobs, self.offsets[c.index])
                out.append(self.chunk([{"index": c.index, "text": ev.text, "logprobs": lp, "finish_reason": None}]))
        if ev.finish_reason is not None:
            extra = {"switchyard": self.gen.extension()} if last and not self.plan.include_usage else {}
            if self.plan.kind == "chat":
                choice = {"index": c.index, "delta": {}, "logprobs": None, "finish_reason": ev.finish_reason}
            else:
                choice = {"index": c.index, "text": "", "logprobs": None, "finish_reason": ev.finish_reason}
            out.append(self.chunk([choice], **extra))
        return out

    def closing(self) -> list[str]:
        out = []
        if self.plan.include_usage:
            body = {"id": self.plan.request_id, "object": self.object, "created": self.created,
                    "model": self.state.model_name, "choices": [], "usage": self.gen.usage(),
                    "switchyard": self.gen.extension()}
            out.append(f"data: {_dumps(body)}\n\n")
        out.append("data: [DONE]\n\n")
        return out


# ---------------------------------------------------------------------------------------------- handlers
class _EventStream(StreamingResponse):
    """SSE response that calls `on_end` however the response ends (done, failed, client gone)."""

    def __init__(self, content: AsyncIterator[str], on_end: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_end = on_end

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_end()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def build_app(state: ServerState, loader: Callable[[], tuple[AsyncEngine, Tokenizer]] | None = None,
              on_ready: Callable[[ServerState], None] | None = None,
              on_load_error: Callable[[BaseException], None] | None = None) -> Starlette:
    """The ASGI app. With `loader`, the model loads in a thread after startup (health answers 503 until
    then); without it, `state.engine` and `state.tokenizer` must be set already."""

    async def health(request: Request) -> Response:
        if state.engine is not None and state.engine.alive and state.tokenizer is not None:
            return JSONResponse({"status": "ok", "model": state.model_name})
        if state.load_error:
            return JSONResponse({"status": "error", "error": state.load_error}, status_code=503)
        if state.engine is not None and not state.engine.alive:
            return JSONResponse({"status": "error", "error": str(state.engine.dead or "shut down")},
                                status_code=503)
        return JSONResponse({"status": "loading"}, status_code=503)

    async def metrics(request: Request) -> Response:
        return Response(state.metrics.render(state.engine), media_type=state.metrics.content_type)

    async def models(request: Request) -> Response:
        data = [{"id": state.model_name, "object": "model", "created": state.created, "owned_by": "switchyard",
                 "max_model_len": state.engine.max_model_len if state.engine else None}]
        return JSONResponse({"object": "list", "data": data})

    async def chat(request: Request) -> Response:
        return await _serve(request, "chat")

    async def completions(request: Request) -> Response:
        return await _serve(request, "completion")

    async def _serve(request: Request, kind: str) -> Response:
        t_arrival = time.monotonic()
        try:
            engine, tokenizer = state.ready()
            try:
                payload = json.loads(await request.body())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise APIError(400, f"the request body is not valid JSON: {exc}") from None
            model_cls = ChatCompletionRequest if kind == "chat" else CompletionRequest
            req = parse_request(model_cls, payload)
            if req.model != state.model_name:
                raise APIError(404, f"the model {req.model!r} does not exist; this server serves "
                                    f"{state.model_name!r}", param="model", code="model_not_found")
            plan = (_plan_chat if kind == "chat" else _plan_completion)(req, tokenizer, engine)
            try:
                admission = engine.admit(len(plan.jobs) * plan.n)
            except EngineOverloaded as exc:
                raise APIError(429, str(exc), type="rate_limit_error", code="engine_overloaded",
                               headers={"Retry-After": str(math.ceil(exc.retry_after))}) from None
        except APIError as err:
            state.metrics.observe_request(_status_label(err.status))
            return _error_response(err)

        gen = _Generation(state, engine, tokenizer, plan, admission, t_arrival)
        if plan.stream:
            return _EventStream(_stream(gen), on_end=lambda: _end_stream(gen))
        return await _complete(request, gen)

    def _end_stream(gen: _Generation) -> None:
        # Runs whenever the response ends, even if the body iterator never started (client gone at once).
        if gen.outcome is None:
            gen.outcome = "aborted"
            gen.cancel()  # abort every sequence and give back queue places (synchronous: safe when cancelled)
            state.metrics.observe_request("aborted")

    async def _complete(request: Request, gen: _Generation) -> Response:
        gen.start()

        async def drain() -> None:
            async for _ in gen.iterate():
                pass

        work = asyncio.create_task(drain())
        watcher = asyncio.create_task(_wait_for_disconnect(request))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not work.done():
                work.cancel()
                gen.cancel()
        if not work.done() or work.cancelled():
            state.metrics.observe_request("aborted")
            return Response(status_code=499)  # the client is gone; nobody reads this
        exc = work.exception()
        if exc is not None:
            gen.cancel()
            return _failure(exc)
        state.metrics.observe_request("success")
        gen.observe(state.metrics)
        return Response(_dumps(_final_body(state, gen)), media_type="application/json")

    def _failure(exc: BaseException) -> JSONResponse:
        if isinstance(exc, ValueError):  # the engine refused the request
            state.metrics.observe_request("invalid")
            return _error_response(APIError(400, str(exc), code="invalid_value"))
        state.metrics.observe_request("error")
        log.error("request failed: %r", exc)
        if isinstance(exc, EngineDeadError):
            return _error_response(APIError(503, str(exc), type="service_unavailable", code="engine_down"))
        return _error_response(APIError(500, f"internal error: {exc!r}", type="server_error"))

    async def _stream(gen: _Generation) -> AsyncIterator[str]:
        writer = _ChunkWriter(state, gen)
        gen.start()
        for chunk in writer.opening():
            yield chunk
        finished = 0
        total = len(gen.choices)
        try:
            async for ev in gen.iterate():
                if ev.finish_reason is not None:
                    finished += 1
                for chunk in writer.event(ev, last=finished == total):
                    yield chunk
        except (ValueError, EngineDeadError, RuntimeError) as exc:
            gen.outcome = "error"
            gen.cancel()
            err = _failure(exc)
            yield f"data: {err.body.decode()}\n\n"
            yield "data: [DONE]\n\n"
            return
        for chunk in writer.closing():
            yield chunk
        gen.outcome = "success"
        state.metrics.observe_request("success")
        gen.observe(state.metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        load_task = None
        if loader is not None:
            async def load() -> None:
                try:
                    engine, tokenizer = await asyncio.to_thread(loader)
                except BaseException as exc:  # noqa: BLE001 - reported through health and the CLI
                    state.load_error = f"{type(exc).__name__}: {exc}"
                    log.error("model load failed: %s", state.load_error)
                    if on_load_error is not None:
                        on_load_error(exc)
                    return
                engine.start()
                state.engine, state.tokenizer = engine, tokenizer
                if on_ready is not None:
                    on_ready(state)

            load_task = asyncio.create_task(load())
        elif state.engine is not None:
            state.engine.start()
        try:
            yield
        finally:
            if load_task is not None and not load_task.done():
                load_task.cancel()
            if state.engine is not None:
                await state.engine.shutdown()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


# ---------------------------------------------------------------------------------------------- CLI
def load_model(args: argparse.Namespace) -> tuple[AsyncEngine, Tokenizer]:
    """Build the tokenizer and engine from `switchyard engine serve` arguments."""
    from hosted.engine import EngineConfig, LLMEngine

    tokenizer = Tokenizer.from_dir(args.model)
    config = EngineConfig(model_dir=args.model, dtype=args.dtype, device=args.device,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          kv_cache_gb=args.kv_cache_gb, num_kv_blocks=getattr(args, "num_kv_blocks", None),
                          block_size=args.block_size, enable_prefix_caching=not args.no_prefix_caching,
                          max_model_len=getattr(args, "max_model_len", None),
                          quantization=getattr(args, "quantization", None),
                          quantization_group_size=getattr(args, "quantization_group_size", 128))
    engine = AsyncEngine(LLMEngine(config), max_waiting=args.max_waiting)
    return engine, tokenizer


def cli_serve(args: argparse.Namespace) -> int:
    """`switchyard engine serve`: bind, load the model in the background (health 503 until ready), print a
    ready line, serve until SIGINT/SIGTERM, then stop cleanly."""
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model_dir = Path(args.model)
    if not model_dir.is_dir():
        print(f"error: --model {args.model!r} is not a directory", file=sys.stderr)
        return 2
    name = args.served_model_name or model_dir.resolve().name
    state = ServerState(model_name=name)
    exit_code = {"value": 0}
    server_box: dict[str, uvicorn.Server] = {}

    def ready(st: ServerState) -> None:
        assert st.engine is not None
        s = st.engine.stats()
        print(f"switchyard engine ready: model={name} url=http://{args.host}:{args.port}/v1 "
              f"device={st.engine.engine.device} dtype={args.dtype} max_model_len={st.engine.max_model_len} "
              f"kv_blocks={s.kv_blocks_total}x{args.block_size}", flush=True)

    def failed(exc: BaseException) -> None:
        print(f"error: cannot serve {args.model!r}: {exc}", file=sys.stderr, flush=True)
        exit_code["value"] = 1
        server = server_box.get("server")
        if server is not None:
            server.should_exit = True

    app = build_app(state, loader=lambda: load_model(args), on_ready=ready, on_load_error=failed)
    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # uvicorn re-raises a caught SIGTERM/SIGINT after its graceful shutdown, so the process would die
            # by the signal; a clean shutdown should exit 0 instead. A second SIGINT still forces exit.
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                            access_log=False, timeout_graceful_shutdown=10, lifespan="on")
    server = _Server(config)
    server_box["server"] = server
    server.run()
    if exit_code["value"] == 0:
        print("switchyard engine stopped", flush=True)
    return exit_code["value"]
