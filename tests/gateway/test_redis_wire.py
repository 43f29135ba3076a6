"""The hot path's pipelined Redis connection (gateway/redis_wire.py) against a private redis-server: concurrent
commands on one socket each get their own reply, a timed-out command's late reply goes to no one else, errors are
redis-py's classes, the database number and password of the URL hold, and a restarted Redis is reconnected to."""
from __future__ import annotations

import asyncio

import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.redis_wire import WireClient, encode
from gateway.shared_state_testing import RedisServer


@pytest.fixture
def redis_server():
    with RedisServer() as server:
        yield server


async def test_concurrent_commands_on_one_socket_get_their_own_replies(redis_server):
    wire = WireClient(redis_server.url, 5.0)
    try:
        replies = await asyncio.gather(*(wire.execute("INCR", "n") for _ in range(500)))
        assert sorted(replies) == list(range(1, 501))
        values = await asyncio.gather(*(wire.execute("ECHO", f"v{i}") for i in range(300)))
        assert values == [f"v{i}" for i in range(300)]  # each its own, not a neighbour's
        assert await wire.execute_many([encode("SET", "k", "é"), encode("GET", "k"), encode("GET", "none"),
                                        encode("RPUSH", "l", 1, 2), encode("LRANGE", "l", 0, -1)]) == \
            ["OK", "é", None, 2, ["1", "2"]]
        assert await wire.execute("EVAL", "return {1, 'seed', {2, 'x'}}", 0) == [1, "seed", [2, "x"]]
    finally:
        wire.close()


async def test_errors_are_redis_pys_and_leave_the_connection_usable(redis_server):
    wire = WireClient(redis_server.url, 5.0)
    try:
        with pytest.raises(NoScriptError):
            await wire.execute("EVALSHA", "0" * 40, 0)
        with pytest.raises(ResponseError, match="WRONGTYPE|wrong kind"):
            await wire.execute("SET", "s", "1") and await wire.execute("LPUSH", "s", "x")
        mixed = await wire.execute_many([encode("EVALSHA", "0" * 40, 0), encode("PING")], raise_on_error=False)
        assert isinstance(mixed[0], NoScriptError) and mixed[1] == "PONG"
    finally:
        wire.close()


async def test_a_timed_out_commands_late_reply_is_dropped_in_order(redis_server):
    wire = WireClient(redis_server.url, 0.3)
    try:
        with pytest.raises(RedisTimeoutError):
            await wire.execute("BLPOP", "never", 1)  # Redis answers nil after 1 s; we stop waiting at 0.3 s
        await asyncio.sleep(1.0)  # its nil arrives meanwhile (a connection's commands are answered in order)
        assert await asyncio.wait_for(wire.execute("ECHO", "mine"), 5) == "mine"  # not the BLPOP's nil
    finally:
        wire.close()


async def test_the_urls_database_and_password_are_used(redis_server):
    admin = redis.Redis.from_url(redis_server.url)
    admin.config_set("requirepass", "s3cret")
    try:
        wire = WireClient(f"redis://:s3cret@127.0.0.1:{redis_server.port}/3", 5.0)
        await wire.execute("SET", "where", "three")
        wire.close()
        check = redis.Redis(host="127.0.0.1", port=redis_server.port, db=3, password="s3cret")
        assert check.get("where") == b"three"
        check.close()
        bad = WireClient(f"redis://:wrong@127.0.0.1:{redis_server.port}/0", 5.0)
        with pytest.raises(ResponseError):
            await bad.execute("PING")
        bad.close()
    finally:
        redis.Redis.from_url(f"redis://:s3cret@127.0.0.1:{redis_server.port}/0").config_set("requirepass", "")
        admin.close()


async def test_a_stopped_redis_is_a_connection_error_and_a_restarted_one_is_reconnected(redis_server):
    wire = WireClient(redis_server.url, 1.0)
    try:
        assert await wire.execute("PING") == "PONG"
        redis_server.stop()
        with pytest.raises((RedisConnectionError, RedisTimeoutError)):
            await wire.execute("PING")
        with pytest.raises(RedisConnectionError):
            await wire.execute("PING")  # nothing listens: the connect fails
        redis_server.start()
        assert await wire.execute("PING") == "PONG"
    finally:
        wire.close()
