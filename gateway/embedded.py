"""Embedded engines: `launch: embedded` backends run as supervised child processes of the gateway.

The gateway serves while its engines start: an engine is `starting` until its /health answers, and requests
skip it (to a fallback, or a 503 with Retry-After) until then. A child that dies is restarted with backoff; the
reason (its exit code and last stderr lines) goes to the gateway log at ERROR and to /health. Children die with
the gateway (PDEATHSIG) and are killed STOP_GRACE_S after a SIGTERM at shutdown.
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import httpx

from gateway import engine_args, metrics, settings
from gateway.listen_address import free_port
from gateway.policy import DEFAULT_ENGINE_MODEL_PATH, PACKAGE_PREFIX, BackendSpec, Policy
from gateway.tasks import cancel_and_wait

log = logging.getLogger("switchyard.embedded")

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def resolve_model_path(path: str) -> Path | str:
    """A relative path is tried from the working directory, then from the project root. A `package:NAME/FILE`
    reference is passed on as it is: the engine resolves it (the gateway does not import the engine)."""
    if path.startswith(PACKAGE_PREFIX):
        return path
    candidate = Path(path)
    if candidate.is_absolute() or candidate.exists():
        return candidate.resolve()
    return (settings.PROJECT_ROOT / candidate).resolve()


TAIL_LINES = 12  # stderr lines kept from each run: an argparse usage and its error, or a traceback's end
_LINE_CHARS = 500  # each clipped to this (a line can be a megabyte of logged tensor)
STOP_GRACE_S = 3.0  # SIGTERM, then SIGKILL: the gateway's own shutdown stays within seconds
_HEALTH_POLL_S = 0.25

EngineState = Literal["starting", "up", "restarting", "stopped"]


@dataclass(slots=True, frozen=True)
class EngineExit:
    """How a run of the engine ended: what /health shows and the gateway log says."""

    code: int
    at: float  # unix time
    ran_s: float
    stderr_tail: tuple[str, ...]

    def as_dict(self) -> dict:
        return {"code": self.code, "at": datetime.fromtimestamp(self.at, UTC).isoformat(timespec="seconds"),
                "ran_s": round(self.ran_s, 1), "stderr_tail": list(self.stderr_tail)}


class EngineProcess:
    """One supervised `switchyard engine serve` child: `starting` until its /health answers 200, then `up`;
    `restarting` (with the exit that ended it) while it waits out the backoff after a crash."""

    def __init__(self, spec: BackendSpec, log_dir: Path, replica: int | None = None) -> None:
        self.spec = spec
        self.port = spec.engine_port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        # One of a fleet's `replicas: N` (gateway/fleet.py): its own port and log
        self.name = spec.name if replica is None else f"{spec.name}/{replica}"
        self.log_path = log_dir / f"engine-{self.name.replace('/', '-')}.log"
        self._process: asyncio.subprocess.Process | None = None
        self._supervisor: asyncio.Task | None = None
        self._stopping = False
        self._ready = asyncio.Event()
        self.state: EngineState = "starting"
        self.restarts = 0
        self.last_exit: EngineExit | None = None
        self._restart_at = 0.0  # loop time of the next start, while restarting

    def command(self) -> list[str]:
        model_dir = resolve_model_path(self.spec.engine_model_path or DEFAULT_ENGINE_MODEL_PATH)
        cmd = [sys.executable, "-m", "gateway.cli", "engine", "serve", "--model", str(model_dir),
               "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", self.spec.model]
        return cmd + engine_args.argv(self.spec.engine_args or {})  # checked when the policy loaded

    def start(self) -> None:
        self._supervisor = asyncio.create_task(self._supervise(), name=f"engine-{self.name}")

    async def _supervise(self) -> None:
        backoff = 1.0
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        loop = asyncio.get_running_loop()
        while not self._stopping:
            self.state = "starting"
            started = loop.time()
            code, tail = await self._run_once()
            if self._stopping:
                return
            ran = loop.time() - started
            if ran > 60:
                backoff = 1.0  # it ran for a while: this is a new failure, not a crash loop
            self.restarts += 1
            self.last_exit = EngineExit(code, time.time(), ran, tuple(tail))
            self.state, self._restart_at = "restarting", loop.time() + backoff
            self._ready.clear()
            metrics.ENGINE_RESTARTS.labels(self.name).inc()
            said = "\n".join(f"    {line}" for line in tail) or "    (nothing on stderr)"
            log.error("embedded engine %s exited with code %s after %.1f s; restarting in %.0f s (log %s). "
                      "Its last stderr lines:\n%s", self.name, code, ran, backoff, self.log_path, said)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 30.0)

    async def _run_once(self) -> tuple[int, list[str]]:
        """Start the child, mark it up once healthy, wait for it to exit: (exit code, its last stderr lines).
        stderr goes to the log file as before, through a pipe that keeps its tail."""
        with open(self.log_path, "ab") as log_file:  # noqa: ASYNC230 — a local append, once per (re)start
            self._process = process = await asyncio.create_subprocess_exec(
                *self.command(), stdin=asyncio.subprocess.DEVNULL, stdout=log_file,
                stderr=asyncio.subprocess.PIPE, preexec_fn=_die_with_parent)
        log.info("embedded engine %s started (pid %s) at %s; log %s", self.name, process.pid,
                 self.base_url, self.log_path)
        tail: deque[str] = deque(maxlen=TAIL_LINES)
        assert process.stderr is not None
        pump = asyncio.create_task(_pump(process.stderr, self.log_path, tail))
        watch = asyncio.create_task(self._watch_health())
        try:
            code = await process.wait()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(pump), 2.0)  # what it wrote last, unless a grandchild holds it
        finally:
            await cancel_and_wait(watch)
            await cancel_and_wait(pump)
        return code, list(tail)

    async def _watch_health(self) -> None:
        health = self.base_url.removesuffix("/v1") + "/health"
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                try:
                    if (await client.get(health)).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(_HEALTH_POLL_S)
        self.state = "up"
        self._ready.set()
        log.info("embedded engine %s is healthy at %s", self.name, self.base_url)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process and self._process.returncode is None else None

    def retry_after_s(self) -> float | None:
        """None while it serves; else about how long a client should wait (a start takes seconds)."""
        if self.state == "up":
            return None
        if self.state == "restarting":
            return max(self._restart_at - asyncio.get_running_loop().time(), 0.0) + _START_ESTIMATE_S
        return _START_ESTIMATE_S

    def details(self) -> dict:
        return {"state": self.state, "pid": self.pid, "restarts": self.restarts,
                "last_exit": self.last_exit.as_dict() if self.last_exit else None}

    async def wait_ready(self, timeout_s: float) -> bool:
        """True once the engine is healthy (now, or within `timeout_s`)."""
        try:
            await asyncio.wait_for(self._ready.wait(), timeout_s)
        except TimeoutError:
            return False
        return not self._stopping

    async def stop(self) -> None:
        self._stopping = True
        self.state = "stopped"
        self._ready.set()  # wake any waiter: it reads _stopping
        process = self._process
        if process is not None and process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), timeout=STOP_GRACE_S)
            except TimeoutError:
                log.warning("embedded engine %s did not stop within %.0f s of SIGTERM; killing it",
                            self.name, STOP_GRACE_S)
                process.kill()
                await process.wait()
        await cancel_and_wait(self._supervisor)


_START_ESTIMATE_S = 5.0  # Retry-After for a starting engine: a small model loads in seconds


async def _pump(stream: asyncio.StreamReader, log_path: Path, tail: deque[str]) -> None:
    """Copy the child's stderr to its log file, keeping the last lines (decoded, clipped) in `tail`."""
    carry = b""
    with open(log_path, "ab") as log_file:  # noqa: ASYNC230 — small local appends, as the child writes
        while chunk := await stream.read(65536):
            log_file.write(chunk)
            log_file.flush()
            *lines, carry = (carry + chunk).split(b"\n")
            tail.extend(_line(raw) for raw in lines if raw.strip())
            carry = carry[-_LINE_CHARS * 4:]
        if carry.strip():
            tail.append(_line(carry))


def _line(raw: bytes) -> str:
    text = raw.decode("utf-8", "replace").rstrip()
    return text if len(text) <= _LINE_CHARS else text[:_LINE_CHARS - 1] + "…"


def _launch_key(spec: BackendSpec) -> tuple:
    return (spec.engine_model_path, spec.engine_port, spec.model, tuple(sorted((spec.engine_args or {}).items())),
            spec.replicas)


def _process_names(spec: BackendSpec) -> list[tuple[str, int | None]]:
    """(process name, replica index): the backend's name alone, or NAME/0 … NAME/N-1 for `replicas: N` > 1."""
    if (spec.replicas or 1) < 2:
        return [(spec.name, None)]
    return [(f"{spec.name}/{i}", i) for i in range(spec.replicas or 1)]


class EmbeddedEngines:
    """The set of embedded engine children, kept in step with the policy."""

    def __init__(self, log_dir: Path) -> None:
        self._log_dir = log_dir
        self._processes: dict[str, EngineProcess] = {}

    async def sync(self, policy: Policy) -> dict[str, str]:
        """Start and stop children to match the policy: {backend name: its URL} (a fleet's: fleet_bases)."""
        wanted = {process: (spec, replica) for spec in policy.backends.values()
                  if spec.kind == "engine" and spec.launch == "embedded" for process, replica in _process_names(spec)}
        for name in list(self._processes):
            if name not in wanted or _launch_key(wanted[name][0]) != _launch_key(self._processes[name].spec):
                await self._processes.pop(name).stop()
        for name, (spec, replica) in wanted.items():
            if name not in self._processes:
                process = EngineProcess(spec, self._log_dir, replica)
                process.start()
                self._processes[name] = process
        return {name: process.base_url for name, process in self._processes.items() if name == process.spec.name}

    def fleet_bases(self, backend: str) -> list[str] | None:
        """The URLs of an embedded fleet's replicas (`replicas: N` > 1), in order; None for any other backend."""
        replicas = self._replicas(backend)
        return [p.base_url for p in replicas] if replicas else None

    def _replicas(self, backend: str) -> list[EngineProcess]:
        prefix = backend + "/"
        return [p for name, p in self._processes.items() if name.startswith(prefix) and p.spec.name == backend]

    def processes(self) -> dict[str, EngineProcess]:
        return dict(self._processes)

    def retry_after_s(self, name: str) -> float | None:
        """For an embedded engine that is not serving yet (starting, or restarting after a crash): about when to
        try again. None for any other backend."""
        process = self._processes.get(name)
        if process is None:  # a fleet serves while any replica does (the fleet ejects those not up yet)
            waits = [p.retry_after_s() for p in self._replicas(name)]
            return None if not waits or None in waits else min(w for w in waits if w is not None)
        return process.retry_after_s()

    async def wait_ready(self, timeout_s: float) -> dict[str, bool]:
        names = list(self._processes)
        results = await asyncio.gather(*(self._processes[n].wait_ready(timeout_s) for n in names))
        return dict(zip(names, results, strict=True))

    async def stop_all(self) -> None:
        await asyncio.gather(*(process.stop() for process in self._processes.values()))
        self._processes.clear()
