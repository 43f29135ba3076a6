"""A stand-in SGLang server for the tests: SGLang needs CUDA and cannot serve on the CPU machines the tests run on.

It speaks what the gateway reads from a real one: OpenAI chat completions (plain and streamed, usage on the last
chunk) and Prometheus /metrics under SGLang's names (sglang 0.5.23: `sglang:forward_execution_seconds_total` by
category, `sglang:num_running_reqs`, `sglang:e2e_request_latency_seconds`, `sglang:queue_time_seconds`, token
counters), rendered by prometheus_client as SGLang's own are. Behind them, a small continuous-batching loop:
every step takes `step_s` of "forward pass" and gives each running request one token, so its busy time (the
forward-execution counter) is the truth the gateway's attribution is checked against.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import uvicorn
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

LABELS = {"model_name": "stand-in", "engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}


@dataclass
class _Req:
    tokens_left: int
    arrived: float
    done: asyncio.Event = field(default_factory=asyncio.Event)
    produced: int = 0
    queue_s: float = 0.0
    tokens: asyncio.Queue = field(default_factory=asyncio.Queue)


class StandinSGLang:
    def __init__(self, step_s: float = 0.02, metrics: bool = True) -> None:
        self.step_s = step_s
        self.metrics = metrics  # False: /metrics answers 404, as SGLang started without --enable-metrics
        self.busy_s = 0.0  # the truth: wall time spent in forward steps
        self.registry = r = CollectorRegistry()
        names = list(LABELS)
        self.forward = Counter("sglang:forward_execution_seconds", "Total time that GPU is busy executing model "
                               "forward passes.", [*names, "category"], registry=r)
        self.running_gauge = Gauge("sglang:num_running_reqs", "The number of running requests.", names, registry=r)
        self.queue_gauge = Gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", names,
                                 registry=r)
        self.usage_gauge = Gauge("sglang:token_usage", "The token usage.", names, registry=r)
        self.prompt = Counter("sglang:prompt_tokens", "Number of prefill tokens processed.", names, registry=r)
        self.generation = Counter("sglang:generation_tokens", "Number of generation tokens processed.", names,
                                  registry=r)
        self.cached = Counter("sglang:cached_tokens", "Number of cached prompt tokens.", [*names, "cache_source"],
                              registry=r)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds", "End-to-end request latency.", names, registry=r)
        self.queue_time = Histogram("sglang:queue_time_seconds", "Queueing time.", names, registry=r)
        self.running: list[_Req] = []
        self.wake: asyncio.Event | None = None
        for g in (self.running_gauge, self.queue_gauge, self.usage_gauge):
            g.labels(**LABELS).set(0)

    async def loop(self) -> None:
        self.wake = asyncio.Event()
        while True:
            if not self.running:
                self.wake.clear()
                await self.wake.wait()
            started = time.monotonic()
            await asyncio.sleep(self.step_s)  # the forward pass
            spent = time.monotonic() - started
            self.busy_s += spent
            self.forward.labels(**LABELS, category="decode").inc(spent)
            for req in list(self.running):
                req.produced += 1
                req.tokens_left -= 1
                self.generation.labels(**LABELS).inc()
                req.tokens.put_nowait(req.produced)
                if req.tokens_left <= 0:
                    self.running.remove(req)
                    self.e2e.labels(**LABELS).observe(time.monotonic() - req.arrived)
                    self.queue_time.labels(**LABELS).observe(req.queue_s)
                    req.tokens.put_nowait(None)
            self.running_gauge.labels(**LABELS).set(len(self.running))

    def admit(self, prompt_tokens: int, max_tokens: int) -> _Req:
        req = _Req(tokens_left=max_tokens, arrived=time.monotonic())
        self.prompt.labels(**LABELS).inc(prompt_tokens)
        self.running.append(req)
        self.running_gauge.labels(**LABELS).set(len(self.running))
        assert self.wake is not None
        self.wake.set()
        return req

    def app(self) -> Starlette:
        async def metrics(_: Request) -> Response:
            if not self.metrics:
                return Response(b"Not Found", status_code=404)
            return Response(generate_latest(self.registry), media_type="text/plain; version=0.0.4")

        async def models(_: Request) -> Response:
            return JSONResponse({"object": "list", "data": [{"id": "stand-in", "object": "model"}]})

        async def chat(request: Request) -> Response:
            body = await request.json()
            prompt = sum(len(str(m.get("content", "")).split()) for m in body["messages"])
            wanted = int(body.get("max_tokens") or 16)
            req = self.admit(prompt, wanted)
            usage = {"prompt_tokens": prompt, "completion_tokens": wanted, "total_tokens": prompt + wanted}
            base = {"id": "chatcmpl-standin", "created": int(time.time()), "model": "stand-in"}
            if not body.get("stream"):
                while await req.tokens.get() is not None:
                    pass
                return JSONResponse({**base, "object": "chat.completion", "usage": usage, "choices": [
                    {"index": 0, "finish_reason": "length",
                     "message": {"role": "assistant", "content": " ".join(["tok"] * wanted)}}]})

            async def events():
                while (n := await req.tokens.get()) is not None:
                    chunk = {**base, "object": "chat.completion.chunk", "choices": [
                        {"index": 0, "delta": {"content": "tok " if n else ""}, "finish_reason": None}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                yield f"data: {json.dumps({**base, 'object': 'chat.completion.chunk', 'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        @contextlib.asynccontextmanager
        async def lifespan(_: Starlette):
            task = asyncio.create_task(self.loop())
            yield
            task.cancel()

        return Starlette(routes=[Route("/metrics", metrics), Route("/v1/models", models),
                                 Route("/v1/chat/completions", chat, methods=["POST"])], lifespan=lifespan)


@contextmanager
def run_sglang_standin(port: int, step_s: float = 0.02, metrics: bool = True) -> Iterator[StandinSGLang]:
    standin = StandinSGLang(step_s, metrics)
    server = uvicorn.Server(uvicorn.Config(standin.app(), host="127.0.0.1", port=port, log_level="warning",
                                           access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("the SGLang stand-in did not start")
        time.sleep(0.02)
    try:
        yield standin
    finally:
        server.should_exit = True
        thread.join(timeout=10)
