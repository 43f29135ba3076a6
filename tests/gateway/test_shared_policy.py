"""One live policy for replicas sharing a Redis (gateway/shared_policy.py): "replicas" are SharedState + PolicyStore
pairs in one process, each with its own copy of the policy file (as on separate hosts), on a private redis-server.
An edit of one replica's file is served by the others; at start the newer of the file and the shared policy wins;
a shared text that does not validate here is refused and shown; an edit made while Redis is away is shared once it
is back."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from gateway.policy_store import PolicyStore
from gateway.shared_policy import POLICY_KEY, SharedPolicy
from gateway.shared_state import SharedState
from gateway.shared_state_testing import RedisServer

BASE = """\
backends:
  a:
    kind: engine
    api_base: http://127.0.0.1:9/v1
    model: demo
routes:
  demo:
    backend: a
"""
EDITED = BASE + "  second:\n    backend: a\n"


@pytest.fixture
def redis_server():
    with RedisServer() as server:
        yield server


async def _nothing(_key_id: str) -> float:
    return 0.0


class Replica:
    def __init__(self, directory: Path, url: str, text: str = BASE, mtime: float | None = None) -> None:
        directory.mkdir(exist_ok=True)
        self.path = directory / "policy.yaml"
        self.path.write_text(text)
        if mtime is not None:
            os.utime(self.path, (mtime, mtime))
        self.store = PolicyStore(self.path, poll_interval_s=0.05, settle_s=0)
        self.state = SharedState(url, _nothing, heartbeat_s=0.1)
        self.seen: list[str] = []
        self.store.on_change(lambda policy: self.seen.append(policy.version))

    async def start(self) -> Replica:
        await self.store.start()
        await self.state.start()
        await SharedPolicy(self.state, self.store).start()
        return self

    async def close(self) -> None:
        await self.state.aclose()
        await self.store.stop()

    @property
    def version(self) -> str:
        return self.store.current.version


async def _until(cond, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name("next.yaml")
    tmp.write_text(text)
    os.replace(tmp, path)  # an atomic edit: the watcher reads it at once


async def test_an_edit_on_one_replica_is_served_by_every_replica(tmp_path, redis_server):
    replicas = [await Replica(tmp_path / f"r{i}", redis_server.url).start() for i in range(3)]
    try:
        first = replicas[0].version
        assert all(r.version == first for r in replicas)
        _replace(replicas[1].path, EDITED)
        await _until(lambda: all(r.version != first for r in replicas))
        assert {r.version for r in replicas} == {replicas[1].version}
        assert "second" in replicas[2].store.current.routes  # the others' files still hold the old text
        assert replicas[2].path.read_text() == BASE
        assert replicas[0].store.status()["origin"].startswith("replica ")
        assert replicas[1].store.status()["origin"] == "file"
        assert replicas[0].seen == [replicas[1].version]  # listeners ran (routing, engines) as for a reload
        health = replicas[0].state.health()["policy"]
        assert health == {"shared_version": replicas[1].version, "serving": replicas[1].version, "in_step": True,
                          "refused": None}
    finally:
        for replica in replicas:
            await replica.close()


async def test_at_start_the_newer_of_the_file_and_the_shared_policy_wins(tmp_path, redis_server):
    first = await Replica(tmp_path / "r0", redis_server.url, EDITED).start()
    try:
        # Restarted with an older copy of the file: takes the cluster's policy.
        old = await Replica(tmp_path / "r1", redis_server.url, BASE, mtime=first.path.stat().st_mtime - 60).start()
        assert old.version == first.version
        await old.close()
        # A new file (a rolling deploy): the cluster takes it.
        newer_text = EDITED + "  third:\n    backend: a\n"
        new = await Replica(tmp_path / "r2", redis_server.url, newer_text,
                            mtime=first.path.stat().st_mtime + 60).start()
        await _until(lambda: first.version == new.version)
        assert "third" in first.store.current.routes
        await new.close()
    finally:
        await first.close()


async def test_a_shared_policy_that_does_not_validate_here_is_refused_and_shown(tmp_path, redis_server):
    replica = await Replica(tmp_path / "r0", redis_server.url).start()
    try:
        serving = replica.version
        bad = BASE.replace("model: demo", "model: demo\n    brand_new_field: 1")
        await replica.state.client.hset(POLICY_KEY, mapping={"version": "0123456789abcdef", "text": bad,
                                                             "at": "9e12", "replica": "elsewhere"})
        await replica.state.client.publish("switchyard:policy", "0123456789abcdef")
        await _until(lambda: replica.state.health()["policy"]["refused"] is not None)
        health = replica.state.health()["policy"]
        assert health["in_step"] is False and health["serving"] == serving
        assert health["refused"]["version"] == "0123456789abcdef" and health["refused"]["replica"] == "elsewhere"
        assert replica.version == serving
    finally:
        await replica.close()


async def test_an_edit_made_while_redis_is_away_is_shared_when_it_returns(tmp_path, redis_server):
    replicas = [await Replica(tmp_path / f"r{i}", redis_server.url).start() for i in range(2)]
    try:
        redis_server.stop()
        await _until(lambda: not replicas[0].state.up)
        _replace(replicas[0].path, EDITED)
        await _until(lambda: "second" in replicas[0].store.current.routes)
        redis_server.start()  # empty: the edited policy goes back, newer than what replica 1 serves
        await _until(lambda: replicas[1].version == replicas[0].version, timeout=15)
        assert "second" in replicas[1].store.current.routes
    finally:
        for replica in replicas:
            await replica.close()
