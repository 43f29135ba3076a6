"""AsyncLLMEngine: one LLMEngine driven by a dedicated thread, consumed from asyncio.

The engine thread owns the LLMEngine (which is not thread-safe): it applies queued add/abort commands,
runs `step()` while there is work, and hands each step's outputs to the event loop in one
`call_soon_threadsafe`. The event loop therefore never waits on a forward pass. The hand-over waits until the
next step's inputs are built and its forward is about to start (at once if no forward follows, or a request
finished): the loop's work on the tokens then overlaps the forward, whose native code has dropped the GIL, rather
than contending for the GIL with the next step's scheduling (batch-1 int8 streamed: 1.00 -> 0.82 ms per step
outside the native step, bench/engine_server_overhead.py).

Admission control: when the requests queued ahead of the engine plus those waiting inside it reach
`max_waiting`, `generate` raises `EngineOverloaded` (the server answers 429 with Retry-After) instead of
letting the queue, and memory, grow.

Busy fraction: seconds the engine spent in forward passes over the last `busy_window_s` of wall time.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import torch

from hosted.engine import BurstInterrupt, EngineConfig, EngineStats, LLMEngine, StepOutput
from hosted.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineOverloaded(RuntimeError):
    """Too many requests are waiting; retry after `retry_after` seconds."""

    def __init__(self, waiting: int, limit: int, retry_after: float) -> None:
        super().__init__(f"the engine is overloaded: {waiting} requests are waiting (limit {limit}); "
                         f"retry in {retry_after:.0f} s")
        self.waiting = waiting
        self.limit = limit
        self.retry_after = retry_after


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shutdown or a failed step); no request can be served."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    future: asyncio.Future


@dataclass(slots=True)
class _Abort:
    request_id: str


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, *, max_waiting: int = 256, busy_window_s: float = 60.0) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.busy_window_s = busy_window_s
        self.max_model_len: int = engine.max_model_len
        bm = engine.block_manager
        # The longest prompt + output one request can have: the context, and what the KV pool can hold
        # (the last generated token never needs KV).
        self.max_request_tokens: int = min(engine.max_model_len, bm.num_blocks * bm.block_size + 1)
        self._torch_threads = torch.get_num_threads()  # set again on the engine thread (hosted/threads.py)
        self._cv = threading.Condition()
        self._commands: collections.deque[_Add | _Abort] = collections.deque()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self.dead: BaseException | None = None
        self._streams: dict[str, asyncio.Queue] = {}
        # Requests submitted whose first output has not arrived yet (loop thread only): exact at the moment
        # of admission, unlike the engine's own count, which the thread refreshes once per step.
        self._num_queued = 0
        self._add_futures: set[asyncio.Future] = set()
        self._stats: EngineStats = engine.stats()
        self._started_at = time.monotonic()
        # (wall time at the end of a step, busy seconds in it); (wall time, 1) per finished request
        self._busy_events: collections.deque[tuple[float, float]] = collections.deque()
        self._finish_events: collections.deque[float] = collections.deque()
        self._busy_lock = threading.Lock()
        self._pending: list[StepOutput] = []  # the last step's outputs, not handed to the loop yet (engine thread)
        self._burst_s = engine.config.decode_burst_ms / 1000.0  # see EngineConfig.decode_burst_ms
        self._interrupt = BurstInterrupt()  # raised with every command: a burst ends for it after its current step

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs) -> AsyncLLMEngine:
        return cls(LLMEngine(config), **kwargs)

    # ------------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the engine thread, bound to the running event loop. Idempotent."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="switchyard-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop the thread after its current step; requests still streaming get EngineDeadError."""
        with self._cv:
            self._stopping = True
            self._interrupt.set()
            self._cv.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self._fail_all(EngineDeadError("the engine is shutting down"))

    @property
    def alive(self) -> bool:
        return self.dead is None and not self._stopping

    # ------------------------------------------------------------------------------ requests
    @property
    def num_waiting(self) -> int:
        # The engine's count also holds preempted sequences (which have produced tokens already).
        return max(self._num_queued, self._stats.num_waiting)

    def admit(self, count: int = 1) -> Admission:
        """Reserve queue places for `count` requests, or raise EngineOverloaded. Pass the Admission to
        `generate` (each call takes one place); `release()` gives back places never used."""
        waiting = self.num_waiting
        if waiting + count > self.max_waiting:
            raise EngineOverloaded(waiting, self.max_waiting, self.retry_after_seconds())
        self._num_queued += count
        return Admission(self, count)

    def retry_after_seconds(self) -> float:
        """About when a queue place frees up: the places over the bound / recent requests finished per second
        (1-60 s; 2 s before anything has finished)."""
        now = time.monotonic()
        window = min(self.busy_window_s, max(now - self._started_at, 1e-3))
        with self._busy_lock:
            finished = sum(1 for t in self._finish_events if t > now - window)
        rate = finished / window
        if rate <= 0:
            return 2.0
        excess = max(1, self.num_waiting - self.max_waiting + 1)
        return float(min(60, max(1, math.ceil(excess / rate))))

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *,
                       admission: Admission | None = None) -> AsyncIterator[StepOutput]:
        """Submit a request and yield its StepOutputs until it finishes. ValueError if the engine refuses
        it; EngineOverloaded if the waiting bound is reached (unless a place was reserved with `admit`).
        Closing the iterator early (client gone, stop string) aborts the request and frees its blocks."""
        if not self.alive:
            raise EngineDeadError(f"the engine is not running: {self.dead or 'shut down'}")
        self.start()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        if admission is None:
            admission = self.admit(1)
        admission.take()  # this request now owns one queued place, given back at its first output
        queued = True
        assert self._loop is not None
        queue: asyncio.Queue = asyncio.Queue()
        future = self._loop.create_future()
        self._streams[request_id] = queue
        self._add_futures.add(future)
        finished = False
        try:
            self._submit(_Add(request_id, list(prompt_ids), params, future))
            try:
                await future
            finally:
                self._add_futures.discard(future)
            while True:
                item = await queue.get()
                if queued:
                    self._num_queued -= 1
                    queued = False
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if queued:
                self._num_queued -= 1
            self._streams.pop(request_id, None)
            if not finished:
                self._submit(_Abort(request_id))

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its blocks are freed before the engine's next step."""
        self._submit(_Abort(request_id))

    def _submit(self, command: _Add | _Abort) -> None:
        with self._cv:
            self._commands.append(command)
            self._interrupt.set()
            self._cv.notify()

    # ------------------------------------------------------------------------------ introspection
    def stats(self) -> EngineStats:
        """The engine's counters as of its last step (a copy; safe from any thread)."""
        return replace(self._stats)

    def utilisation(self) -> float:
        """Busy seconds / wall seconds over the last busy_window_s (or since start, if shorter)."""
        now = time.monotonic()
        window = min(self.busy_window_s, max(now - self._started_at, 1e-6))
        start = now - window
        with self._busy_lock:
            busy = sum(b for t, b in self._busy_events if t > start)
        return max(0.0, min(1.0, busy / window))

    # ------------------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        torch.set_num_threads(self._torch_threads)  # OpenMP's thread count is per thread
        engine = self.engine
        has_work = False
        try:
            while True:
                with self._cv:
                    while not self._commands and not has_work and not self._stopping:
                        self._cv.wait()
                    if self._stopping:
                        return
                    commands = list(self._commands)
                    self._commands.clear()
                    self._interrupt.clear()
                self._apply(commands)
                if engine.has_unfinished():
                    busy_before = self._stats.busy_seconds
                    # A step's outputs go to the event loop when the next step's forward starts: the loop's work on
                    # them (detokenizing, SSE) then runs while the forward's native code has dropped the GIL,
                    # instead of contending for it with the next step's Python. Without a next forward, at once.
                    outputs = engine.step(before_forward=self._send_pending, burst_s=self._burst_s,
                                          interrupt=self._interrupt)
                    self._send_pending()
                    self._stats = engine.stats()
                    self._record(self._stats.busy_seconds - busy_before, outputs)
                    self._pending = outputs
                else:
                    self._stats = engine.stats()
                has_work = engine.has_unfinished()
                if not has_work or any(out.finished for out in self._pending):
                    self._send_pending()
        except Exception as exc:  # a failed step must reach every waiting client
            log.exception("engine step failed; the engine is stopping")
            self.dead = exc
            if self._loop is not None and not self._loop.is_closed():
                self._send_pending()
                self._loop.call_soon_threadsafe(self._fail_all, EngineDeadError(f"engine failure: {exc!r}"))

    def _send_pending(self) -> None:
        """Hand the outputs kept back from the last step to the event loop (engine thread)."""
        if self._pending:
            outputs, self._pending = self._pending, []
            self._loop.call_soon_threadsafe(self._deliver, outputs)  # type: ignore[union-attr]

    def _apply(self, commands: list[_Add | _Abort]) -> None:
        loop = self._loop
        assert loop is not None
        for cmd in commands:
            if isinstance(cmd, _Abort):
                self.engine.abort_request(cmd.request_id)
                continue
            try:
                self.engine.add_request(cmd.request_id, cmd.prompt_ids, cmd.params)
            except Exception as exc:  # noqa: BLE001 - handed to the caller, which answers 400
                loop.call_soon_threadsafe(_settle, cmd.future, exc)
            else:
                loop.call_soon_threadsafe(_settle, cmd.future, None)

    def _record(self, busy: float, outputs: list[StepOutput]) -> None:
        now = time.monotonic()
        cutoff = now - self.busy_window_s
        with self._busy_lock:
            if busy > 0:
                self._busy_events.append((now, busy))
            for out in outputs:
                if out.finished and out.finish_reason != "abort":
                    self._finish_events.append(now)
            while self._busy_events and self._busy_events[0][0] < cutoff:
                self._busy_events.popleft()
            while self._finish_events and self._finish_events[0] < cutoff:
                self._finish_events.popleft()

    # ------------------------------------------------------------------------------ loop side
    def _deliver(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            queue = self._streams.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def _fail_all(self, exc: BaseException) -> None:
        for future in list(self._add_futures):
            _settle(future, exc)
        for queue in self._streams.values():
            queue.put_nowait(exc)


class Admission:
    """Queue places reserved by AsyncLLMEngine.admit for the sequences of one client request."""

    __slots__ = ("_engine", "left")

    def __init__(self, engine: AsyncLLMEngine, count: int) -> None:
        self._engine = engine
        self.left = count

    def take(self) -> None:
        if self.left <= 0:
            raise RuntimeError("this admission has no place left")
        self.left -= 1

    def release(self) -> None:
        """Give back the places no generate() call took (idempotent)."""
        self._engine._num_queued -= self.left
        self.left = 0


def _settle(future: asyncio.Future, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)


async def collect(stream: AsyncIterator[StepOutput]) -> list[StepOutput]:
    """Drain a generate() stream (tests, scripts)."""
    out = []
    async with contextlib.aclosing(stream) as s:  # type: ignore[type-var]
        async for item in s:
            out.append(item)
    return out
