"""Server processes for the benchmarks: start one with its output in a log file, wait until it answers, stop it.

Each process gets its own session, so stop() reaches the workers it forks; a process that dies before it is
ready fails the wait at once with the tail of its log instead of a time-out.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def start(cmd: list[str], env: dict | None, log: Path) -> subprocess.Popen:
    """Run `cmd` from the repository root with `env` over ours, stdout and stderr into `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        process = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT,
                                   cwd=ROOT, start_new_session=True)
    process.log = log  # type: ignore[attr-defined]  # where log_tail() reads
    return process


def log_tail(process: subprocess.Popen, lines: int = 20) -> str:
    log = getattr(process, "log", None)
    if log is None or not Path(log).exists():
        return ""
    return "\n".join(Path(log).read_text(errors="replace").splitlines()[-lines:])


def _check_alive(process: subprocess.Popen | None, what: str) -> None:
    if process is not None and process.poll() is not None:
        raise RuntimeError(f"{what}: the process exited with {process.returncode} before it was ready\n"
                           f"{log_tail(process)}")


def wait_http(url: str, timeout: float, headers: dict | None = None,
              process: subprocess.Popen | None = None) -> None:
    """Until GET `url` answers 200 (TimeoutError after `timeout` s; RuntimeError when `process` has died)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        _check_alive(process, url)
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2, headers=headers).status_code == 200:
                return
        time.sleep(0.25)
    raise TimeoutError(f"{url} not ready after {timeout:.0f} s")


def wait_port(port: int, timeout: float, process: subprocess.Popen | None = None) -> None:
    """Until 127.0.0.1:`port` accepts a connection."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        _check_alive(process, f"port {port}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.1)
    raise TimeoutError(f"port {port} not accepting connections after {timeout:.0f} s")


def stop(process: subprocess.Popen, timeout: float = 30) -> None:
    """SIGINT to the process group (a clean shutdown: ledgers flushed), SIGKILL after `timeout` s."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@contextlib.contextmanager
def running(cmd: list[str], log: Path, ready_url: str, *, env: dict | None = None,
            timeout: float = 120) -> Iterator[subprocess.Popen]:
    """A started process that answered `ready_url`, stopped on the way out."""
    process = start(cmd, env, log)
    try:
        wait_http(ready_url, timeout, process=process)
        yield process
    finally:
        stop(process)
