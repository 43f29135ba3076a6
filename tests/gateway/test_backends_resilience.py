"""Retries, fallbacks and circuit breakers, against stand-in upstreams over real sockets."""
from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import pytest

from gateway.backends import (
    BreakerRegistry,
    BreakerState,
    CircuitBreaker,
    UpstreamError,
    build_backend,
    complete_with_fallbacks,
    open_stream_with_fallbacks,
)
from gateway.backends.resilience import backoff_delay
from gateway.policy import BackendSpec
from gateway.testing.standin import run_standin, standin_control, standin_stats

CHAT = {"model": "x", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}


def spec(name: str, url: str, kind: str = "engine", **kw) -> BackendSpec:
    kw.setdefault("retry_backoff_s", 0.01)
    if kind == "litellm":
        return BackendSpec(name=name, kind="litellm", model="openai/gpt-4o-mini", api_base=url,
                           api_key_env="STANDIN_TEST_KEY", **kw)
    return BackendSpec(name=name, kind="engine", model="demo", api_base=url, **kw)


@pytest.fixture(autouse=True)
def _api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STANDIN_TEST_KEY", "sk-standin")


@pytest.fixture
def two():
    with run_standin() as a, run_standin() as b:
        yield a, b


def refused_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/v1"


@contextlib.asynccontextmanager
async def backends(*specs: BackendSpec):
    built = [build_backend(s) for s in specs]
    try:
        yield built
    finally:
        for b in built:
            await b.aclose()


@pytest.mark.parametrize("kind", ["engine", "litellm"])
@pytest.mark.parametrize("status", [500, 429, 503])
async def test_retry_then_success(two, kind: str, status: int) -> None:
    a, b = two
    standin_control(a, fail_next=2, fail_status=status)
    async with backends(spec("a", a, kind, max_retries=2), spec("b", b)) as chain:
        reg = BreakerRegistry()
        done, served_by, attempts = await complete_with_fallbacks(chain, CHAT, "chat", reg)
    assert served_by.name == "a" and attempts == 3
    assert done.body["choices"][0]["message"]["content"] == "tok0 tok1 tok2"
    assert standin_stats(a)["requests"] == 3 and standin_stats(b)["requests"] == 0
    assert reg.states() == {"a": 0}


async def test_retry_after_is_honoured(two) -> None:
    a, _ = two
    standin_control(a, fail_next=1, fail_status=429, retry_after=0.3)
    async with backends(spec("a", a, max_retries=1)) as chain:
        t0 = time.perf_counter()
        _, served_by, attempts = await complete_with_fallbacks(chain, CHAT, "chat", BreakerRegistry())
        assert time.perf_counter() - t0 >= 0.3
    assert (served_by.name, attempts) == ("a", 2)


async def test_long_retry_after_moves_to_the_next_backend(two) -> None:
    a, b = two
    standin_control(a, fail_next=5, fail_status=429, retry_after=60)
    async with backends(spec("a", a, max_retries=3), spec("b", b)) as chain:
        t0 = time.perf_counter()
        _, served_by, attempts = await complete_with_fallbacks(chain, CHAT, "chat", BreakerRegistry())
        assert time.perf_counter() - t0 < 5
    assert (served_by.name, attempts) == ("b", 2)


@pytest.mark.parametrize("kind", ["engine", "litellm"])
async def test_fallback_when_backend_is_down(two, kind: str) -> None:
    _, b = two
    async with backends(spec("down", refused_url(), kind, max_retries=1), spec("b", b, kind)) as chain:
        done, served_by, attempts = await complete_with_fallbacks(chain, CHAT, "chat", BreakerRegistry())
        assert (served_by.name, attempts) == ("b", 3) and done.usage.completion_tokens == 3
        backend, stream, attempts = await open_stream_with_fallbacks(chain, CHAT, "chat", BreakerRegistry())
        chunks = [c async for c in stream]
        await stream.aclose()
    assert (backend.name, attempts) == ("b", 3)
    assert chunks[-1]["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("kind", ["engine", "litellm"])
@pytest.mark.parametrize("status", [400, 413, 422])
async def test_no_retry_and_no_fallback_on_bad_request(two, kind: str, status: int) -> None:
    a, b = two
    standin_control(a, fail_next=1, fail_status=status)
    async with backends(spec("a", a, kind), spec("b", b)) as chain:
        reg = BreakerRegistry()
        with pytest.raises(UpstreamError) as exc:
            await complete_with_fallbacks(chain, CHAT, "chat", reg)
        assert exc.value.status == status and exc.value.attempts == 1 and exc.value.backend == "a"
        standin_control(a, fail_next=1, fail_status=status)
        with pytest.raises(UpstreamError) as exc:
            await open_stream_with_fallbacks(chain, CHAT, "chat", reg)
        assert exc.value.status == status
    assert standin_stats(a)["requests"] == 2 and standin_stats(b)["requests"] == 0
    assert reg.states() == {"a": 0}  # a bad request says nothing against the backend


@pytest.mark.parametrize("kind", ["engine", "litellm"])
@pytest.mark.parametrize("status", [401, 403, 404])
async def test_misconfigured_backend_falls_back_without_retry(two, kind: str, status: int) -> None:
    a, b = two
    standin_control(a, fail_next=1, fail_status=status)
    async with backends(spec("a", a, kind, max_retries=3), spec("b", b)) as chain:
        reg = BreakerRegistry()
        _, served_by, attempts = await complete_with_fallbacks(chain, CHAT, "chat", reg)
        assert (served_by.name, attempts) == ("b", 2)
        assert reg["a"].failures == 0  # issue 12: our bad key is not an outage (an open breaker would not heal it)
        standin_control(a, fail_next=1, fail_status=status)
        backend, stream, attempts = await open_stream_with_fallbacks(chain, CHAT, "chat", reg)
        await stream.aclose()
        assert (backend.name, attempts) == ("b", 2)
    assert standin_stats(a)["requests"] == 2


async def test_all_fail_raises_the_last_error(two) -> None:
    a, b = two
    standin_control(a, fail_next=10, fail_status=500)
    standin_control(b, fail_next=10, fail_status=503)
    async with backends(spec("a", a, max_retries=1), spec("b", b, max_retries=1)) as chain:
        with pytest.raises(UpstreamError) as exc:
            await complete_with_fallbacks(chain, CHAT, "chat", BreakerRegistry())
    assert exc.value.status == 503 and exc.value.backend == "b" and exc.value.attempts == 4


async def test_breaker_opens_skips_backend_and_a_probe_closes_it(two) -> None:
    a, b = two
    standin_control(a, fail_next=2, fail_status=500)
    reg = BreakerRegistry()
    async with backends(spec("a", a, max_retries=0, failure_threshold=2, cooldown_s=0.4),
                        spec("b", b)) as chain:
        for _ in range(2):  # two failures on a, each request served by b
            _, served_by, _ = await complete_with_fallbacks(chain, CHAT, "chat", reg)
            assert served_by.name == "b"
        assert reg.states()["a"] == BreakerState.OPEN
        # open: a is not even tried
        _, served_by, attempts = await complete_with_fallbacks(chain, CHAT, "chat", reg)
        assert (served_by.name, attempts) == ("b", 1)
        assert standin_stats(a)["requests"] == 2
        await asyncio.sleep(0.45)
        assert reg.states()["a"] == BreakerState.HALF_OPEN
        # after the cooldown one probe goes to a; a is healthy again, so the breaker closes
        _, served_by, attempts = await complete_with_fallbacks(chain, CHAT, "chat", reg)
        assert (served_by.name, attempts) == ("a", 1)
        assert reg.states()["a"] == BreakerState.CLOSED and standin_stats(a)["requests"] == 3


async def test_failed_probe_reopens_the_breaker(two) -> None:
    a, b = two
    standin_control(a, fail_next=3, fail_status=502)
    reg = BreakerRegistry()
    async with backends(spec("a", a, max_retries=0, failure_threshold=2, cooldown_s=0.3),
                        spec("b", b)) as chain:
        for _ in range(2):
            await complete_with_fallbacks(chain, CHAT, "chat", reg)
        await asyncio.sleep(0.35)
        _, served_by, attempts = await complete_with_fallbacks(chain, CHAT, "chat", reg)
        assert (served_by.name, attempts) == ("b", 2)  # probe failed, then b
        assert reg.states()["a"] == BreakerState.OPEN and reg["a"].times_opened == 2


async def test_every_breaker_open_is_a_clear_error() -> None:
    reg = BreakerRegistry()
    async with backends(spec("down", refused_url(), max_retries=0, failure_threshold=1, cooldown_s=30)) as chain:
        with pytest.raises(UpstreamError) as exc:
            await complete_with_fallbacks(chain, CHAT, "chat", reg)
        assert exc.value.kind == "connect"
        with pytest.raises(UpstreamError, match="circuit open for down") as exc:
            await complete_with_fallbacks(chain, CHAT, "chat", reg)
        assert exc.value.attempts == 0


async def test_stream_fallback_before_first_chunk_but_not_after() -> None:
    with run_standin(drop_after_tokens=2) as flaky, run_standin() as good:
        async with backends(spec("flaky", flaky, max_retries=0), spec("good", good)) as chain:
            reg = BreakerRegistry()
            standin_control(flaky, fail_next=1, fail_status=503)
            backend, stream, attempts = await open_stream_with_fallbacks(chain, CHAT, "chat", reg)
            assert (backend.name, attempts) == ("good", 2)
            await stream.aclose()
            # flaky answers its first chunk, then drops: the error reaches the caller, no fallback mid-stream
            backend, stream, attempts = await open_stream_with_fallbacks(
                chain, {**CHAT, "max_tokens": 10}, "chat", reg)
            assert backend.name == "flaky"
            got = []
            with pytest.raises(UpstreamError) as exc:
                async for chunk in stream:
                    got.append(chunk)
            await stream.aclose()
            assert exc.value.kind == "protocol" and len(got) == 2
            assert reg["flaky"].failures == 1  # the mid-stream failure counts against the backend
            assert standin_stats(good)["requests"] == 1


async def test_closing_an_unread_fallback_stream_closes_upstream() -> None:
    with run_standin(token_delay_ms=50) as url:
        async with backends(spec("a", url)) as chain:
            _, stream, _ = await open_stream_with_fallbacks(chain, {**CHAT, "max_tokens": 100}, "chat",
                                                            BreakerRegistry())
            await stream.aclose()  # the client left right after the first chunk
            for _ in range(100):
                if standin_stats(url)["disconnects"] == 1:
                    break
                await asyncio.sleep(0.02)
            assert standin_stats(url)["disconnects"] == 1


async def test_cancelled_probe_releases_the_half_open_slot() -> None:
    with run_standin(first_byte_delay_ms=2000) as url:
        reg = BreakerRegistry()
        s = spec("a", url, max_retries=0, failure_threshold=1, cooldown_s=0.0)
        reg.get(s).record_failure()  # open, cooldown already over
        async with backends(s) as chain:
            task = asyncio.create_task(complete_with_fallbacks(chain, CHAT, "chat", reg))
            await asyncio.sleep(0.2)
            assert not reg["a"].allow()  # the probe is in flight: nobody else gets through
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert reg["a"].allow()  # slot released, a new probe may go


def test_circuit_breaker_state_machine_with_a_fake_clock() -> None:
    now = [100.0]
    b = CircuitBreaker("x", failure_threshold=3, cooldown_s=10, clock=lambda: now[0])
    b.record_failure()
    b.record_failure()
    b.record_success()  # consecutive failures only
    b.record_failure()
    b.record_failure()
    assert b.state is BreakerState.CLOSED and b.allow()
    b.record_failure()
    assert b.state is BreakerState.OPEN and not b.allow()
    now[0] += 9.9
    assert not b.allow()
    now[0] += 0.2
    assert b.state is BreakerState.HALF_OPEN
    assert b.allow() and not b.allow()  # exactly one probe
    b.record_success()
    assert b.state is BreakerState.CLOSED and b.allow() and b.allow()


def test_registry_keeps_state_across_reloads_and_takes_new_settings() -> None:
    reg = BreakerRegistry()
    old = BackendSpec(name="a", kind="engine", model="m", api_base="http://h/v1", failure_threshold=1)
    reg.get(old).record_failure()
    new = old.model_copy(update={"failure_threshold": 5, "cooldown_s": 1.0})
    breaker = reg.get(new)
    assert breaker.state is BreakerState.OPEN and breaker.failure_threshold == 5 and breaker.cooldown_s == 1.0


def test_backoff_grows_with_jitter_and_honours_small_retry_after() -> None:
    s = BackendSpec(name="a", kind="engine", model="m", api_base="http://h/v1", retry_backoff_s=0.2)
    for retry in range(3):
        d = backoff_delay(s, retry, None)
        assert 0.1 * 2 ** retry <= d <= 0.3 * 2 ** retry
    assert backoff_delay(s, 0, 1.5) == 1.5
    assert backoff_delay(s, 0, 30) is None
