"""`switchyard serve` starting in bad conditions, as real subprocesses: a bad or busy port is one line and no
banner; an unreachable database does not stop it (it serves, spools, and migrates and replays once the database
answers); SIGTERM in any start-up state ends it in seconds."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from gateway import db
from gateway.testing.tcp_proxy import TcpProxy
from tests.conftest import fresh_pg_database
from tests.e2e.conftest import free_port, run_cli, wait_http

MASTER = "sk-test-serve-master"
POLICY = """\
backends:
  api:
    kind: engine
    model: demo-model
    api_base: {standin}
    gpu_hour_usd: 3.6
routes:
  local:
    strategy: fixed
    backend: api
"""


class Serve:
    """A `switchyard serve` subprocess whose output is collected as it comes (stdout and stderr together)."""

    def __init__(self, tmp_path: Path, *args: str, master: str | None = MASTER, env: dict | None = None) -> None:
        full_env = {**os.environ, "SWITCHYARD_DATA_DIR": str(tmp_path / "data"), **(env or {})}
        for name in ("SWITCHYARD_MASTER_KEY", "SWITCHYARD_DATABASE_URL"):
            full_env.pop(name, None)
        if master:
            full_env["SWITCHYARD_MASTER_KEY"] = master
        self.process = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", *args], env=full_env,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for_output(self, text: str, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        while text not in self.output:
            if time.time() > deadline or self.process.poll() is not None:
                raise AssertionError(f"{text!r} not in the output:\n{self.output}")
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> float:
        """Send `sig`; the seconds the process took to exit."""
        sent = time.monotonic()
        self.process.send_signal(sig)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"serve did not exit {timeout} s after signal {sig}:\n{self.output}") from None
        self._reader.join(timeout=5)
        return time.monotonic() - sent

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@contextmanager
def served_gateway(tmp: Path, policy_text: str, settle_s: float = 1.0) -> Iterator[tuple[str, str, Serve]]:
    """A `switchyard serve` subprocess on a fresh SQLite ledger in `tmp` with this policy: (root URL, database URL,
    the process). `settle_s`: a wait after /health answers (the load monitor's first scrape of the engine)."""
    url = f"sqlite:///{tmp / 'ledger.db'}"
    db.upgrade(url)
    policy = tmp / "policy.yaml"
    policy.write_text(policy_text)
    port = free_port()
    serve = Serve(tmp, "--policy", str(policy), "--port", str(port), "--database-url", url)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=120)
        time.sleep(settle_s)
        yield f"http://127.0.0.1:{port}", url, serve
    finally:
        if serve.process.poll() is None:
            serve.stop()


@pytest.fixture
def policy(standin, tmp_path) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY.format(standin=standin))
    return path


@pytest.mark.parametrize(("flag", "value", "named"), [("--port", "70000", "65535"), ("--host", "not a host!", "host")])
def test_a_bad_port_or_host_is_a_one_line_error(flag, value, named):
    result = run_cli("serve", flag, value, timeout=30)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and flag in errors[0] and named in errors[0], result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_a_port_in_use_is_a_one_line_error_and_never_ready(policy, tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        serve = Serve(tmp_path, "--policy", str(policy), "--port", str(port),
                      "--database-url", f"sqlite:///{tmp_path / 'ledger.db'}")
        try:
            code = serve.process.wait(timeout=60)
        finally:
            serve.kill()
        serve._reader.join(timeout=5)
    assert code != 0
    out = serve.output
    assert "is ready at" not in out, out
    assert "Traceback" not in out
    [line] = [line for line in out.splitlines() if "error" in line.lower()]
    assert str(port) in line and "in use" in line


def _ledger_rows(url: str) -> list[dict]:
    engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(sa.text("SELECT * FROM cost_ledger"))]
    except sa.exc.ProgrammingError:  # not migrated yet
        return []
    finally:
        engine.dispose()


def test_serve_starts_with_the_database_down_then_migrates_and_replays_when_it_answers(policy, tmp_path):
    with fresh_pg_database() as direct_url:
        direct = make_url(direct_url)
        proxy = TcpProxy(target_port=direct.port or 5432)  # not open yet: its port refuses connections
        url = direct.set(port=proxy.port).render_as_string(hide_password=False)
        port = free_port()
        serve = Serve(tmp_path, "--policy", str(policy), "--port", str(port), "--database-url", url)
        try:
            wait_http(f"http://127.0.0.1:{port}/health", timeout=90)
            assert "unreachable" in serve.output
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=MASTER, max_retries=0)
            reply = client.chat.completions.with_raw_response.create(
                model="local", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
            request_id = reply.headers["x-request-id"]
            # A key the gateway cannot check is a 503 with an OpenAI body and Retry-After, not a 500.
            response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=10,
                                  headers={"authorization": "Bearer sk-sy-someone"},
                                  json={"model": "local", "messages": [{"role": "user", "content": "hi"}]})
            assert response.status_code == 503, response.text
            assert response.json()["error"]["type"] == "api_error" and response.headers["retry-after"]
            assert response.headers["x-request-id"]

            proxy.open()  # the database is back
            deadline = time.time() + 60
            while not (rows := _ledger_rows(direct_url)) and time.time() < deadline:
                time.sleep(0.5)
            assert [r["request_id"] for r in rows] == [request_id], serve.output
            assert rows[0]["status"] == "ok" and rows[0]["api_key_id"] == "master"
            took = serve.stop()
        finally:
            serve.kill()
            proxy.close()
    assert took < 10
    assert "Traceback" not in serve.output


def test_sigterm_with_the_database_down_and_no_master_key_exits_in_seconds(policy, tmp_path):
    port, closed = free_port(), free_port()
    serve = Serve(tmp_path, "--policy", str(policy), "--port", str(port), "--database-url",
                  f"postgresql://postgres@127.0.0.1:{closed}/test", master=None)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=90)
        serve.wait_for_output("No admin key was created")
        took = serve.stop()
    finally:
        serve.kill()
    assert took < 10, serve.output
    assert "Traceback" not in serve.output


def test_sigterm_while_waiting_for_an_embedded_engine_exits_in_seconds(tmp_path):
    """An embedded engine that never gets healthy (its model is missing): the gateway waits for it at start, and
    a SIGTERM in that wait must not sit out the wait."""
    policy = tmp_path / "policy.yaml"
    policy.write_text("backends:\n  local:\n    kind: engine\n    launch: embedded\n    model: demo\n"
                      f"    engine_model_path: {tmp_path / 'no-such-model'}\n    gpu_hour_usd: 1.0\n"
                      "routes:\n  demo:\n    strategy: fixed\n    backend: local\n")
    serve = Serve(tmp_path, "--policy", str(policy), "--port", str(free_port()),
                  "--database-url", f"sqlite:///{tmp_path / 'ledger.db'}")
    try:
        serve.wait_for_output("embedded engine local started")
        time.sleep(1)  # in the wait
        took = serve.stop()
    finally:
        serve.kill()
    assert took < 10, serve.output
    assert "is ready at" not in serve.output
