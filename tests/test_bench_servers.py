"""bench/servers.py's start/wait/stop, and bench/peers.py's servers built on it, with real subprocesses: a tiny
HTTP server (python -m http.server), one that dies at start-up, one that never answers, and a process group
whose child outlives its leader."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import httpx
import pytest

from bench import peers, servers


class _TinyServer(peers._Server):
    """The peers' server class around `cmd` (the llama.cpp and vLLM servers differ only in cmd and env)."""

    name = "tiny"
    ready_path = "/"

    def __init__(self, log_dir: Path, script: str | None = None, startup_timeout_s: float = 60.0) -> None:
        super().__init__()
        self.log_dir = log_dir
        self.startup_timeout_s = startup_timeout_s
        self.cmd = ([sys.executable, "-c", script] if script else
                    [sys.executable, "-m", "http.server", str(self.port), "--bind", "127.0.0.1"])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_peer_server_starts_answers_logs_its_command_and_stops(tmp_path):
    with _TinyServer(tmp_path) as server:
        pid = server.proc.pid
        assert httpx.get(server.base_url + "/", timeout=5).status_code == 200
        assert server.startup_s is not None and server.startup_s >= 0
        assert server.logfile.parent == tmp_path
        assert server.logfile.read_text().splitlines()[0] == "$ " + " ".join(server.cmd)
    assert server.proc is None and not _alive(pid)
    with pytest.raises(httpx.HTTPError):
        httpx.get(server.base_url + "/", timeout=2)


def test_a_peer_server_that_dies_at_startup_says_how_with_its_log(tmp_path):
    server = _TinyServer(tmp_path, "import sys; print('no such model file', flush=True); sys.exit(3)")
    started = time.monotonic()
    with pytest.raises(RuntimeError) as failed:
        server.start()
    assert time.monotonic() - started < 30  # not the start-up time-out
    assert "tiny exited with 3 during startup" in str(failed.value)  # engine_peers' --no-repack retry reads it
    assert "no such model file" in str(failed.value) and server.proc is None


def test_a_peer_server_never_ready_is_stopped_and_named(tmp_path):
    server = _TinyServer(tmp_path, "import time; print('warming up', flush=True); time.sleep(120)",
                         startup_timeout_s=1.0)
    with pytest.raises(RuntimeError) as failed:
        server.start()
    assert "tiny not ready after 1 s" in str(failed.value) and "warming up" in str(failed.value)
    assert server.proc is None


def test_stop_ends_a_child_that_outlives_its_leader(tmp_path):
    """The leader exits on SIGINT; its child ignores SIGINT (as vLLM's engine core may): stop() ends it too."""
    child_pid = tmp_path / "child.pid"
    child = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(120)"
    leader = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {child!r}]); "
              f"open({str(child_pid)!r}, 'w').write(str(p.pid)); time.sleep(120)")
    process = servers.start([sys.executable, "-c", leader], None, tmp_path / "group.log")
    deadline = time.monotonic() + 30
    while not (child_pid.exists() and child_pid.read_text()):
        assert time.monotonic() < deadline and process.poll() is None, servers.log_tail(process)
        time.sleep(0.05)
    pid = int(child_pid.read_text())
    time.sleep(0.5)  # the child has set its SIGINT handler
    servers.stop(process, timeout=10)
    assert process.returncode is not None
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def test_the_cheaper_peers_table_records_each_configuration_its_way(tmp_path, monkeypatch):
    """bench/cheaper/peers.py's one table run: a configuration without a file, one measured on its live server,
    one whose server dies at start-up, and (the budget spent) one skipped."""
    from bench.cheaper import peers as cheaper

    logged: list[str] = []

    def measure(server, row: dict) -> None:
        row["status"] = httpx.get(server.base_url + "/", timeout=5).status_code

    dying = "raise SystemExit(3)"
    rows = cheaper._table([("BF16", {"precision": "BF16"}, "no BF16 file"),
                           ("tiny F32", {"precision": "F32"}, lambda: _TinyServer(tmp_path)),
                           ("tiny Q8_0", {"precision": "Q8_0"}, lambda: _TinyServer(tmp_path, dying))],
                          measure, logged.append)
    assert rows[0] == {"precision": "BF16", "error": "no BF16 file"}
    assert rows[1]["status"] == 200 and rows[1]["startup_s"] >= 0 and "http.server" in rows[1]["cmd"]
    assert Path(rows[1]["log"]).parent == tmp_path and "error" not in rows[1]
    assert rows[2]["error"] == "RuntimeError: tiny exited with 3 during startup" and "status" not in rows[2]
    assert logged == [f"peers: tiny Q8_0 failed: {rows[2]['error']}"]
    monkeypatch.setattr(cheaper, "_DEADLINE", [0.0])  # the section's budget spent
    late_config = ("tiny F32", {"precision": "F32"}, lambda: _TinyServer(tmp_path))
    [late] = cheaper._table([late_config], measure, logged.append)
    assert late["skipped"] and "budget" in late["error"] and "status" not in late
