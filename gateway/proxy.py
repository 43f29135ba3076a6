"""One OpenAI request end to end: admission, dispatch with fallbacks, streaming relay, accounting."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import anyio
import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from gateway import admission, errors, metrics, pricing
from gateway.backends.base import Completion, UpstreamError, Usage, usage_from_chunk
from gateway.backends.resilience import complete_with_fallbacks, open_stream_with_fallbacks
from gateway.budgets import Reservation
from gateway.keys import KeyInfo
from gateway.ledger.record import LedgerRecord
from gateway.policy import BackendSpec, Policy, RouteSpec
from gateway.routing import decide
from gateway.shadow import ShadowTicket, answer_text, without_reference

if TYPE_CHECKING:
    from gateway.app import Gateway

log = logging.getLogger("switchyard.proxy")

ENDPOINT_NAMES = {"chat": "chat.completions", "completions": "completions"}


class ClientClosed(Exception):
    """The client went away before the response was complete."""


@dataclass(slots=True)
class Call:
    """Everything known about one admitted request while it is being served."""

    record: LedgerRecord
    key: KeyInfo
    policy: Policy
    route: RouteSpec
    body: dict
    endpoint: str
    reservation: Reservation | None
    started: float
    chunks_with_content: int = 0
    completion_parts: list[str] = field(default_factory=list)
    shadow: ShadowTicket | None = None  # sampled for shadow evaluation (gateway/shadow.py)


async def handle(gw: Gateway, request: Request, endpoint: str) -> Response:
    started = time.perf_counter()
    request_id = "req_" + uuid.uuid4().hex
    try:
        key = await gw.auth.authenticate(request.headers.get("authorization"))
    except errors.APIError as exc:
        metrics.AUTH_FAILURES.inc()
        return exc.response()
    record = LedgerRecord(request_id=request_id, created_at=datetime.now(UTC), api_key_id=key.id, team=key.team,
                          endpoint=ENDPOINT_NAMES[endpoint])
    metrics.IN_FLIGHT.inc()
    try:
        call = await _admit(gw, request, endpoint, record, key, started)
    except errors.APIError as exc:
        metrics.IN_FLIGHT.dec()
        _log_rejection(gw, record, exc, started)
        return _with_id(exc.response(), request_id)
    if call.body.get("stream"):
        return await _stream(gw, request, call)  # IN_FLIGHT is decremented when the stream ends
    try:
        return await _complete(gw, request, call)
    except Exception:  # a bug must not leak the budget reservation or lose the ledger row
        log.exception("internal error serving %s", request_id)
        _finish(gw, call, None, None, status="error", error_type="internal", http_status=500)
        return _with_id(errors.APIError(500, "Internal gateway error; see the gateway log.", type="api_error",
                                        code="internal_error").response(), request_id)
    finally:
        metrics.IN_FLIGHT.dec()


async def _admit(gw: Gateway, request: Request, endpoint: str, record: LedgerRecord, key: KeyInfo,
                 started: float) -> Call:
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError as exc:
        raise errors.invalid_request(f"The request body is not valid JSON: {exc}.") from None
    body = admission.validate(body, endpoint)
    policy = gw.policy_store.current
    record.requested_model = body["model"]
    record.policy_version = policy.version
    record.stream = bool(body.get("stream"))
    route = policy.routes.get(body["model"])
    if route is None:
        raise errors.model_not_found(body["model"], list(policy.routes))
    record.route = route.name
    decision = decide(route, body, gw)
    record.route_reason, record.difficulty, record.threshold = decision.reason, decision.difficulty, decision.threshold
    body["_switchyard_chain"] = decision.chain
    prompt_tokens = admission.estimate_prompt_tokens(body, endpoint)
    gw.limiter.admit(key, prompt_tokens)
    specs = [policy.backends[name] for name in decision.chain]
    estimate = pricing.max_cost_estimate(policy, specs, prompt_tokens, admission.max_tokens(body))
    try:
        reservation = await gw.budgets.reserve(key, estimate)
    except errors.APIError as exc:
        # --- routing (budget): a key that cannot afford the chain may still afford `easy` alone
        if not (route.budget_downgrade and exc.code == "insufficient_quota" and route.easy
                and decision.chain != [route.easy]):
            raise
        easy_estimate = pricing.max_cost_estimate(policy, [policy.backends[route.easy]], prompt_tokens,
                                                  admission.max_tokens(body))
        reservation = await gw.budgets.reserve(key, easy_estimate)  # raises the 429 if even that is too much
        decision.chain = body["_switchyard_chain"] = [route.easy]
        record.route_reason = "budget"
    if route.log_prompts:
        record.prompt_text = admission.prompt_text(body, endpoint)
    shadow = gw.routing.shadow.ticket(request_id=record.request_id, route=route, policy=policy, body=body,
                                      endpoint=endpoint, decision=decision) \
        if route.shadow is not None and gw.routing.shadow is not None else None
    return Call(record=record, key=key, policy=policy, route=route, body=body, endpoint=endpoint,
                reservation=reservation, started=started, shadow=shadow)


def _payload(call: Call) -> dict:
    payload = dict(call.body)
    payload.pop("_switchyard_chain", None)
    return without_reference(payload)


async def _complete(gw: Gateway, request: Request, call: Call) -> Response:
    chain = gw.pool.chain(call.body["_switchyard_chain"])
    try:
        completion, backend, attempts = await _until_disconnect(
            request, complete_with_fallbacks(chain, _payload(call), call.endpoint, gw.breakers))
    except ClientClosed:
        _finish(gw, call, None, None, status="client_closed", error_type="client_closed")
        return Response(status_code=499)
    except UpstreamError as exc:
        api_error = _upstream_to_api_error(exc)
        call.record.attempts = max(call.record.attempts, getattr(exc, "attempts", 1))
        _finish(gw, call, None, None, status="error", error_type=f"upstream_{exc.kind}",
                http_status=api_error.status)
        return _with_id(api_error.response(), call.record.request_id)
    call.record.attempts = attempts
    call.record.ttft_ms = (time.perf_counter() - call.started) * 1000
    body = completion.body
    body.pop("switchyard", None)
    if call.route.log_prompts:
        call.completion_parts.append(_completion_text(body))
    _finish(gw, call, backend.spec, completion)
    if call.shadow is not None:
        gw.routing.shadow.submit(call.shadow, backend.name, answer_text(body))
    response = Response(orjson.dumps(body), media_type="application/json")
    response.headers["x-switchyard-backend"] = backend.name
    return _with_id(response, call.record.request_id)


async def _stream(gw: Gateway, request: Request, call: Call) -> Response:
    chain = gw.pool.chain(call.body["_switchyard_chain"])
    payload = _payload(call)
    try:
        backend, chunks, attempts = await _until_disconnect(
            request, open_stream_with_fallbacks(chain, payload, call.endpoint, gw.breakers))
    except ClientClosed:
        metrics.IN_FLIGHT.dec()
        _finish(gw, call, None, None, status="client_closed", error_type="client_closed")
        return Response(status_code=499)
    except UpstreamError as exc:
        metrics.IN_FLIGHT.dec()
        api_error = _upstream_to_api_error(exc)
        _finish(gw, call, None, None, status="error", error_type=f"upstream_{exc.kind}",
                http_status=api_error.status)
        return _with_id(api_error.response(), call.record.request_id)
    call.record.attempts = attempts
    relay = _Relay(gw, call, backend, chunks)
    response = _RelayResponse(relay, headers={"cache-control": "no-cache", "x-switchyard-backend": backend.name})
    return _with_id(response, call.record.request_id)


class _RelayResponse(StreamingResponse):
    """An SSE response that always finalises its relay: after a normal end, a send to a client that has
    gone away (ASGI 2.4 servers raise instead of reporting a disconnect), or a body that never started."""

    def __init__(self, relay: _Relay, headers: dict[str, str]) -> None:
        super().__init__(relay.body(), media_type="text/event-stream", headers=headers)
        self.relay = relay

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # runs the body's own cleanup if it was suspended
                await self.relay.finish()  # and covers a body that never started


class _Relay:
    """Relays upstream chunks as SSE and accounts for exactly what was produced, however the stream ends."""

    def __init__(self, gw: Gateway, call: Call, backend, chunks: AsyncIterator[dict]) -> None:
        self.gw, self.call, self.backend, self.chunks = gw, call, backend, chunks
        self.final = Completion(body={}, usage=Usage())
        self.saw_usage = False
        self.status, self.error_type = "client_closed", "client_closed"  # until the stream ends normally
        self.finished = False

    async def body(self) -> AsyncIterator[bytes]:
        call, final = self.call, self.final
        wants_usage = admission.wants_usage_chunk(call.body)
        try:
            async for chunk in self.chunks:
                if call.record.ttft_ms is None:
                    call.record.ttft_ms = (time.perf_counter() - call.started) * 1000
                extension = chunk.pop("switchyard", None)
                if extension:
                    final.device_seconds = extension.get("device_seconds")
                    final.utilisation = extension.get("utilisation")
                usage = usage_from_chunk(chunk)
                if usage is not None:
                    final.usage, self.saw_usage = usage, True
                    if not wants_usage:
                        chunk.pop("usage", None)
                        if not chunk.get("choices"):
                            continue
                text = _chunk_text(chunk)
                if text:
                    call.chunks_with_content += 1
                    if call.route.log_prompts or call.shadow is not None:
                        call.completion_parts.append(text)
                if chunk.get("model") and not call.record.served_model:
                    call.record.served_model = chunk["model"]
                yield b"data: " + orjson.dumps(chunk) + b"\n\n"
            yield b"data: [DONE]\n\n"
            self.status, self.error_type = "ok", None
        except UpstreamError as exc:
            self.status, self.error_type = "error", f"upstream_{exc.kind}"
            # Headers are gone; tell the client in-band, the way OpenAI's streams do.
            yield b"data: " + orjson.dumps(_upstream_to_api_error(exc).body()) + b"\n\n"
        finally:
            await self.finish()

    async def finish(self) -> None:
        """Close the upstream and write the ledger row, once."""
        if self.finished:
            return
        self.finished = True
        call, final = self.call, self.final
        with anyio.CancelScope(shield=True):
            await _close(self.chunks)
        if not self.saw_usage:  # cut short: count what was actually streamed
            final.usage = Usage(prompt_tokens=admission.estimate_prompt_tokens(call.body, call.endpoint),
                                completion_tokens=call.chunks_with_content)
        if self.status == "client_closed" and final.device_seconds is None:
            final.device_seconds = self.gw.pool.estimate_device_seconds(self.backend.name, final.usage)
        _finish(self.gw, call, self.backend.spec, final, status=self.status, error_type=self.error_type)
        if call.shadow is not None and self.status == "ok":
            self.gw.routing.shadow.submit(call.shadow, self.backend.name, "".join(call.completion_parts))
        metrics.IN_FLIGHT.dec()


async def _close(chunks: AsyncIterator[dict]) -> None:
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except (UpstreamError, OSError) as exc:  # the upstream may already be gone
            log.debug("closing upstream stream: %s", exc)


def _finish(gw: Gateway, call: Call, spec: BackendSpec | None, completion: Completion | None, *,
            status: str = "ok", error_type: str | None = None, http_status: int | None = None) -> None:
    """Price the request, settle its budget and rate limits, record metrics and queue its ledger row."""
    record = call.record
    record.status, record.error_type = status, error_type
    record.http_status = http_status if http_status is not None else (200 if status == "ok" else None)
    record.latency_ms = (time.perf_counter() - call.started) * 1000
    if spec is not None:
        record.backend = spec.name
        record.served_model = record.served_model or spec.model
        chain = call.body.get("_switchyard_chain")
        if chain and spec.name != chain[0]:
            record.route_reason = "fallback"  # routing: the chain's first choice did not serve it
    if spec is not None and completion is not None:
        usage = completion.usage
        if completion.body.get("model"):
            record.served_model = completion.body["model"]
        pricing.charge(record, spec, usage, completion.device_seconds, completion.utilisation, call.policy,
                       call.route)
        if spec.kind == "engine" and completion.device_seconds is not None and status == "ok":
            gw.pool.observe_device_seconds(spec.name, usage, completion.device_seconds)
        gw.limiter.record_tokens(call.key, usage.prompt_tokens + usage.completion_tokens)
        metrics.TOKENS.labels(spec.name, "prompt").inc(usage.prompt_tokens)
        metrics.TOKENS.labels(spec.name, "cached_prompt").inc(usage.cached_prompt_tokens)
        metrics.TOKENS.labels(spec.name, "completion").inc(usage.completion_tokens)
        metrics.COST.labels(spec.name, record.cost_basis).inc(record.cost_usd)
    if call.completion_parts and call.route.log_prompts:
        record.completion_text = "".join(call.completion_parts)
    gw.budgets.settle(call.reservation, record.cost_usd)
    backend_label = record.backend or "none"
    metrics.REQUESTS.labels(call.route.name, backend_label, status).inc()
    metrics.LATENCY.labels(call.route.name, backend_label).observe(record.latency_ms / 1000)
    if record.ttft_ms is not None:
        metrics.TTFT.labels(call.route.name, backend_label).observe(record.ttft_ms / 1000)
    gw.writer.submit(record)


def _log_rejection(gw: Gateway, record: LedgerRecord, exc: errors.APIError, started: float) -> None:
    record.status, record.error_type, record.http_status = "rejected", exc.code or exc.type, exc.status
    record.latency_ms = (time.perf_counter() - started) * 1000
    metrics.REQUESTS.labels(record.route or "none", "none", "rejected").inc()
    gw.writer.submit(record)


def _upstream_to_api_error(exc: UpstreamError) -> errors.APIError:
    detail = str(exc) or exc.kind
    if exc.kind == "timeout":
        return errors.upstream_failed(f"The upstream timed out: {detail}", timeout=True)
    if exc.status == 429:
        return errors.rate_limited(f"Upstream rate limit: {detail}", retry_after_s=1)
    if exc.status in (400, 422) and exc.body and isinstance(exc.body.get("error"), dict):
        upstream = exc.body["error"]
        return errors.invalid_request(str(upstream.get("message") or detail), param=upstream.get("param"),
                                      code=upstream.get("code"))
    if exc.status in (400, 422):
        return errors.invalid_request(detail)
    return errors.upstream_failed(f"All backends failed: {detail}")


def _chunk_text(chunk: dict) -> str:
    parts = []
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta")
        if isinstance(delta, dict):
            parts.append(delta.get("content") or "")
        elif "text" in choice:
            parts.append(choice.get("text") or "")
    return "".join(parts)


def _completion_text(body: dict) -> str:
    choices = body.get("choices") or []
    if not choices:
        return ""
    first = choices[0]
    message = first.get("message")
    return (message or {}).get("content") or first.get("text") or ""


def _with_id(response: Response, request_id: str) -> Response:
    response.headers["x-request-id"] = request_id
    return response


async def _until_disconnect(request: Request, coro):
    """Await coro in this task, but cancel it (and raise ClientClosed) if the client disconnects first.

    One watcher task per request (not two tasks and an asyncio.wait): this is on the hot path.
    """
    task = asyncio.current_task()
    closed = False

    async def watch() -> None:
        nonlocal closed
        await _wait_for_disconnect(request)
        closed = True
        task.cancel()

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        return await coro
    except asyncio.CancelledError:
        if closed:
            task.uncancel()
            raise ClientClosed() from None
        raise
    finally:
        watcher.cancel()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
