"""The Redis-shared budget book and RPM/TPM windows (gateway/shared_state.py), two "replicas" (two SharedState
objects, as two gateway processes hold) on a private redis-server: one budget and one window per key across them,
reservations that expire, spend seeded from (and reconciled with) the ledger, and the local fallback with its
share while Redis is stopped, replayed once it is back."""
from __future__ import annotations

import asyncio

import pytest

from gateway.budgets import BudgetBook
from gateway.keys import KeyInfo, hash_key
from gateway.ratelimit import RateLimiter
from gateway.shared_state import SharedBudgetBook, SharedRateLimiter, SharedState, _keys
from gateway.shared_state_testing import RedisServer
from openai_wire import APIError


@pytest.fixture
def redis_server():
    with RedisServer() as server:
        yield server


class Ledger:
    """The ledger's SUM(cost_usd) per key, as the gateway's spend lookup answers it."""

    def __init__(self, spent: float = 0.0) -> None:
        self.spent = spent
        self.calls = 0

    async def __call__(self, key_id: str) -> float:
        self.calls += 1
        return self.spent


async def _replicas(url: str, ledger: Ledger, n: int = 2, **kw) -> list[SharedState]:
    states = [SharedState(url, ledger, heartbeat_s=0.1, **kw) for _ in range(n)]
    for state in states:
        await state.start()
    await asyncio.sleep(0.25)  # a heartbeat each: every replica counts all of them
    return states


async def _close(states: list[SharedState]) -> None:
    for state in states:
        await state.aclose()


async def _spend_concurrently(books, key: KeyInfo, each_usd: float, requests: int) -> int:
    """`requests` concurrent reserve + settle (at the reserved amount) spread over the books; how many passed."""
    async def one(i: int) -> bool:
        book = books[i % len(books)]
        try:
            reservation = await book.reserve(key, each_usd)
        except APIError as exc:
            assert exc.code == "insufficient_quota"
            return False
        await asyncio.sleep(0.01)
        book.settle(reservation, each_usd)
        return True

    return sum(await asyncio.gather(*(one(i) for i in range(requests))))


async def test_two_replicas_share_one_budget(redis_server):
    key = KeyInfo(id="key_shared", team="t", budget_usd=1.0)
    ledger = Ledger(spent=0.2)  # already spent before this run: seeded from the ledger
    states = await _replicas(redis_server.url, ledger)
    try:
        books = [SharedBudgetBook(state) for state in states]
        passed = await _spend_concurrently(books, key, 0.1, 40)
        assert passed == 8  # (1.0 - 0.2) / 0.1: never more across both replicas
        await asyncio.sleep(0.2)  # the settles (sent after the answer)
        acct = await states[0]._client.hgetall(_keys(key.id)[0])
        assert float(acct["spent"]) == pytest.approx(1.0)
        assert float(acct["reserved"]) == pytest.approx(0.0, abs=1e-9)
    finally:
        await _close(states)
    # What one process-local book per replica does (the behaviour this replaces): each spends the whole budget.
    local = [BudgetBook(Ledger(spent=0.2)) for _ in range(2)]
    assert await _spend_concurrently(local, key, 0.1, 40) == 16


class SlowLedger(Ledger):
    async def __call__(self, key_id: str) -> float:
        self.calls += 1
        await asyncio.sleep(0.1)  # a database under load: the burst's requests all arrive while it answers
        return self.spent


async def test_a_burst_of_first_requests_on_a_key_makes_one_ledger_lookup_per_replica(redis_server):
    """Regression: every concurrent first request on a key Redis had no account for looked its spend up in the
    ledger (1,000 at once exhausted the database pool and answered 503s)."""
    key = KeyInfo(id="key_burst", team="t", budget_usd=100.0)
    ledger = SlowLedger(spent=1.0)
    states = await _replicas(redis_server.url, ledger)
    try:
        books = [SharedBudgetBook(state) for state in states]
        assert await _spend_concurrently(books, key, 0.1, 200) == 200
        # One per replica, plus the odd straggler whose "no account" reply came before the seed landed (the old
        # code made one per request: 200).
        assert ledger.calls <= 3 * len(states)
    finally:
        await _close(states)


async def test_a_crashed_replicas_reservations_expire(redis_server):
    key = KeyInfo(id="key_crash", team="t", budget_usd=1.0)
    crashed, alive = await _replicas(redis_server.url, Ledger(), reservation_ttl_s=0.3)
    try:
        await SharedBudgetBook(crashed).reserve(key, 0.9)  # never settled: its replica "crashed"
        with pytest.raises(APIError) as refused:
            await SharedBudgetBook(alive).reserve(key, 0.5)
        assert refused.value.code == "insufficient_quota"
        await asyncio.sleep(0.4)
        assert await SharedBudgetBook(alive).reserve(key, 0.5) is not None
    finally:
        await _close([crashed, alive])


async def test_rpm_and_tpm_are_one_window_across_replicas(redis_server):
    rpm_key = KeyInfo(id="key_rpm", team="t", rpm=10)
    tpm_key = KeyInfo(id="key_tpm", team="t", tpm=100)
    states = await _replicas(redis_server.url, Ledger())
    limiters = [SharedRateLimiter(state) for state in states]
    try:
        async def admit(limiter, key, tokens) -> bool:
            try:
                await limiter.admit(key, tokens)
            except APIError as exc:
                assert exc.status == 429 and int(exc.headers["Retry-After"]) >= 1
                return False
            return True

        admitted = await asyncio.gather(*(admit(limiters[i % 2], rpm_key, 1) for i in range(30)))
        assert sum(admitted) == 10
        for i in range(4):  # 4 x 30 tokens recorded across both replicas: the window holds 120 > 100
            limiters[i % 2].record_tokens(tpm_key, 30)
        await asyncio.sleep(0.2)
        assert not await admit(limiters[0], tpm_key, 1)
        assert not await admit(limiters[1], tpm_key, 1)
    finally:
        await _close(states)
    local = [RateLimiter(), RateLimiter()]
    assert sum(_try(local[i % 2], rpm_key) for i in range(30)) == 20  # the old way: each replica its own window


def _try(limiter: RateLimiter, key: KeyInfo) -> bool:
    try:
        limiter.admit(key, 1)
    except APIError:
        return False
    return True


async def test_budget_and_rpm_are_one_script_and_a_refusal_counts_nothing(redis_server):
    key = KeyInfo(id="key_both", team="t", budget_usd=0.25, rpm=5)
    states = await _replicas(redis_server.url, Ledger(), n=1)
    book, limiter = SharedBudgetBook(states[0]), SharedRateLimiter(states[0])
    try:
        reservation = await book.reserve(key, 0.1, 3)
        assert limiter.admit(key, 3) is None  # already counted by the budget's script: no second round trip
        with pytest.raises(APIError) as refused:
            await book.reserve(key, 0.2, 3)  # 0.1 + 0.2 > 0.25: refused, and not counted in the RPM window
        assert refused.value.code == "insufficient_quota"
        assert await states[0]._client.zcard(_keys(key.id)[3]) == 1
        book.settle(reservation, 0.05)
        book.settle(reservation, 0.05)  # twice: booked once
        await asyncio.sleep(0.1)
        assert float(await states[0]._client.hget(_keys(key.id)[0], "spent")) == pytest.approx(0.05)
    finally:
        await _close(states)


async def test_redis_stopped_falls_back_to_a_share_then_replays_and_reconciles(redis_server):
    key = KeyInfo(id="key_outage", team="t", budget_usd=1.0, rpm=100)
    ledger = Ledger(spent=0.0)
    states = await _replicas(redis_server.url, ledger)
    one, _ = states
    book = SharedBudgetBook(one)
    try:
        settled = await book.reserve(key, 0.2)
        held = await book.reserve(key, 0.1)  # in flight across the outage
        book.settle(settled, 0.2)
        await asyncio.sleep(0.1)
        assert one.health()["status"] == "shared" and one.health()["replicas"] == 2

        redis_server.stop()
        # Its share: half of the 0.8 left (two replicas seen last), reserved and spent locally.
        passed = await _spend_concurrently([book], key, 0.1, 10)
        health = one.health()
        assert health["status"] == "local_fallback" and health["local_share"] == 0.5
        assert passed == 4
        book.settle(held, 0.1)
        ledger.spent = 0.2 + 0.4 + 0.1  # the ledger has every row meanwhile (rows go to PostgreSQL, not Redis)

        redis_server.start()  # a restarted Redis has nothing: the replay and the ledger put the spend back
        for _ in range(50):
            if all(state.health()["status"] == "shared" for state in states):
                break
            await asyncio.sleep(0.1)
        assert all(state.health()["status"] == "shared" for state in states)
        assert one.health()["pending_replay"] == 0 and one.health()["outages"] == 1
        spent = float(await one._client.hget(_keys(key.id)[0], "spent"))
        assert spent == pytest.approx(0.7)
        assert await _spend_concurrently([book, SharedBudgetBook(states[1])], key, 0.1, 10) == 3
    finally:
        await _close(states)


async def test_a_key_change_reaches_every_replica_through_pubsub(redis_server):
    from gateway.auth import Authenticator

    key = KeyInfo(id="key_revoked", team="t")
    answers = {"sk-one": key}

    async def lookup(key_hash: str):
        return next((info for secret, info in answers.items() if hash_key(secret) == key_hash), None)

    states = await _replicas(redis_server.url, Ledger())
    caches = [Authenticator(None, None, lookup=lookup, fresh_s=3600) for _ in states]  # never stale on its own
    for state, cache in zip(states, caches, strict=True):
        state.on_key_change(cache.forget)
    try:
        for cache in caches:
            assert (await cache.authenticate("Bearer sk-one")).id == key.id
        del answers["sk-one"]  # revoked in the database
        for cache in caches:  # the caches still admit it: nothing told them
            assert (await cache.authenticate("Bearer sk-one")).id == key.id
        await states[0].announce_key_change(key.id)
        for _ in range(50):
            await asyncio.sleep(0.02)
            refused = 0
            for cache in caches:
                try:
                    await cache.authenticate("Bearer sk-one")
                except APIError as exc:
                    assert exc.status == 401
                    refused += 1
            if refused == len(caches):
                break
        assert refused == len(caches)
    finally:
        await _close(states)


@pytest.mark.parametrize("url", ["http://127.0.0.1:6379", "127.0.0.1:6379", "postgresql://x"])
def test_a_redis_url_that_is_not_one_is_a_one_line_error(url, monkeypatch):
    from gateway import settings

    monkeypatch.delenv("SWITCHYARD_REDIS_URL", raising=False)
    with pytest.raises(ValueError) as refused:
        settings.redis_url(url)
    assert "\n" not in str(refused.value) and "redis://" in str(refused.value)
    assert "6379" not in str(refused.value)  # the URL itself (it may carry a password) is never echoed
    monkeypatch.setenv("SWITCHYARD_REDIS_URL", "redis://127.0.0.1:6379/0")
    assert settings.redis_url(None) == "redis://127.0.0.1:6379/0"


def test_workers_need_redis_and_no_embedded_engine():
    from gateway.policy import parse_policy
    from gateway.serve import _workers_allowed

    remote = parse_policy("backends:\n  e: {kind: engine, model: m, api_base: 'http://127.0.0.1:9/v1', "
                          "gpu_hour_usd: 1}\nroutes:\n  r: {backend: e}\n", "test.yaml")
    assert _workers_allowed(1, None, remote) == 1
    assert _workers_allowed(4, "redis://127.0.0.1:1/0", remote) == 4
    with pytest.raises(ValueError, match="needs --redis-url"):
        _workers_allowed(2, None, remote)
    embedded = parse_policy("backends:\n  e: {kind: engine, model: m, launch: embedded, engine_model_path: x, "
                            "gpu_hour_usd: 1}\nroutes:\n  r: {backend: e}\n", "test.yaml")
    with pytest.raises(ValueError, match="embedded engines"):
        _workers_allowed(2, "redis://127.0.0.1:1/0", embedded)
