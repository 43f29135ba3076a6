"""Fixtures that run the real gateway on 127.0.0.1 (uvicorn in a thread, or a `switchyard serve` subprocess)."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn

from gateway.app import GatewayConfig, create_app
from gateway.listen_address import free_port  # the one; e2e files import it from here

MASTER_KEY = "sk-test-master"


@dataclass
class RunningGateway:
    base_url: str  # …/v1
    root: str
    config: GatewayConfig
    server: uvicorn.Server
    app: object
    loop: asyncio.AbstractEventLoop | None = None

    @property
    def gw(self):
        return self.app.state.gw

    def call(self, coro_fn, *args):
        """Run a coroutine on the gateway's own event loop (e.g. writer.flush) and wait for it."""
        future = asyncio.run_coroutine_threadsafe(coro_fn(*args), self.loop)
        return future.result(timeout=30)


def tiny_difficulty_model(path: Path) -> Path:
    """A difficulty model where "prove the statement number N" is hard and "say hi N" is easy, saved at `path`."""
    import numpy as np

    from router.train import fit

    prompts = [f"prove the statement number {i}" for i in range(20)] + [f"say hi {i}" for i in range(40)]
    model = fit(prompts, np.array([False] * 20 + [True] * 40), np.ones(60, dtype=bool))
    model.save(path)
    assert model.score("prove the statement number 7") >= 0.5 > model.score("say hi 7")
    return path


@contextmanager
def run_gateway(policy_text: str, tmp_path: Path, database_url: str | None = None,
                master_key: str = MASTER_KEY) -> Iterator[RunningGateway]:
    policy_path = tmp_path / "policy.yaml"
    policy_path.write_text(textwrap.dedent(policy_text))
    data_dir = tmp_path / "data"
    url = database_url or f"sqlite:///{data_dir / 'ledger.db'}"
    from gateway import db

    db.upgrade(url)
    config = GatewayConfig(policy_path=policy_path, database_url=url, data_dir=data_dir, master_key=master_key,
                           wait_for_engines_s=60)
    app = create_app(config)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           access_log=False, timeout_graceful_shutdown=10))
    running = RunningGateway(base_url=f"http://127.0.0.1:{port}/v1", root=f"http://127.0.0.1:{port}",
                             config=config, server=server, app=app)

    def target() -> None:
        loop = asyncio.new_event_loop()
        running.loop = loop
        loop.run_until_complete(server.serve())
        loop.close()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        if not thread.is_alive() or time.time() > deadline:
            raise RuntimeError("gateway did not start")
        time.sleep(0.02)
    if running.gw.embedded.processes():  # the gateway serves while its engines start; these tests want them up
        asyncio.run_coroutine_threadsafe(running.gw.embedded.wait_ready(config.wait_for_engines_s),
                                         running.loop).result(timeout=config.wait_for_engines_s + 10)
    try:
        yield running
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture
def standin(monkeypatch):
    """A stand-in upstream's /v1 URL; STANDIN_API_KEY (what the test policies' api_key_env name) is set."""
    from gateway.testing.standin import run_standin

    monkeypatch.setenv("STANDIN_API_KEY", "sk-standin")
    with run_standin(engine_extension=True) as base_url:
        yield base_url


def ledger_rows(url: str, where: str = "1=1", params: dict | None = None) -> list[dict]:
    """Read cost_ledger rows with a plain synchronous connection (what an analyst would do)."""
    import sqlalchemy as sa

    from gateway import db

    engine = sa.create_engine(db.sync_url(url))
    try:
        with engine.connect() as conn:
            result = conn.execute(sa.text(f"SELECT * FROM cost_ledger WHERE {where} ORDER BY created_at"),
                                  params or {})
            return [dict(row._mapping) for row in result]
    finally:
        engine.dispose()


def run_cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "gateway.cli", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout, check=False)


def wait_http(url: str, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(url)
