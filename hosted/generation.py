"""Fan-out of one request: one engine sequence per (prompt, choice), run as tasks whose outputs merge into
one stream of events, and the request's usage, timings and device seconds once it is done.

With `n > 1` the first sequence of a prompt runs alone until its prompt is in the KV cache, then the others
start and reuse it through the prefix cache. A request of one sequence (the common case) needs no merging: its
events come straight from the engine's stream inside `iterate`, without a task and a queue between them (one
task switch less per streamed token on the event loop, which shares the cores with the engine).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from hosted.async_llm_engine import Admission, AsyncLLMEngine, EngineDeadError
from hosted.detokenizer import TextStream
from hosted.engine import StepOutput
from hosted.metrics import EngineMetrics, device_kind
from hosted.request_plan import Plan, PromptJob
from hosted.sampling_params import SamplingParams
from hosted.tokenizer import Tokenizer


@dataclass(slots=True)
class Choice:
    index: int
    job: PromptJob
    stream: TextStream
    request_id: str
    num_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_restored_host_tokens: int = 0  # of num_cached_tokens, restored from the KV tiers (hosted/kv_tiers.py)
    num_restored_disk_tokens: int = 0
    device_seconds: float = 0.0
    spec_proposed: int = 0  # speculative decoding: draft tokens verified for this choice
    spec_accepted: int = 0
    finish_reason: str | None = None
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    t_first: float | None = None
    t_last: float | None = None


@dataclass(slots=True)
class Event:
    choice: Choice
    text: str
    logprobs: list[tuple[int, float, list[tuple[int, float]]]]
    finish_reason: str | None


class Generation:
    """Runs every sequence of one request as tasks and merges their events into one queue."""

    def __init__(self, engine: AsyncLLMEngine, tokenizer: Tokenizer, plan: Plan, admission: Admission,
                 t_arrival: float) -> None:
        self.engine = engine
        self.plan = plan
        self.admission = admission
        self.choices = _choices(plan, tokenizer)
        self.events: asyncio.Queue[Event | BaseException | None] = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []
        self.inline = len(self.choices) == 1  # one sequence: iterate() runs it itself (start() makes no task)
        self.outcome: str | None = None  # "success" | "error" | "aborted" once the response is decided
        self.t_start = t_arrival
        self.t_first_token: float | None = None

    def start(self) -> None:
        if self.inline:
            return
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

    async def _run(self, choice: Choice, opens: asyncio.Event | None, waits: asyncio.Event | None) -> None:
        """One sequence of a request of several, as a task feeding the merged queue."""
        try:
            if waits is not None:
                await waits.wait()
            async with contextlib.aclosing(self._sequence(choice, opens)) as events:  # type: ignore[type-var]
                async for event in events:
                    self.events.put_nowait(event)
        except Exception as exc:  # noqa: BLE001 - reported to the request's consumer
            self.events.put_nowait(exc)
        finally:
            if opens is not None:
                opens.set()
            self.events.put_nowait(None)

    async def _sequence(self, choice: Choice, opens: asyncio.Event | None) -> AsyncIterator[Event]:
        """The events of one sequence, from its engine stream (closing this closes, and so aborts, that)."""
        stream = self.engine.generate(choice.request_id, choice.job.ids, choice.job.params, admission=self.admission)
        async with contextlib.aclosing(stream) as outputs:  # type: ignore[type-var]
            async for out in outputs:
                if opens is not None:
                    opens.set()
                event = self._consume(choice, out)
                if event is not None:
                    yield event
                if choice.finish_reason is not None:
                    break

    def _consume(self, choice: Choice, out: StepOutput) -> Event | None:
        now = time.monotonic()
        tokens = out.new_token_ids
        choice.num_prompt_tokens = out.num_prompt_tokens
        choice.num_cached_tokens = out.num_cached_tokens
        choice.num_restored_host_tokens = out.num_restored_host_tokens
        choice.num_restored_disk_tokens = out.num_restored_disk_tokens
        choice.device_seconds = out.device_seconds
        choice.spec_proposed = out.spec_proposed
        choice.spec_accepted = out.spec_accepted
        # The token that ended the request with "stop" is EOS or a stop token id: counted, not rendered.
        text_tokens = tokens[:-1] if out.finished and out.finish_reason == "stop" else tokens
        text, used = _push(choice.stream, text_tokens)
        if used < len(text_tokens):  # a stop string ended the text before the last of this step's tokens
            tokens = tokens[:used]
        if tokens:
            choice.num_tokens += len(tokens)
            if choice.t_first is None:
                choice.t_first = now
                if self.t_first_token is None:
                    self.t_first_token = now
            choice.t_last = now
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
            lps = [(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs[:len(tokens)]]
            choice.logprobs.extend(lps)
        if text:
            choice.text_parts.append(text)
        if finish is not None:
            choice.finish_reason = finish
        if not text and not lps and finish is None:
            return None
        return Event(choice, text, lps, finish)

    async def iterate(self) -> AsyncIterator[Event]:
        """Yield events until every sequence is done; re-raise the first failure."""
        if self.inline:
            try:
                async with contextlib.aclosing(self._sequence(self.choices[0], None)) as events:  # type: ignore[type-var]
                    async for event in events:
                        yield event
            finally:
                self.admission.release()
            return
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

    async def drain(self) -> None:
        """Run every sequence to its end (a non-streamed response reads the choices afterwards)."""
        async with contextlib.aclosing(self.iterate()) as events:  # type: ignore[type-var]
            async for _ in events:
                pass

    # ---------------------------------------------------------------- summaries
    def usage(self) -> dict[str, Any]:
        prompt = sum(len(job.ids) for job in self.plan.jobs)
        firsts = [self.choices[p * self.plan.n] for p in range(len(self.plan.jobs))]
        cached = sum(c.num_cached_tokens for c in firsts)  # restored tokens included: priced as cached
        host = sum(c.num_restored_host_tokens for c in firsts)
        disk = sum(c.num_restored_disk_tokens for c in firsts)
        completion = sum(c.num_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached},
                # Where the prompt's KV came from: computed now, the device's prefix cache, or restored from the
                # host-memory / disk KV tiers (switchyard's own field; cached_tokens = the last three).
                "switchyard_prompt_tokens": {"computed": prompt - cached, "device_cache": cached - host - disk,
                                             "restored_host": host, "restored_disk": disk}}

    def extension(self) -> dict[str, Any]:
        ext: dict[str, Any] = {"device_seconds": round(sum(c.device_seconds for c in self.choices), 6),
                               "utilisation": round(self.engine.utilisation(), 6)}
        device = getattr(self.engine.engine, "device", None)
        if device is not None:  # what this request ran on: the gateway prices the row by it, not by a scrape
            ext["device_kind"] = device_kind(str(getattr(device, "type", device)))
        if self.engine.engine.config.spec_method is not None:
            ext["spec_proposed"] = sum(c.spec_proposed for c in self.choices)
            ext["spec_accepted"] = sum(c.spec_accepted for c in self.choices)
        return ext

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


def _push(stream: TextStream, tokens: list[int]) -> tuple[str, int]:
    """Push a step's tokens (several when drafts were accepted) one at a time, stopping at a stop string;
    returns the text and how many tokens it took."""
    if len(tokens) <= 1:
        return stream.push(tokens), len(tokens)
    parts = []
    for i, token in enumerate(tokens):
        parts.append(stream.push([token]))
        if stream.stopped:
            return "".join(parts), i + 1
    return "".join(parts), len(tokens)


def _choices(plan: Plan, tokenizer: Tokenizer) -> list[Choice]:
    """One choice per (prompt, j < n), indexed prompt-major as OpenAI numbers them."""
    choices = []
    for p, job in enumerate(plan.jobs):
        for j in range(plan.n):
            job_j = job
            if job.params.seed is not None and plan.n > 1:
                # Distinct but reproducible streams per choice.
                params = _replace_seed(job.params, (job.params.seed + j) % (2**63))
                job_j = PromptJob(job.ids, params, job.context_ids, job.echo_text)
            choices.append(Choice(index=p * plan.n + j, job=job_j,
                                  stream=TextStream(tokenizer, plan.stop, context_ids=job.context_ids),
                                  request_id=f"{plan.request_id}-{p}-{j}"))
    return choices


def _replace_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return dataclasses.replace(params, seed=seed, stop_token_ids=list(params.stop_token_ids))
