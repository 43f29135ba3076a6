"""One OpenAI request end to end: admission, dispatch with fallbacks, streaming relay, accounting."""
from __future__ import annotations

import asyncio
import base64
import logging
import struct
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import anyio
import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from gateway import (
    admission,
    budgets,
    demand,
    errors,
    fleet,
    http_edge,
    metrics,
    pricing,
    responses_api,
    settings,
    stage_profile,
    unknown_fields,
)
from gateway.backends.base import (
    BACKEND_FAULT_STATUSES,
    Backend,
    Completion,
    Endpoint,
    StreamTally,
    UpstreamError,
    Usage,
)
from gateway.backends.resilience import BreakerRegistry, complete_with_fallbacks, open_stream_with_fallbacks
from gateway.backends.translate import ledger_endpoint
from gateway.engine_scrape import Pending
from gateway.ledger.record import ENDPOINT_NAMES, LedgerRecord
from gateway.ledger.writer import LedgerWriter
from gateway.redact import configured_secrets, redact
from gateway.routing import Decision, DifficultyModels, budget_downgrade, decide
from gateway.shadow.reference import without_reference
from gateway.shadow.runner import ShadowRunner, ShadowTicket
from openai_wire import SSE_DONE, APIError, ClientClosed, answer_text, sse_event, until_disconnect
from openai_wire.responses import EventStreamResponse, error_response

if TYPE_CHECKING:
    from gateway.auth import Authenticator
    from gateway.backend_pool import BackendPool
    from gateway.budgets import BudgetBook, Reservation
    from gateway.engine_load import EngineLoadMonitor
    from gateway.keys import KeyInfo
    from gateway.policy import BackendSpec, Policy, RouteSpec
    from gateway.policy_store import PolicyStore
    from gateway.ratelimit import RateLimiter

log = logging.getLogger("switchyard.proxy")


@dataclass(slots=True)
class Services:
    """What the request path uses, built once in the gateway's lifespan."""

    auth: Authenticator
    policy_store: PolicyStore
    models: DifficultyModels
    load: EngineLoadMonitor
    limiter: RateLimiter
    budgets: BudgetBook
    pool: BackendPool
    breakers: BreakerRegistry
    ledger: LedgerWriter
    shadow: ShadowRunner | None = None
    max_body_bytes: int = settings.DEFAULT_MAX_BODY_BYTES  # larger bodies: 413 before parsing


@dataclass(slots=True)
class Call:
    """Everything known about one admitted request while it is being served."""

    record: LedgerRecord
    key: KeyInfo
    policy: Policy
    route: RouteSpec
    body: dict  # the client's request, as sent
    endpoint: Endpoint
    decision: Decision  # routing's, complete: the backends to try (first choice first) and why
    reservation: Reservation | None
    started: float
    in_flight: metrics.InFlight  # ended when the plain response is ready or the stream's on_end runs
    prompt_tokens: int  # admission's (high) estimate, for rows of requests cut short before their usage
    shadow: ShadowTicket | None = None  # sampled for shadow evaluation (gateway/shadow/)
    finished: bool = False  # its row is queued and its reservation settled (_finish runs once)


async def handle(services: Services, request: Request, endpoint: Endpoint) -> Response:
    started = time.perf_counter()
    stage_profile.mark("edge")
    request_id = http_edge.request_id_of(request.scope)  # the one x-request-id, error body and row share
    try:
        key = await services.auth.authenticate(request.headers.get("authorization"))
    except APIError:
        metrics.AUTH_FAILURES.inc()
        raise  # answered by the app's exception handler (gateway/errors.py answer)
    stage_profile.mark("auth")
    record = LedgerRecord(request_id=request_id, created_at=datetime.now(UTC), api_key_id=key.id,
                          team=errors.clip(key.team, _TEAM_CHARS) if key.team else key.team,
                          endpoint=ENDPOINT_NAMES[endpoint])
    request.scope[http_edge.RECORD_KEY] = record  # an unexpected error's row (http_edge) starts from it
    in_flight = metrics.InFlight()
    response: Response | None = None
    try:
        response = await _serve(services, request, endpoint, record, key, started, in_flight)
        return response
    finally:
        if not isinstance(response, EventStreamResponse):  # a stream is in flight until its on_end
            in_flight.end()


async def _serve(services: Services, request: Request, endpoint: Endpoint, record: LedgerRecord, key: KeyInfo,
                 started: float, in_flight: metrics.InFlight) -> Response:
    try:
        call = await _admit(services, request, endpoint, record, key, started, in_flight)
    except APIError as exc:  # refused: its row, and the answer's headers on the error the app's handler answers
        _log_rejection(services, record, exc, started)
        exc.headers.update(_about(record))
        raise
    try:
        if call.body.get("stream"):
            return await _stream(services, request, call)
        return await _complete(services, request, call)
    except Exception:  # a bug must not leak the budget reservation or lose the ledger row
        log.exception("internal error serving %s", record.request_id)
        _finish(services, call, None, None, status="error", error_type="internal", http_status=500)
        return _answer_headers(error_response(APIError(500, "Internal gateway error; see the gateway log.",
                                                       type="api_error", code="internal_error")), record)
    except asyncio.CancelledError:  # cancelled mid-call (shutdown, a client gone): the row, the reservation back
        _finish(services, call, None, None, status="client_closed", error_type="cancelled")
        raise


# ---------------------------------------------------------------- admission


async def _admit(services: Services, request: Request, endpoint: Endpoint, record: LedgerRecord, key: KeyInfo,
                 started: float, in_flight: metrics.InFlight) -> Call:
    """Read and route the request, check its key's limits and reserve its worst-case cost (APIError if not)."""
    body = await _read_body(request, endpoint, services.max_body_bytes, record)
    stage_profile.mark("body")
    policy = services.policy_store.current
    route, decision, view = _route(services, policy, body, endpoint, record, key)
    stage_profile.mark("route")
    stage_profile.set_route(route.name)
    prompt_tokens = view.estimated_tokens
    reservation, decision = await _reserve(services, key, policy, route, decision, body, endpoint, prompt_tokens)
    record.route_reason = decision.reason
    stage_profile.mark("reserve")
    try:  # the rate limits after the budget: a request refused (or failing) from here gives its reservation back
        if (shared := services.limiter.admit(key, prompt_tokens)) is not None:
            await shared  # Redis-shared windows (gateway/shared_state.py): unless the budget's script counted them
        if route.log_prompts:
            record.prompt_text = view.text
        # Shadow evaluation compares answers to chat and completions requests (embeddings have none to judge).
        shadow = services.shadow.ticket(request_id=record.request_id, route=route, policy=policy, body=body,
                                        endpoint=endpoint, decision=decision) \
            if route.shadow is not None and services.shadow is not None and endpoint in _SHADOWED else None
    except BaseException:
        services.budgets.settle(reservation, 0.0)
        raise
    stage_profile.mark("admit")
    return Call(record=record, key=key, policy=policy, route=route, body=body, endpoint=endpoint,
                decision=decision, reservation=reservation, started=started, in_flight=in_flight,
                prompt_tokens=prompt_tokens, shadow=shadow)


async def _read_body(request: Request, endpoint: Endpoint, limit: int, record: LedgerRecord) -> dict:
    try:
        body = orjson.loads(await _body_within(request, limit))
    except orjson.JSONDecodeError as exc:
        raise errors.invalid_request(f"The request body is not valid JSON: {exc}.") from None
    if isinstance(body, dict) and isinstance(body.get("model"), str):  # a refused body's row still names it
        record.requested_model = errors.clip(body["model"], _STORED_CHARS)
    _check_forwardable(body)
    body = admission.validate(body, endpoint)
    unknown_fields.check(body, endpoint)
    return body


_MAX_DEPTH = 250  # orjson writes 254 levels (and reads 1,024): what backends may add when reshaping a body fits


def _check_forwardable(body: object) -> None:
    """A body parsed but nested too deeply to be written again (an engine backend's orjson, litellm's json) is the
    client's 400 on every route kind, not a 500 or a 502 at the backend. One C pass: ~10 us for a chat body."""
    nested: object = body
    for _ in range(254 - _MAX_DEPTH):
        nested = [nested]
    try:
        orjson.dumps(nested)
    except TypeError:
        raise errors.invalid_request(f"The request body nests JSON too deeply: at most {_MAX_DEPTH} levels.",
                                     code="nested_too_deeply") from None


async def _body_within(request: Request, limit: int) -> bytes:
    """The request body, read with a running count: past `limit` bytes, a 413 before anything is parsed (what
    was read is dropped; the rest is drained, up to a bound, so the client reads the 413 and not a reset)."""
    declared = request.headers.get("content-length")
    receive = request.receive
    if declared is not None and declared.isdigit() and int(declared) > limit:
        await _drain(receive, limit)
        raise errors.request_too_large(limit)
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            parts.clear()
            if message.get("more_body", False):
                await _drain(receive, limit)
            raise errors.request_too_large(limit)
        if chunk:
            parts.append(chunk)
        if not message.get("more_body", False):
            return parts[0] if len(parts) == 1 else b"".join(parts)


async def _drain(receive: Callable, limit: int) -> None:
    budget = max(4 * limit, _DRAIN_BYTES)
    while budget > 0:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        budget -= len(message.get("body", b""))


_SHADOWED = frozenset({"chat", "completions"})
_DRAIN_BYTES = 64 * 1024 * 1024  # read (and drop) at most this much of an oversized body
_TEAM_CHARS, _STORED_CHARS, _CODE_CHARS = 128, 256, 64  # the ledger's column widths (gateway/ledger/models.py)


def _route(services: Services, policy: Policy, body: dict, endpoint: Endpoint,
           record: LedgerRecord, key: KeyInfo) -> tuple[RouteSpec, Decision, admission.PromptView]:
    """The route the requested model names, routing's decision for this request (a Responses request is
    scored and matched to capabilities in its chat form), and the request's prompt view (computed once)."""
    record.requested_model = errors.clip(body["model"], _STORED_CHARS)
    record.policy_version = policy.version
    record.stream = bool(body.get("stream"))
    route = policy.routes.get(body["model"])
    if route is None or not key.allows(route.name):  # a route the key may not use is, to it, one that is not there
        raise errors.model_not_found(body["model"], [name for name in policy.routes if key.allows(name)])
    record.route = route.name
    view = admission.PromptView.of(body, endpoint)
    decision = decide(route, view.body, services.models, services.load, policy, endpoint=view.endpoint,
                      prompt_chars=len(view.text))
    record.route_reason, record.difficulty, record.threshold = decision.reason, decision.difficulty, decision.threshold
    return route, decision, view


async def _reserve(services: Services, key: KeyInfo, policy: Policy, route: RouteSpec, decision: Decision,
                   body: dict, endpoint: Endpoint, prompt_tokens: int) -> tuple[Reservation | None, Decision]:
    """Reserve the chain's worst-case cost (every prompt, choice and output: admission.token_demand; unpriced
    requests by the policy's `budgets:` rules); a key that cannot afford it may still afford routing's cheaper
    decision (routing.budget_downgrade). The reservation (None for a key without a budget) and the decision
    it is for."""
    if key.budget_usd is None:
        return None, decision
    demand = admission.token_demand(body, endpoint, prompt_tokens)

    def amount(chain: list[str]) -> float:
        worst = pricing.worst_case([policy.backends[name] for name in chain], demand)
        return budgets.reservation_usd(worst, policy.budgets, admission.cap_param(endpoint))

    try:
        return await services.budgets.reserve(key, amount(decision.chain), prompt_tokens), decision
    except APIError as exc:
        cheaper = budget_downgrade(route, decision) if exc.code == "insufficient_quota" else None
        if cheaper is None:
            raise
    return await services.budgets.reserve(key, amount(cheaper.chain), prompt_tokens), cheaper  # 429 if even that


# ---------------------------------------------------------------- dispatch


def _payload(call: Call) -> dict:
    """What the upstream gets: the client's body less our `metadata.reference` (not copied when absent)."""
    return without_reference(call.body)


async def _dispatch(services: Services, request: Request, call: Call, with_fallbacks: Callable) -> Any:
    """Try the call's chain with `with_fallbacks` (plain or stream opener) until the client leaves: its
    result, or the Response that ends the request (499 for a closed client, the upstream's error)."""
    chain = services.pool.chain(call.decision.chain)
    # Embedded engines not serving yet (starting, or restarting after a crash) are skipped: the fallbacks answer,
    # or, with none left, a 503 with Retry-After (nothing was sent).
    starting = [b for b in chain if services.pool.retry_after_s(b.name) is not None]
    if starting and len(starting) == len(chain):
        return _engines_starting(services, call, starting)
    chain = [b for b in chain if b not in starting]
    attempted: list[Backend] = []
    try:
        result = await until_disconnect(
            request.receive, with_fallbacks(chain, _payload(call), call.endpoint, services.breakers, attempted))
    except ClientClosed:
        return _client_closed(services, call, attempted[-1] if attempted else None)
    except UpstreamError as exc:
        call.record.attempts = max(call.record.attempts, exc.attempts)
        return _upstream_failure(services, call, exc)
    call.record.attempts = result[-1]  # both openers return (…, attempts made)
    return result


async def _complete(services: Services, request: Request, call: Call) -> Response:
    outcome = await _dispatch(services, request, call, complete_with_fallbacks)
    stage_profile.mark("dispatch")
    if isinstance(outcome, Response):
        return outcome
    completion, backend, _ = outcome
    call.record.endpoint = ledger_endpoint(call.record.endpoint, completion.served_as)  # sent as chat: the row says so
    call.record.ttft_ms = (time.perf_counter() - call.started) * 1000
    body = completion.body
    body.pop("switchyard", None)
    if call.endpoint == "embeddings":
        _encode_embeddings(body, call.body.get("encoding_format"))
    answer = _answer(body, call.endpoint) if call.route.log_prompts or call.shadow is not None else None
    _finish(services, call, backend.spec, completion, answer=answer)  # the served model is in the row
    if "model" in body:
        body["model"] = call.body["model"]  # the model the client asked for (the route), on every route kind
    response = _answer_headers(Response(orjson.dumps(body), media_type="application/json"), call.record)
    stage_profile.mark("finish")
    return response


def _answer(body: dict, endpoint: Endpoint) -> str | None:
    if endpoint == "responses":
        return responses_api.output_text(body)
    return None if endpoint == "embeddings" else answer_text(body)


def _encode_embeddings(body: dict, encoding_format: str | None) -> None:
    """Embeddings as the client asked: base64 (little-endian float32, what the openai SDK asks for by default)
    where the upstream answered floats."""
    if encoding_format != "base64":
        return
    for item in body.get("data") or ():
        vector = item.get("embedding")
        if isinstance(vector, list):
            item["embedding"] = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


async def _stream(services: Services, request: Request, call: Call) -> Response:
    outcome = await _dispatch(services, request, call, open_stream_with_fallbacks)
    if isinstance(outcome, Response):
        return outcome
    backend, chunks, _ = outcome
    call.record.endpoint = ledger_endpoint(call.record.endpoint, chunks.served_as)  # sent as chat: the row says so
    call.record.route_reason = call.decision.reason_served_by(backend.name)  # as _outcome will write it
    relay = _Relay(services, call, backend, chunks)
    # The cost is not known up front: it comes in the final usage chunk (usage.cost_usd), when one is sent.
    headers = {"x-switchyard-backend": backend.name, "x-request-id": call.record.request_id}
    call.record.replica = fleet.replica_of(backend.name)  # an engine fleet's replica (gateway/fleet.py)
    if call.record.replica:
        headers["x-switchyard-replica"] = call.record.replica
    if call.record.route_reason:
        headers["x-switchyard-route-reason"] = call.record.route_reason
    return EventStreamResponse(relay.body(), on_end=relay.finish, headers=headers)


def _client_closed(services: Services, call: Call, backend: Backend | None) -> Response:
    """The client left before the answer: the backend at work keeps the row, with what is known of its work. A
    plain answer carries no progress, so the prompt (admission's estimate) is what is known to have been
    processed; an engine's device time is estimated from its learned rate (cost_note device_seconds_estimated)."""
    if backend is None:
        _finish(services, call, None, None, status="client_closed", error_type="client_closed")
    else:
        usage = Usage(call.prompt_tokens, 0, 0)
        device_seconds = services.pool.estimate_device_seconds(backend.name, usage) \
            if backend.spec.kind == "engine" else None
        _finish(services, call, backend.spec, Completion({}, usage, device_seconds),
                status="client_closed", error_type="client_closed",
                device_seconds_estimated=device_seconds is not None)
    return Response(status_code=499)


def _engines_starting(services: Services, call: Call, backends: list[Backend]) -> Response:
    wait = min(services.pool.retry_after_s(b.name) or 1.0 for b in backends)
    api_error = errors.engine_starting([b.name for b in backends], wait)
    _finish(services, call, None, None, status="error", error_type="engine_starting", http_status=api_error.status)
    return _with_id(error_response(api_error), call.record.request_id)


def _upstream_failure(services: Services, call: Call, exc: UpstreamError) -> Response:
    """The row names the backend that answered last (none when every circuit was open); the client's own fault,
    as a backend judged it, is a `client_error` row with the backend's error code."""
    api_error = _upstream_to_api_error(exc, _upstream_secrets(call.policy))
    spec = call.policy.backends.get(exc.backend) if exc.backend else None
    status, error_type = _failure_status(exc)
    _finish(services, call, spec, None, status=status, error_type=error_type, http_status=api_error.status)
    return _answer_headers(error_response(api_error), call.record)


def _failure_status(exc: UpstreamError) -> tuple[str, str]:
    """The ledger's (status, error_type) for a failed call. `client_error`: the backend refused the client's
    request (a 4xx about it, e.g. context_length_exceeded, or litellm refused to send it): its error code, else
    upstream_rejected_<status> (invalid_request when never sent). `error`: upstream_<kind> (timeout, connect,
    http, protocol, malformed, too_large…), or circuit_open when no backend was tried at all."""
    if exc.kind == "request":
        return "client_error", "invalid_request"
    if exc.kind == "http" and exc.status is not None and 400 <= exc.status < 500 \
            and exc.status not in BACKEND_FAULT_STATUSES and exc.status not in (408, 409, 429):
        upstream = exc.body["error"] if exc.body and isinstance(exc.body.get("error"), dict) else {}
        code = upstream.get("code")
        if isinstance(code, str) and code.strip():
            return "client_error", errors.clip(redact(code), _CODE_CHARS)
        return "client_error", f"upstream_rejected_{exc.status}"
    return "error", ("circuit_open" if exc.kind == "circuit_open" else f"upstream_{exc.kind}")


def _upstream_secrets(policy: Policy) -> list[str]:
    """The values of the keys the policy's backends use: never quoted to a client, whatever an upstream says."""
    return configured_secrets(spec.api_key_env for spec in policy.backends.values())


class _Relay:
    """Relays upstream chunks as SSE and accounts for exactly what was produced, however the stream ends."""

    def __init__(self, services: Services, call: Call, backend: Backend, chunks: AsyncIterator[dict]) -> None:
        self.services, self.call, self.backend, self.chunks = services, call, backend, chunks
        self.tally = StreamTally(keep_text=call.route.log_prompts or call.shadow is not None)
        self.status, self.error_type = "client_closed", "client_closed"  # until the stream ends normally
        self.finished = False

    async def body(self) -> AsyncIterator[bytes]:
        call, tally, record = self.call, self.tally, self.call.record
        events = call.endpoint == "responses"  # typed events: each names itself, and no [DONE] ends them
        wants_usage = events or admission.wants_usage_chunk(call.body)
        try:
            async for chunk in self.chunks:
                if record.ttft_ms is None:
                    record.ttft_ms = (time.perf_counter() - call.started) * 1000
                tally.observe(chunk)
                chunk.pop("switchyard", None)
                if not wants_usage and chunk.get("usage"):  # we asked for it; the client did not
                    del chunk["usage"]
                    if not chunk.get("choices"):
                        continue
                model = chunk.get("model") or (events and (chunk.get("response") or {}).get("model"))
                if model and not record.served_model:
                    record.served_model = errors.clip(model, _STORED_CHARS)
                if model:
                    _as_asked(chunk, call.body["model"], self._cost_usd())
                data = sse_event(orjson.dumps(chunk))
                yield b"event: " + chunk["type"].encode() + b"\n" + data if events and "type" in chunk else data
            if not events:
                yield SSE_DONE
            self.status, self.error_type = "ok", None
        except UpstreamError as exc:
            self.status, self.error_type = _failure_status(exc)
            # Headers are gone; tell the client in-band, the way OpenAI's streams do.
            error = _upstream_to_api_error(exc, _upstream_secrets(call.policy))
            if events:
                body = error.body()["error"]
                yield b"event: error\n" + sse_event(orjson.dumps(
                    {"type": "error", "code": body.get("code"), "message": body.get("message"),
                     "param": body.get("param"), "sequence_number": tally.chunks}))
            else:
                yield sse_event(orjson.dumps(error.body()))
        finally:
            await self.finish()  # before the response's last message: the row is queued when the client sees the end

    def _cost_usd(self) -> float | None:
        """The request's cost once its usage has arrived (what _finish will price the row at), else None."""
        if not self.tally.complete_usage:
            return None
        done = Completion({}, self.tally.usage(), self.tally.device_seconds, self.tally.utilisation)
        if self.services.load.foreign.handles(self.backend.name):  # priced as _finish prices its answer
            done, _ = _estimated(self.services, self.backend.spec, done, False)
        return pricing.request_cost(self.backend.spec, done.usage, done.device_seconds, done.utilisation).total_usd

    async def finish(self) -> None:
        """Close the upstream, write the ledger row and end the request's time in flight, once."""
        if self.finished:
            return
        self.finished = True
        call, tally = self.call, self.tally
        try:
            with anyio.CancelScope(shield=True):
                await _close(self.chunks)
            # cut short (no usage chunk): count what was actually streamed
            usage = tally.usage() if tally.complete_usage else tally.usage(call.prompt_tokens)
            device_seconds, estimated = tally.device_seconds, False
            # Cut short (client gone, engine crashed or cut mid-stream): the engine's figure never came, so its
            # device time is estimated from the learned rate for the tokens streamed (cost_note says so).
            if self.status != "ok" and device_seconds is None:
                device_seconds = self.services.pool.estimate_device_seconds(self.backend.name, usage)
                estimated = device_seconds is not None
            _finish(self.services, call, self.backend.spec,
                    Completion({}, usage, device_seconds, tally.utilisation, device_kind=tally.device_kind),
                    status=self.status,
                    error_type=self.error_type, answer=tally.text() if tally.parts else None,
                    device_seconds_estimated=estimated)
        finally:  # whatever failed above, the reservation goes back (a no-op once _finish settled it)
            self.services.budgets.settle(call.reservation, call.record.cost_usd)
            call.in_flight.end()


def _as_asked(chunk: dict, model: str, cost_usd: float | None) -> None:
    """A streamed chunk (or Responses event) as the client sees it: the model it asked for (the route), and the
    request's cost in the usage it carries (`usage.cost_usd`: extra fields the openai SDK keeps)."""
    target = chunk["response"] if isinstance(chunk.get("response"), dict) else chunk
    if "model" in target:
        target["model"] = model
    usage = target.get("usage")
    if isinstance(usage, dict) and cost_usd is not None:
        usage["cost_usd"] = cost_usd


async def _close(chunks: AsyncIterator[dict]) -> None:
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except (UpstreamError, OSError) as exc:  # the upstream may already be gone
            log.debug("closing upstream stream: %s", exc)
        except Exception:  # a client library's close bug must not cost the row or the reservation
            log.warning("closing an upstream stream failed", exc_info=True)


# ---------------------------------------------------------------- accounting


def _reported_kind(services: Services, spec: BackendSpec, completion: Completion) -> str | None:
    """What an engine says it runs on: its answer's own word first, else its last scrape (None: API backends)."""
    if spec.kind != "engine":
        return None
    return completion.device_kind or services.load.device_kind(spec.name)


def _finish(services: Services, call: Call, spec: BackendSpec | None, completion: Completion | None, *,
            status: str = "ok", error_type: str | None = None, http_status: int | None = None,
            answer: str | None = None, device_seconds_estimated: bool = False) -> None:
    """Price the request, settle its budget and rate limits, record metrics, queue its ledger row and (served
    and sampled) its shadow job. `answer`: the text produced, for opt-in logging and shadow evaluation.
    Once per call: the reservation is settled even if pricing fails (the caller's error path then writes the
    row), and a later call for the same request does nothing."""
    if call.finished:
        return
    # A vLLM / SGLang backend: its device time is known after its next scrape (gateway/engine_scrape.py). The
    # answer gets the learned rate's estimate now; the row and the budget settle then (_settle_later).
    later = spec is not None and completion is not None and services.load.foreign.handles(spec.name)
    try:
        if later:
            completion, device_seconds_estimated = _estimated(services, spec, completion, device_seconds_estimated)
        _outcome(services, call, spec, completion, status, error_type, http_status, answer, device_seconds_estimated)
    except BaseException:
        later = False
        raise
    finally:
        if not later:
            services.budgets.settle(call.reservation, call.record.cost_usd)
    record = call.record
    _observe(record, call.route.name, status)
    if later:
        _settle_later(services, call, spec, completion)
    else:
        services.ledger.submit(record)
    call.finished = True
    if call.shadow is not None and services.shadow is not None and spec is not None and status == "ok":
        services.shadow.submit(call.shadow, spec.name, answer or "")


def _estimated(services: Services, spec: BackendSpec, completion: Completion,
               estimated: bool) -> tuple[Completion, bool]:
    """A foreign engine's answer carries no device time: the learned per-token rate's estimate, at the engine's
    measured utilisation, prices the answer until its row settles."""
    if completion.device_seconds is not None:
        return completion, estimated
    seconds = services.pool.estimate_device_seconds(spec.name, completion.usage)
    engine = services.load.foreign.get(spec.name)
    utilisation = completion.utilisation if completion.utilisation is not None else \
        (engine.utilisation if engine is not None else None)
    return replace(completion, device_seconds=seconds, utilisation=utilisation), seconds is not None


def _settle_later(services: Services, call: Call, spec: BackendSpec, completion: Completion) -> None:
    """Hand the row to the foreign engine's attribution: it is re-priced with its share of the engine's busy time
    after the next scrape (or keeps its estimate when none comes), then its budget settles and it is queued."""
    record, usage, reservation = call.record, completion.usage, call.reservation
    call.reservation = None  # settled below, once: the relay's own guard now does nothing
    kind = _reported_kind(services, spec, completion)

    def settle(device_seconds: float | None, utilisation: float | None, estimated: bool) -> None:
        try:
            if device_seconds is not None and not estimated:
                pricing.charge(record, spec, usage, device_seconds, utilisation, call.policy, call.route,
                               reported_kind=kind)
                if record.status == "ok":
                    services.pool.observe_device_seconds(spec.name, usage, device_seconds)
        finally:
            services.budgets.settle(reservation, record.cost_usd)
            services.ledger.submit(record)

    now = time.monotonic()
    started = now - (time.perf_counter() - call.started)  # the request's start on the monotonic clock
    services.load.foreign.defer(spec.name, Pending(
        usage.prompt_tokens, usage.completion_tokens, usage.cached_prompt_tokens or None, started, now, settle))


def _outcome(services: Services, call: Call, spec: BackendSpec | None, completion: Completion | None,
             status: str, error_type: str | None, http_status: int | None, answer: str | None,
             device_seconds_estimated: bool) -> None:
    """The row's outcome, backend and (served) cost columns."""
    record = call.record
    record.status, record.error_type = status, error_type
    record.http_status = http_status if http_status is not None else (200 if status == "ok" else None)
    record.latency_ms = (time.perf_counter() - call.started) * 1000
    if spec is not None:
        record.backend = spec.name
        record.replica = record.replica or fleet.replica_of(spec.name)
        record.served_model = record.served_model or spec.model
        record.route_reason = call.decision.reason_served_by(spec.name)
        if completion is not None:
            _charge(services, call, spec, completion, status, device_seconds_estimated)
    if answer is not None and call.route.log_prompts:
        record.completion_text = answer


def _charge(services: Services, call: Call, spec: BackendSpec, completion: Completion, status: str,
            device_seconds_estimated: bool = False) -> None:
    """Cost, device-time learning, token rate limits and token/cost metrics of a request a backend served."""
    record, usage = call.record, completion.usage
    if completion.body.get("model"):
        record.served_model = errors.clip(completion.body["model"], _STORED_CHARS)
    pricing.charge(record, spec, usage, completion.device_seconds, completion.utilisation, call.policy, call.route,
                   estimated=device_seconds_estimated,
                   reported_kind=_reported_kind(services, spec, completion))
    if spec.kind == "engine" and completion.device_seconds is not None and status == "ok" \
            and not device_seconds_estimated:  # never learn the rate from its own estimate
        services.pool.observe_device_seconds(spec.name, usage, completion.device_seconds)
    services.limiter.record_tokens(call.key, usage.prompt_tokens + usage.completion_tokens)
    demand.observe(spec, usage.prompt_tokens, usage.completion_tokens, record.latency_ms)  # autoscaling's feed
    metrics.child(metrics.TOKENS, spec.name, "prompt").inc(usage.prompt_tokens)
    metrics.child(metrics.TOKENS, spec.name, "cached_prompt").inc(usage.cached_prompt_tokens)
    metrics.child(metrics.TOKENS, spec.name, "completion").inc(usage.completion_tokens)
    metrics.child(metrics.COST, spec.name, record.cost_basis).inc(record.cost_usd)


def _observe(record: LedgerRecord, route: str, status: str) -> None:
    backend_label = record.backend or "none"
    metrics.child(metrics.REQUESTS, route, backend_label, status).inc()
    metrics.child(metrics.LATENCY, route, backend_label).observe(record.latency_ms / 1000)
    if record.ttft_ms is not None:
        metrics.child(metrics.TTFT, route, backend_label).observe(record.ttft_ms / 1000)


def _log_rejection(services: Services, record: LedgerRecord, exc: APIError, started: float) -> None:
    record.status, record.error_type, record.http_status = "rejected", exc.code or exc.type, exc.status
    record.error_type = errors.clip(record.error_type, _CODE_CHARS)
    record.latency_ms = (time.perf_counter() - started) * 1000
    metrics.child(metrics.REQUESTS, record.route or "none", "none", "rejected").inc()
    services.ledger.submit(record)


def _upstream_to_api_error(exc: UpstreamError, secrets: list[str] | None = None) -> APIError:
    """What the client is told, in our words (the upstream's own message quoted, never litellm's wrapping):
    the request's own fault keeps its 4xx (400 when refused before it was sent); our misconfiguration
    (401/403/404 from the provider) and an unwell backend are 502/504; a malformed or oversized answer 502.
    Upstream text is redacted (gateway/redact.py: `secrets`, key- and token-shaped strings, file paths,
    library internals) before it is quoted or logged."""
    secrets = secrets or []
    detail = errors.clip(redact(exc.detail, secrets) if exc.detail else f"{exc.kind} error (see the gateway log)",
                         500)
    upstream = exc.body["error"] if exc.body and isinstance(exc.body.get("error"), dict) else {}
    param = redact(upstream["param"], secrets) if isinstance(upstream.get("param"), str) else None
    code = redact(upstream["code"], secrets) if isinstance(upstream.get("code"), str) else None
    logged = redact(exc.message, secrets)
    if exc.kind == "circuit_open":
        log.info("upstream unavailable: %s", logged)
        return errors.circuit_open(exc.retry_after or 1.0)
    if exc.kind == "timeout" or exc.status == 408:
        log.info("upstream timeout: %s", logged)
        return errors.upstream_failed("The backend did not answer in time.", timeout=True)
    if exc.kind == "connect":  # our transport error (names an internal URL): logged, never quoted
        log.info("upstream unreachable: %s", logged)
        return errors.upstream_failed("No backend could be reached for this model (connection failed); "
                                      "try again shortly.")
    if exc.kind in ("malformed", "too_large"):
        log.warning("upstream answer refused: %s", logged)
        what = "an answer larger than its size cap" if exc.kind == "too_large" else "a malformed answer"
        return errors.upstream_failed(f"The backend sent {what}; no backend could serve the request.",
                                      code=f"upstream_{exc.kind}")
    if exc.kind == "request":
        return errors.invalid_request(f"The request could not be sent to the backend: {detail}")
    if exc.status == 429:
        return errors.rate_limited(f"The backend is rate limiting requests: {detail}", retry_after_s=1)
    if exc.status in BACKEND_FAULT_STATUSES:
        return errors.backend_misconfigured(exc.status, detail)
    if exc.status is not None and 400 <= exc.status < 500 and exc.status != 409:
        return errors.upstream_rejected(exc.status, detail, param=param, code=code and errors.clip(code, _CODE_CHARS))
    log.info("upstream failed: %s", logged)
    return errors.upstream_failed(f"All backends failed: {detail}")


def _with_id(response: Response, request_id: str) -> Response:
    response.headers["x-request-id"] = request_id
    return response


def _answer_headers(response: Response, record: LedgerRecord) -> Response:
    """What a /v1 answer says about itself, as far as it is known: the backend, the route reason and the cost
    its ledger row records (0 for a failure). The request id: http_edge (the client's own when it sent a sane one).
    Appended as raw pairs: a response made here has none of them yet (half the cost of MutableHeaders' sets)."""
    response.raw_headers.extend([(name.encode("latin-1"), value.encode("latin-1"))
                                 for name, value in _about(record).items()])
    return response


def _about(record: LedgerRecord) -> dict[str, str]:
    """_answer_headers' headers (for an answer, or an APIError the app's handler answers)."""
    headers = {}
    if record.backend:
        headers["x-switchyard-backend"] = record.backend
    if record.replica:
        headers["x-switchyard-replica"] = record.replica
    if record.route_reason:
        headers["x-switchyard-route-reason"] = record.route_reason
    headers["x-switchyard-cost-usd"] = usd_header(record.cost_usd)
    headers["x-request-id"] = record.request_id
    return headers


def usd_header(value: float | None) -> str:
    """Dollars as plain decimal text (no exponent), to 1e-10: `0.000123`, `0`."""
    return format(value or 0.0, ".10f").rstrip("0").rstrip(".") or "0"
