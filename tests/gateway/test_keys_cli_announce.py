"""`switchyard keys update | rotate | revoke --redis-url` announce the key's id on the replicas' channel (issue 32,
item 1): the CLI writes the database with no gateway involved, so without the announcement a replica would keep
its cached entry until it is a second old. Real subprocesses, a private redis-server, a real SQLite file."""
from __future__ import annotations

import time

import redis

from gateway.shared_state import KEY_CHANNEL
from gateway.shared_state_testing import RedisServer
from tests.e2e.conftest import free_port, run_cli


def _created(result) -> tuple[str, str]:
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    return lines[-1], next(word for word in lines[0].split() if word.startswith("key_"))


def _heard(pubsub, timeout: float = 10.0) -> list[str]:
    heard, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        message = pubsub.get_message(timeout=0.2)
        if message and message["type"] == "message":
            heard.append(message["data"].decode())
        elif heard:
            return heard
    return heard


def test_update_rotate_and_revoke_are_announced_to_the_replicas(tmp_path):
    db_url = f"sqlite:///{tmp_path / 'keys.db'}"
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        pubsub = client.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(KEY_CHANNEL)
        _, key_id = _created(run_cli("keys", "create", "--team", "t", "--database-url", db_url))
        announced = []
        for args, env in ((["update", key_id, "--rpm", "5", "--redis-url", server.url], None),
                          (["rotate", key_id], {"SWITCHYARD_REDIS_URL": server.url}),  # the variable serves too
                          (["revoke", key_id, "--redis-url", server.url], None)):
            done = run_cli("keys", *args, "--database-url", db_url, env=env)
            assert done.returncode == 0, done.stdout + done.stderr
            assert "Announced to 1 gateway replica on Redis." in done.stdout  # this test's subscription
            announced += _heard(pubsub)
        pubsub.close()
        client.close()
    assert announced == [key_id] * 3


def test_an_unreachable_redis_is_a_warning_and_the_change_holds(tmp_path):
    db_url = f"sqlite:///{tmp_path / 'keys.db'}"
    _, key_id = _created(run_cli("keys", "create", "--team", "t", "--database-url", db_url))
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"  # nothing listens there
    done = run_cli("keys", "revoke", key_id, "--database-url", db_url, "--redis-url", url)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"Revoked key {key_id}" in done.stdout
    assert "could not announce it" in done.stderr and "within about a second" in done.stderr
    assert "hunter2" not in done.stderr + done.stdout  # the URL's password is never echoed
    listed = run_cli("keys", "list", "--all", "--json", "--database-url", db_url)
    assert '"revoked": true' in listed.stdout
