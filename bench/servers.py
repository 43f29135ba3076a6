"""Server processes for the benchmarks: start one with its output in a log file, wait until it answers, stop it.

Each process gets its own session, so stop() reaches the workers it forks; a process that dies before it is
ready fails the wait at once with the tail of its log instead of a time-out. The log's first line is the command.
bench/peers.py's servers (llama.cpp, vLLM, ours) start and stop through here too.
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


def start(cmd: list[str], env: dict | None, log: Path, cwd: Path | None = ROOT) -> subprocess.Popen:
    """Run `cmd` in `cwd` (the repository root; None: ours) with `env` over ours, stdout and stderr into `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        out.write(f"$ {' '.join(map(str, cmd))}\n")
        out.flush()
        process = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, cwd=cwd, start_new_session=True)
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
    """SIGINT to the process group (a clean shutdown: ledgers flushed), SIGTERM after `timeout` s, SIGKILL 10 s
    later; then whatever of its group outlived it (vLLM's engine core) is killed."""
    if process.poll() is None:
        for sig, wait in ((signal.SIGINT, timeout), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


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
