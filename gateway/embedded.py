"""Embedded engines: `launch: embedded` backends run as supervised child processes of the gateway.

A child that dies is restarted with backoff; meanwhile its backend refuses connections, so the
gateway's circuit breaker and fallbacks route around it. Children die with the gateway (PDEATHSIG).
"""
from __future__ import annotations

import asyncio
import ctypes
import logging
import signal
import socket
import sys
from pathlib import Path

import httpx

from gateway import engine_args, metrics, settings
from gateway.policy import DEFAULT_ENGINE_MODEL_PATH, PACKAGE_PREFIX, BackendSpec, Policy

log = logging.getLogger("switchyard.embedded")

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def resolve_model_path(path: str) -> Path | str:
    """A relative path is tried from the working directory, then from the project root. A `package:NAME/FILE`
    reference is passed on as it is: the engine resolves it (the gateway does not import the engine)."""
    if path.startswith(PACKAGE_PREFIX):
        return path
    candidate = Path(path)
    if candidate.is_absolute() or candidate.exists():
        return candidate.resolve()
    return (settings.PROJECT_ROOT / candidate).resolve()


class EngineProcess:
    """One supervised `switchyard engine serve` child."""

    def __init__(self, spec: BackendSpec, log_dir: Path) -> None:
        self.spec = spec
        self.port = spec.engine_port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.log_path = log_dir / f"engine-{spec.name}.log"
        self._process: asyncio.subprocess.Process | None = None
        self._supervisor: asyncio.Task | None = None
        self._stopping = False
        self.restarts = 0

    def command(self) -> list[str]:
        model_dir = resolve_model_path(self.spec.engine_model_path or DEFAULT_ENGINE_MODEL_PATH)
        cmd = [sys.executable, "-m", "gateway.cli", "engine", "serve", "--model", str(model_dir),
               "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", self.spec.model]
        return cmd + engine_args.argv(self.spec.engine_args or {})  # checked when the policy loaded

    def start(self) -> None:
        self._supervisor = asyncio.create_task(self._supervise(), name=f"engine-{self.spec.name}")

    async def _supervise(self) -> None:
        backoff = 1.0
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        while not self._stopping:
            with open(self.log_path, "ab") as log_file:  # noqa: ASYNC230 — a local append, once per (re)start
                self._process = await asyncio.create_subprocess_exec(
                    *self.command(), stdin=asyncio.subprocess.DEVNULL, stdout=log_file, stderr=log_file,
                    preexec_fn=_die_with_parent)
            log.info("embedded engine %s started (pid %s) at %s; log %s", self.spec.name, self._process.pid,
                     self.base_url, self.log_path)
            started = asyncio.get_running_loop().time()
            code = await self._process.wait()
            if self._stopping:
                return
            if asyncio.get_running_loop().time() - started > 60:
                backoff = 1.0  # it ran for a while: this is a new failure, not a crash loop
            self.restarts += 1
            metrics.ENGINE_RESTARTS.labels(self.spec.name).inc()
            log.error("embedded engine %s exited with code %s; restarting in %.0f s (see %s)",
                      self.spec.name, code, backoff, self.log_path)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 30.0)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process and self._process.returncode is None else None

    async def wait_ready(self, timeout_s: float) -> bool:
        deadline = asyncio.get_running_loop().time() + timeout_s
        health = self.base_url.removesuffix("/v1") + "/health"
        async with httpx.AsyncClient(timeout=2.0) as client:
            while asyncio.get_running_loop().time() < deadline:
                try:
                    if (await client.get(health)).status_code == 200:
                        return True
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.25)
        return False

    async def stop(self) -> None:
        self._stopping = True
        process = self._process
        if process is not None and process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), timeout=10)
            except TimeoutError:
                process.kill()
                await process.wait()
        if self._supervisor is not None:
            self._supervisor.cancel()
            try:
                await self._supervisor
            except asyncio.CancelledError:
                pass


def _launch_key(spec: BackendSpec) -> tuple:
    return (spec.engine_model_path, spec.engine_port, spec.model, tuple(sorted((spec.engine_args or {}).items())))


class EmbeddedEngines:
    """The set of embedded engine children, kept in step with the policy."""

    def __init__(self, log_dir: Path) -> None:
        self._log_dir = log_dir
        self._processes: dict[str, EngineProcess] = {}

    async def sync(self, policy: Policy) -> dict[str, str]:
        wanted = {name: spec for name, spec in policy.backends.items()
                  if spec.kind == "engine" and spec.launch == "embedded"}
        for name in list(self._processes):
            if name not in wanted or _launch_key(wanted[name]) != _launch_key(self._processes[name].spec):
                await self._processes.pop(name).stop()
        for name, spec in wanted.items():
            if name not in self._processes:
                process = EngineProcess(spec, self._log_dir)
                process.start()
                self._processes[name] = process
        return {name: process.base_url for name, process in self._processes.items()}

    def processes(self) -> dict[str, EngineProcess]:
        return dict(self._processes)

    async def wait_ready(self, timeout_s: float) -> dict[str, bool]:
        names = list(self._processes)
        results = await asyncio.gather(*(self._processes[n].wait_ready(timeout_s) for n in names))
        return dict(zip(names, results, strict=True))

    async def stop_all(self) -> None:
        await asyncio.gather(*(process.stop() for process in self._processes.values()))
        self._processes.clear()
