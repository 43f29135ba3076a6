"""The engine's OpenAI-compatible HTTP server (Starlette): the routes and the lifespan that loads the model.

Routes: POST /v1/chat/completions, POST /v1/completions (plain and SSE), GET /v1/models, GET /health
(200 once the model is loaded, 503 before), GET /metrics (Prometheus text), GET /openapi.json
(hosted/openapi.py). Every response has an `x-request-id` (openai_wire/request_ids.py). Endpoints are module-level
functions reading `request.app.state.server` (a ServerState); a request is planned (request_plan), fanned
out into engine sequences (generation) and rendered (render). A client that disconnects aborts every
sequence of its request, freeing their blocks.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hosted import openapi
from hosted.async_llm_engine import Admission, AsyncLLMEngine, EngineDeadError, EngineOverloaded
from hosted.generation import Generation
from hosted.render import ChunkWriter, dumps, final_body
from hosted.request_plan import Plan, plan_request
from hosted.server_state import ServerState
from hosted.threads import in_fresh_thread
from hosted.tokenizer import Tokenizer
from openai_wire import SSE_DONE, APIError, ClientClosed, sse_event, until_disconnect
from openai_wire.engine_requests import EngineChatRequest, EngineCompletionRequest
from openai_wire.request_errors import parse
from openai_wire.request_ids import RequestIdMiddleware
from openai_wire.responses import EventStreamResponse, error_response

log = logging.getLogger("switchyard.engine.server")

_REQUEST_MODELS = {"chat": EngineChatRequest, "completion": EngineCompletionRequest}


@dataclass(slots=True)
class _Loading:
    """How the lifespan gets the model: `loader` runs in a thread; the callbacks report how it went."""

    loader: Callable[[], tuple[AsyncLLMEngine, Tokenizer]] | None
    on_ready: Callable[[ServerState], None] | None
    on_load_error: Callable[[BaseException], None] | None


def build_app(state: ServerState, loader: Callable[[], tuple[AsyncLLMEngine, Tokenizer]] | None = None,
              on_ready: Callable[[ServerState], None] | None = None,
              on_load_error: Callable[[BaseException], None] | None = None) -> Starlette:
    """The ASGI app. With `loader`, the model loads in a thread after startup (health answers 503 until
    then); without it, `state.engine` and `state.tokenizer` must be set already."""
    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/openapi.json", openapi.serve_document, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=_lifespan, middleware=[Middleware(RequestIdMiddleware)],
                    exception_handlers={APIError: _api_error})
    app.state.server = state
    app.state.loading = _Loading(loader, on_ready, on_load_error)
    return app


# ---------------------------------------------------------------------------------------------- lifespan
@contextlib.asynccontextmanager
async def _lifespan(app: Starlette):
    state: ServerState = app.state.server
    loading: _Loading = app.state.loading
    load_task = None
    if loading.loader is not None:
        load_task = asyncio.create_task(_load(state, loading))
    elif state.engine is not None:
        state.engine.start()
    try:
        yield
    finally:
        if load_task is not None and not load_task.done():
            load_task.cancel()
        if state.engine is not None:
            await state.engine.shutdown()


async def _load(state: ServerState, loading: _Loading) -> None:
    assert loading.loader is not None
    try:
        engine, tokenizer = await in_fresh_thread(loading.loader, "switchyard-load")  # (hosted/threads.py)
    except BaseException as exc:  # noqa: BLE001 - reported through health and the CLI
        state.load_error = f"{type(exc).__name__}: {exc}"
        log.error("model load failed: %s", state.load_error)
        if loading.on_load_error is not None:
            loading.on_load_error(exc)
        return
    # What is loaded now lives as long as the server: frozen, the collections that the per-token garbage triggers
    # stop walking it (4-5% of a batch-1 int8 decode loop's CPU samples were the collector's, none after).
    gc.collect()
    gc.freeze()
    engine.start()
    state.engine, state.tokenizer = engine, tokenizer
    if loading.on_ready is not None:
        loading.on_ready(state)


# ---------------------------------------------------------------------------------------------- endpoints
async def health(request: Request) -> Response:
    state: ServerState = request.app.state.server
    if state.engine is not None and state.engine.alive and state.tokenizer is not None:
        body = {"status": "ok", "model": state.model_name}
        if state.precision is not None:
            body["precision"] = state.precision.as_dict()
        return JSONResponse(body)
    if state.load_error:
        return JSONResponse({"status": "error", "error": state.load_error}, status_code=503)
    if state.engine is not None and not state.engine.alive:
        return JSONResponse({"status": "error", "error": str(state.engine.dead or "shut down")}, status_code=503)
    return JSONResponse({"status": "loading"}, status_code=503)


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.server
    return Response(state.metrics.render(state.engine), media_type=state.metrics.content_type)


async def models(request: Request) -> Response:
    state: ServerState = request.app.state.server
    data = [{"id": state.model_name, "object": "model", "created": state.created, "owned_by": "switchyard",
             "max_model_len": state.engine.max_model_len if state.engine else None}]
    return JSONResponse({"object": "list", "data": data})


async def chat_completions(request: Request) -> Response:
    return await _serve(request, "chat")


async def completions(request: Request) -> Response:
    return await _serve(request, "completion")


# ---------------------------------------------------------------------------------------------- one request
async def _serve(request: Request, kind: str) -> Response:
    state: ServerState = request.app.state.server
    t_arrival = time.monotonic()
    engine, tokenizer = state.ready()  # an APIError from here on: the app's handler (_api_error) answers it
    plan = await _plan(request, kind, state, tokenizer, engine)
    admission = _admit(engine, plan)
    gen = Generation(engine, tokenizer, plan, admission, t_arrival)
    if plan.stream:
        return EventStreamResponse(_stream(state, gen), on_end=functools.partial(_end_stream, state, gen))
    return await _complete(request, state, gen)


async def _plan(request: Request, kind: str, state: ServerState, tokenizer: Tokenizer,
                engine: AsyncLLMEngine) -> Plan:
    # Parsing, the chat template, tokenizing and compiling a grammar run on a worker thread: a huge or costly
    # request never stalls the event loop (other requests, /metrics). Over-long prompts are refused there,
    # before anything is queued (request_plan.check_text_size bounds them before they are even tokenized).
    body = await request.body()
    return await asyncio.to_thread(_plan_body, body, kind, state, tokenizer, engine)


def _plan_body(body: bytes, kind: str, state: ServerState, tokenizer: Tokenizer, engine: AsyncLLMEngine) -> Plan:
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    req = parse(_REQUEST_MODELS[kind], payload)
    if req.model != state.model_name:
        raise APIError(404, f"the model {req.model!r} does not exist; this server serves {state.model_name!r}",
                       param="model", code="model_not_found")
    return plan_request(kind, req, tokenizer, engine)


def _admit(engine: AsyncLLMEngine, plan: Plan) -> Admission:
    try:
        return engine.admit(len(plan.jobs) * plan.n)
    except EngineOverloaded as exc:
        raise APIError(429, str(exc), type="rate_limit_error", code="engine_overloaded",
                       headers={"Retry-After": str(math.ceil(exc.retry_after))}) from None


async def _api_error(request: Request, exc: Exception) -> Response:
    """The one place an APIError becomes a response (the app's exception handler); a refused completion request
    is counted by its status."""
    assert isinstance(exc, APIError)
    if request.url.path in _COUNTED:
        request.app.state.server.metrics.observe_request(_status_label(exc.status))
    return error_response(exc)


_COUNTED = frozenset({"/v1/chat/completions", "/v1/completions"})


def _status_label(status: int) -> str:
    return {400: "invalid", 404: "not_found", 429: "overloaded"}.get(status, "error")


async def _complete(request: Request, state: ServerState, gen: Generation) -> Response:
    gen.start()
    try:
        await until_disconnect(request.receive, gen.drain())
    except ClientClosed:
        gen.cancel()
        state.metrics.observe_request("aborted")
        return Response(status_code=499)  # the client is gone; nobody reads this
    except asyncio.CancelledError:
        gen.cancel()
        raise
    except Exception as exc:  # noqa: BLE001 - answered as an OpenAI error body
        gen.cancel()
        return _failure(state, exc)
    state.metrics.observe_request("success")
    gen.observe(state.metrics)
    return Response(dumps(final_body(state, gen)), media_type="application/json")


async def _stream(state: ServerState, gen: Generation) -> AsyncIterator[bytes]:
    writer = ChunkWriter(state, gen)
    gen.start()
    for chunk in writer.opening():
        yield chunk
    finished = 0
    total = len(gen.choices)
    try:
        # Closed with this body (a client gone mid-stream): a one-sequence generation's engine stream ends with it.
        async with contextlib.aclosing(gen.iterate()) as events:  # type: ignore[type-var]
            async for ev in events:
                if ev.finish_reason is not None:
                    finished += 1
                for chunk in writer.event(ev, last=finished == total):
                    yield chunk
    except (ValueError, EngineDeadError, RuntimeError) as exc:
        gen.outcome = "error"
        gen.cancel()
        yield sse_event(_failure(state, exc).body)
        yield SSE_DONE
        return
    for chunk in writer.closing():
        yield chunk
    gen.outcome = "success"
    state.metrics.observe_request("success")
    gen.observe(state.metrics)


def _end_stream(state: ServerState, gen: Generation) -> None:
    # Runs whenever the response ends, even if the body iterator never started (client gone at once).
    if gen.outcome is None:
        gen.outcome = "aborted"
        gen.cancel()  # abort every sequence and give back queue places (synchronous: safe when cancelled)
        state.metrics.observe_request("aborted")


def _failure(state: ServerState, exc: BaseException) -> JSONResponse:
    if isinstance(exc, ValueError):  # the engine refused the request
        state.metrics.observe_request("invalid")
        return error_response(APIError(400, str(exc), code="invalid_value"))
    state.metrics.observe_request("error")
    log.error("request failed: %r", exc)
    if isinstance(exc, EngineDeadError):
        return error_response(APIError(503, str(exc), type="service_unavailable", code="engine_down"))
    return error_response(APIError(500, f"internal error: {exc!r}", type="server_error"))
