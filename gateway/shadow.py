"""Learning from traffic: mirror a sampled share of served requests to the other backend and label the pair.

A route with `shadow: {sample_rate, judge}` draws each request at admission (`ShadowRunner.ticket`). After
a sampled request is served (plain or streamed, status ok) its answer and a ticket go into a bounded queue
(`submit`, never blocks: a full queue drops the job and counts it). Worker tasks then

1. send the same request (not streamed) to the other of easy/hard — served by easy → ask hard, and the
   reverse; a request served by a fallback is skipped;
2. judge both answers: `exact` compares each with the reference the client sent in `metadata.reference`
   (whitespace collapsed, case folded), only sampled when present; a backend name asks that backend the
   yes/no question in JUDGE_SYSTEM / `judge_messages` once per answer;
3. write a `shadow_evals` row (prompt included: a shadow setting is an opt-in to storing prompts) through
   `ShadowEvalWriter`, the ledger's batched writer with its spool, so a database outage loses nothing.

Every mirrored and judge call is a ledger row too (route_reason `shadow` / `shadow_judge`, no API key, so
no budget pays for it), so what learning costs is visible in the same reports as everything else.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import orjson
from prometheus_client import Counter
from sqlalchemy.dialects import postgresql, sqlite

from gateway import admission, pricing
from gateway.backends.base import UpstreamError
from gateway.backends.resilience import complete_with_fallbacks
from gateway.ledger.models import ShadowEvalRow
from gateway.ledger.record import LedgerRecord, SpoolRecord
from gateway.ledger.writer import LedgerWriter

if TYPE_CHECKING:
    from gateway.app import Gateway
    from gateway.policy import Policy, RouteSpec
    from gateway.routing import Decision

log = logging.getLogger("switchyard.shadow")

SHADOW_EVENTS = Counter("switchyard_shadow_events", "Shadow evaluation jobs by outcome", ["outcome"])
# outcomes: sampled | dropped_queue_full | dropped_shutdown | labelled | skipped_fallback | failed_upstream
#           | judge_unclear | error

ENDPOINT_NAMES = {"chat": "chat.completions", "completions": "completions"}

JUDGE_SYSTEM = ("You grade answers. Read the request and the candidate answer (and the reference answer when "
                "one is given). Reply with exactly one word: yes if the candidate answer is correct and an "
                "acceptable reply to the request, no otherwise.")


def judge_messages(request_text: str, answer: str, reference: str | None) -> list[dict]:
    """The judge's chat: the system rule above and one user turn with the request and the answer."""
    parts = [f"Request:\n{request_text}"]
    if reference is not None:
        parts.append(f"Reference answer:\n{reference}")
    parts.append(f"Candidate answer:\n{answer}")
    parts.append("Is the candidate answer acceptable? Answer yes or no.")
    return [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": "\n\n".join(parts)}]


def parse_verdict(text: str) -> bool | None:
    """yes → True, no → False (first word, case and punctuation ignored); anything else → None."""
    words = text.strip().split()
    if not words:
        return None
    word = words[0].strip(".,!:;\"'`*").casefold()
    return True if word == "yes" else False if word == "no" else None


def normalise(text: str) -> str:
    return " ".join(text.split()).casefold()


def reference_of(body: dict) -> str | None:
    """The client's reference answer: OpenAI's `metadata` field, key `reference` (a string)."""
    meta = body.get("metadata")
    if isinstance(meta, dict) and isinstance(meta.get("reference"), str):
        return meta["reference"]
    return None


def without_reference(payload: dict) -> dict:
    """The payload for an upstream: `metadata.reference` is ours (and may exceed OpenAI's 512-char values)."""
    meta = payload.get("metadata")
    if isinstance(meta, dict) and "reference" in meta:
        rest = {k: v for k, v in meta.items() if k != "reference"}
        payload = dict(payload)
        if rest:
            payload["metadata"] = rest
        else:
            payload.pop("metadata")
    return payload


def answer_text(body: dict) -> str:
    choices = body.get("choices") or []
    if not choices:
        return ""
    first = choices[0]
    return ((first.get("message") or {}).get("content") or first.get("text") or "") if isinstance(first, dict) else ""


def conversation_text(body: dict, endpoint: str) -> str:
    """The request as the judge reads it: `role: text` per message, or the completions prompt."""
    if endpoint != "chat":
        return admission.prompt_text(body, endpoint)
    lines = []
    for m in body.get("messages") or ():
        content = m.get("content")
        if isinstance(content, list):
            content = "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
        lines.append(f"{m.get('role', 'user')}: {content or ''}")
    return "\n".join(lines)


# ---------------------------------------------------------------- rows and their writer


@dataclass(slots=True)
class ShadowRecord(SpoolRecord):
    """Mirrors ShadowEvalRow (all columns but the autoincrement id)."""

    request_id: str
    created_at: datetime
    route: str
    endpoint: str
    prompt_text: str
    messages_json: str | None
    easy_backend: str
    hard_backend: str
    served_backend: str
    weak_answer: str | None
    strong_answer: str | None
    weak_correct: bool
    strong_correct: bool
    judge: str
    difficulty: float | None = None
    threshold: float | None = None
    model_version: str | None = None
    policy_version: str | None = None


_SHADOW_TABLE = ShadowEvalRow.__table__


class ShadowEvalWriter(LedgerWriter):
    """The ledger writer's queue, batching, spool and replay, pointed at `shadow_evals` (its own spool file).

    Reuses LedgerWriter unchanged except for the INSERT statement and the record type its spool lines are
    read back as; its Prometheus series (switchyard_ledger_rows_*) therefore count these rows together
    with the ledger's.
    """

    record_type = ShadowRecord

    async def start(self) -> None:
        await super().start()  # creates the background task; it first runs after this method returns
        dialect = self._engine.dialect.name
        insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
        self._insert = (insert(_SHADOW_TABLE).on_conflict_do_nothing(index_elements=["request_id"])
                        .returning(_SHADOW_TABLE.c.request_id))


# ---------------------------------------------------------------- sampling and the workers


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


class ShadowRunner:
    def __init__(self, gw: Gateway, spool_path: Path, *, max_queue: int = 256, workers: int = 2,
                 drain_timeout_s: float = 10.0, rng: random.Random | None = None) -> None:
        self.gw = gw
        self.writer = ShadowEvalWriter(gw.config.database_url, spool_path)
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

    def ticket(self, request_id: str, route: RouteSpec, policy: Policy, body: dict, endpoint: str,
               decision: Decision) -> ShadowTicket | None:
        """At admission: a ticket for a sampled request, else None. Cheap unless sampled."""
        spec = route.shadow
        if spec is None or self._closing or self.rng.random() >= spec.sample_rate:
            return None
        reference = reference_of(body)
        if spec.judge == "exact" and reference is None:
            return None  # nothing to compare with: sample only requests that carry a reference
        payload = without_reference({k: v for k, v in body.items()
                                     if k not in ("_switchyard_chain", "stream", "stream_options")})
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
        route = ticket.route
        if served == route.easy:
            other, weak, strong = route.hard, answer, None
        elif served == route.hard:
            other, weak, strong = route.easy, None, answer
        else:  # served by a fallback: neither side of the pair
            SHADOW_EVENTS.labels("skipped_fallback").inc()
            return
        mirrored = await self._call(ticket, other, ticket.payload, ticket.endpoint, "shadow")
        if mirrored is None:
            SHADOW_EVENTS.labels("failed_upstream").inc()
            return
        weak, strong = (weak, mirrored) if weak is not None else (mirrored, strong)
        assert weak is not None and strong is not None
        judge = route.shadow.judge if route.shadow is not None else "exact"
        if judge == "exact":
            assert ticket.reference is not None
            weak_ok = normalise(weak) == normalise(ticket.reference)
            strong_ok = normalise(strong) == normalise(ticket.reference)
        else:
            question = conversation_text(ticket.payload, ticket.endpoint)
            verdicts = []
            for candidate in (weak, strong):
                reply = await self._call(ticket, judge, {
                    "model": ticket.payload.get("model", ""), "temperature": 0, "max_tokens": 4,
                    "messages": judge_messages(question, candidate, ticket.reference)}, "chat", "shadow_judge")
                verdicts.append(None if reply is None else parse_verdict(reply))
            if None in verdicts:
                SHADOW_EVENTS.labels("judge_unclear").inc()
                return
            weak_ok, strong_ok = verdicts
        body = ticket.payload
        self.writer.submit(ShadowRecord(
            request_id=ticket.request_id, created_at=datetime.now(UTC), route=route.name,
            endpoint=ENDPOINT_NAMES[ticket.endpoint], prompt_text=admission.prompt_text(body, ticket.endpoint),
            messages_json=orjson.dumps(body["messages"]).decode() if ticket.endpoint == "chat" else None,
            easy_backend=route.easy or "", hard_backend=route.hard or "", served_backend=served,
            weak_answer=weak, strong_answer=strong, weak_correct=bool(weak_ok), strong_correct=bool(strong_ok),
            judge=judge, difficulty=ticket.difficulty, threshold=ticket.threshold,
            model_version=ticket.model_version, policy_version=ticket.policy.version))
        SHADOW_EVENTS.labels("labelled").inc()

    async def _call(self, ticket: ShadowTicket, name: str, payload: dict, endpoint: str, reason: str) -> str | None:
        """One non-streamed call to a backend, logged in the ledger (no key: no budget pays). Its answer text."""
        gw = self.gw
        spec = ticket.policy.backends.get(name)
        backend = gw.pool.get(name)
        record = LedgerRecord(request_id="shadow_" + uuid.uuid4().hex, created_at=datetime.now(UTC),
                              endpoint=ENDPOINT_NAMES[endpoint], requested_model=str(ticket.payload.get("model", "")),
                              route=ticket.route.name, backend=name, stream=False,
                              policy_version=ticket.policy.version, difficulty=ticket.difficulty,
                              threshold=ticket.threshold, route_reason=reason)
        started = time.perf_counter()
        if backend is None or spec is None:
            record.status, record.error_type = "error", "backend_gone"
            gw.writer.submit(record)
            return None
        try:
            completion, _, attempts = await complete_with_fallbacks([backend], payload, endpoint, gw.breakers)
        except UpstreamError as exc:
            record.status, record.error_type, record.http_status = "error", f"upstream_{exc.kind}", exc.status
            record.attempts = max(1, exc.attempts)
            record.latency_ms = (time.perf_counter() - started) * 1000
            gw.writer.submit(record)
            return None
        record.attempts, record.http_status = attempts, 200
        record.latency_ms = (time.perf_counter() - started) * 1000
        record.served_model = completion.body.get("model") or spec.model
        pricing.charge(record, spec, completion.usage, completion.device_seconds, completion.utilisation,
                       ticket.policy, ticket.route)
        gw.writer.submit(record)
        return answer_text(completion.body)

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
            task.cancel()
        for task in self._workers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._workers = []
        await self.writer.close()
