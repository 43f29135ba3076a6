"""Shadow evaluation's runner: samples requests at admission, queues served ones, and works the queue —
the mirrored call to the other of easy/hard, the judging, and the `shadow_evals` row (see __init__.py)."""
from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import orjson
from prometheus_client import Counter

from gateway import admission, pricing
from gateway.backends.base import UpstreamError
from gateway.backends.resilience import BreakerRegistry, complete_with_fallbacks
from gateway.ledger.record import ENDPOINT_NAMES, LedgerRecord, ShadowRecord
from gateway.ledger.writer import LedgerWriter, ShadowEvalWriter
from gateway.shadow.judge import conversation_text, judge_request, matches_reference, parse_verdict
from gateway.shadow.reference import reference_of, without_reference
from gateway.tasks import cancel_and_wait
from openai_wire import answer_text

if TYPE_CHECKING:
    from gateway.backend_pool import BackendPool
    from gateway.policy import Policy, RouteSpec
    from gateway.routing import Decision

log = logging.getLogger("switchyard.shadow")

SHADOW_EVENTS = Counter("switchyard_shadow_events", "Shadow evaluation jobs by outcome", ["outcome"])
# outcomes: sampled | dropped_queue_full | dropped_shutdown | labelled | skipped_fallback | failed_upstream
#           | judge_unclear | error

_NOT_MIRRORED = ("stream", "stream_options")  # the mirrored call is never streamed


@dataclass(slots=True)
class ShadowTicket:
    """A sampled request, captured at admission."""

    request_id: str
    route: RouteSpec
    policy: Policy
    endpoint: str
    payload: dict  # what the mirrored call sends (not streamed, no reference)
    reference: str | None
    difficulty: float | None
    threshold: float | None
    model_version: str | None


@dataclass(slots=True)
class _Pair:
    """Both sides' answers to one request, and which side served the client."""

    served: str
    easy_answer: str
    hard_answer: str


class ShadowRunner:
    """Takes what it uses: the pool (to reach backends), the breakers, the ledger writer (a row per mirrored
    and judge call) and its own `shadow_evals` writer, which it starts and closes."""

    def __init__(self, pool: BackendPool, breakers: BreakerRegistry, ledger: LedgerWriter, writer: ShadowEvalWriter,
                 *, max_queue: int = 256, workers: int = 2, drain_timeout_s: float = 10.0,
                 rng: random.Random | None = None) -> None:
        self.pool = pool
        self.breakers = breakers
        self.ledger = ledger
        self.writer = writer
        self.max_queue = max_queue
        self.n_workers = workers
        self.drain_timeout_s = drain_timeout_s
        self.rng = rng or random.Random()
        self._queue: asyncio.Queue | None = None
        self._workers: list[asyncio.Task] = []
        self._closing = False

    async def start(self) -> None:
        await self.writer.start()
        self._queue = asyncio.Queue(self.max_queue)
        self._workers = [asyncio.create_task(self._work(), name=f"shadow-{i}") for i in range(self.n_workers)]

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize() if self._queue is not None else 0

    # ---- on the request path: cheap, never blocks, never raises

    def ticket(self, request_id: str, route: RouteSpec, policy: Policy, body: dict, endpoint: str,
               decision: Decision) -> ShadowTicket | None:
        """At admission: a ticket for a sampled request, else None. Cheap unless sampled."""
        spec = route.shadow
        if spec is None or self._closing or self.rng.random() >= spec.sample_rate:
            return None
        reference = reference_of(body)
        if spec.judge == "exact" and reference is None:
            return None  # nothing to compare with: sample only requests that carry a reference
        payload = without_reference({k: v for k, v in body.items() if k not in _NOT_MIRRORED})
        return ShadowTicket(request_id=request_id, route=route, policy=policy, endpoint=endpoint, payload=payload,
                            reference=reference, difficulty=decision.difficulty, threshold=decision.threshold,
                            model_version=decision.model_version)

    def submit(self, ticket: ShadowTicket, served_backend: str, answer: str) -> None:
        """After the request was served: queue the job. Never blocks, never raises."""
        try:
            if self._queue is None or self._closing:
                SHADOW_EVENTS.labels("dropped_shutdown").inc()
                return
            self._queue.put_nowait((ticket, served_backend, answer))
            SHADOW_EVENTS.labels("sampled").inc()
        except asyncio.QueueFull:
            SHADOW_EVENTS.labels("dropped_queue_full").inc()
        except Exception:  # learning must never fail a request
            log.exception("shadow submit failed")

    # ---- the workers

    async def _work(self) -> None:
        assert self._queue is not None
        while True:
            job = await self._queue.get()
            try:
                await self._process(*job)
            except Exception:  # one bad job must not stop the worker
                SHADOW_EVENTS.labels("error").inc()
                log.exception("shadow evaluation failed")
            finally:
                self._queue.task_done()

    async def _process(self, ticket: ShadowTicket, served: str, answer: str) -> None:
        pair = await self._mirror(ticket, served, answer)
        if pair is None:
            return
        judge = ticket.route.shadow.judge if ticket.route.shadow is not None else "exact"
        verdicts = await self._judge(ticket, judge, pair)
        if verdicts is None:
            SHADOW_EVENTS.labels("judge_unclear").inc()
            return
        self.writer.submit(_shadow_row(ticket, pair, *verdicts, judge))
        SHADOW_EVENTS.labels("labelled").inc()

    async def _mirror(self, ticket: ShadowTicket, served: str, answer: str) -> _Pair | None:
        """Ask the side that did not serve the request; None if it was a fallback or the call failed."""
        route = ticket.route
        if served not in (route.easy, route.hard):  # served by a fallback: neither side of the pair
            SHADOW_EVENTS.labels("skipped_fallback").inc()
            return None
        other = route.hard if served == route.easy else route.easy
        mirrored = await self._call(ticket, other, ticket.payload, ticket.endpoint, "shadow")
        if mirrored is None:
            SHADOW_EVENTS.labels("failed_upstream").inc()
            return None
        if served == route.easy:
            return _Pair(served, easy_answer=answer, hard_answer=mirrored)
        return _Pair(served, easy_answer=mirrored, hard_answer=answer)

    async def _judge(self, ticket: ShadowTicket, judge: str, pair: _Pair) -> tuple[bool, bool] | None:
        """(easy correct?, hard correct?); None when a judge backend gave no clear verdict."""
        if judge == "exact":
            assert ticket.reference is not None
            return (matches_reference(pair.easy_answer, ticket.reference),
                    matches_reference(pair.hard_answer, ticket.reference))
        question = conversation_text(ticket.payload, ticket.endpoint)
        verdicts = []
        for candidate in (pair.easy_answer, pair.hard_answer):
            request = judge_request(ticket.payload.get("model", ""), question, candidate, ticket.reference)
            reply = await self._call(ticket, judge, request, "chat", "shadow_judge")
            verdicts.append(None if reply is None else parse_verdict(reply))
        easy_ok, hard_ok = verdicts
        if easy_ok is None or hard_ok is None:
            return None
        return easy_ok, hard_ok

    async def _call(self, ticket: ShadowTicket, name: str, payload: dict, endpoint: str, reason: str) -> str | None:
        """One non-streamed call to a backend, logged in the ledger (no key: no budget pays). Its answer text."""
        spec = ticket.policy.backends.get(name)
        backend = self.pool.get(name)
        record = LedgerRecord(request_id="shadow_" + uuid.uuid4().hex, created_at=datetime.now(UTC),
                              endpoint=ENDPOINT_NAMES[endpoint], requested_model=str(ticket.payload.get("model", "")),
                              route=ticket.route.name, backend=name, stream=False,
                              policy_version=ticket.policy.version, difficulty=ticket.difficulty,
                              threshold=ticket.threshold, route_reason=reason)
        started = time.perf_counter()
        if backend is None or spec is None:
            record.status, record.error_type = "error", "backend_gone"
            self.ledger.submit(record)
            return None
        try:
            completion, _, attempts = await complete_with_fallbacks([backend], payload, endpoint, self.breakers)
        except UpstreamError as exc:
            record.status, record.error_type, record.http_status = "error", f"upstream_{exc.kind}", exc.status
            record.attempts = max(1, exc.attempts)
            record.latency_ms = (time.perf_counter() - started) * 1000
            self.ledger.submit(record)
            return None
        record.attempts, record.http_status = attempts, 200
        record.latency_ms = (time.perf_counter() - started) * 1000
        record.served_model = completion.body.get("model") or spec.model
        pricing.charge(record, spec, completion.usage, completion.device_seconds, completion.utilisation,
                       ticket.policy, ticket.route, reported_kind=completion.device_kind)
        self.ledger.submit(record)
        return answer_text(completion.body)

    # ---- shutdown

    async def drain(self) -> None:
        """Wait until every queued job is done (tests, shutdown)."""
        if self._queue is not None:
            await self._queue.join()

    async def aclose(self) -> None:
        """Stop sampling, finish queued jobs for up to drain_timeout_s, then write what was labelled."""
        self._closing = True
        if self._queue is not None:
            try:
                await asyncio.wait_for(self._queue.join(), self.drain_timeout_s)
            except TimeoutError:
                left = self._queue.qsize()
                log.warning("shutdown: %d shadow job(s) not finished in %ss; dropped", left, self.drain_timeout_s)
                SHADOW_EVENTS.labels("dropped_shutdown").inc(left)
        for task in self._workers:
            await cancel_and_wait(task)
        self._workers = []
        await self.writer.close()


def _shadow_row(ticket: ShadowTicket, pair: _Pair, easy_ok: bool, hard_ok: bool, judge: str) -> ShadowRecord:
    route, body = ticket.route, ticket.payload
    return ShadowRecord(
        request_id=ticket.request_id, created_at=datetime.now(UTC), route=route.name,
        endpoint=ENDPOINT_NAMES[ticket.endpoint], prompt_text=admission.prompt_text(body, ticket.endpoint),
        messages_json=orjson.dumps(body["messages"]).decode() if ticket.endpoint == "chat" else None,
        easy_backend=route.easy or "", hard_backend=route.hard or "", served_backend=pair.served,
        # The one place the two vocabularies meet: shadow_evals (read by the router's training) names the
        # sides by the models' strength, weak_* = the route's easy backend and strong_* = its hard one.
        weak_answer=pair.easy_answer, strong_answer=pair.hard_answer,
        weak_correct=bool(easy_ok), strong_correct=bool(hard_ok),
        judge=judge, difficulty=ticket.difficulty, threshold=ticket.threshold,
        model_version=ticket.model_version, policy_version=ticket.policy.version)
