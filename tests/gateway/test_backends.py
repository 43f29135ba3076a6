"""Backends against the stand-in upstream over real sockets: both kinds, plain and streamed, errors mapped."""
from __future__ import annotations

import asyncio
import contextlib

import pytest

from gateway.backends import StreamTally, UpstreamError, Usage, build_backend, usage_from_chunk
from gateway.backends.base import engine_stats
from gateway.listen_address import free_port
from gateway.policy import BackendSpec
from gateway.testing.standin import run_standin, standin_control, standin_stats

CHAT = {"model": "ignored", "messages": [{"role": "user", "content": "one two three four"}], "max_tokens": 5}
TEXT = {"model": "ignored", "prompt": "alpha beta gamma", "max_tokens": 4}


def engine_spec(url: str, **kw) -> BackendSpec:
    return BackendSpec(name=kw.pop("name", "eng"), kind="engine", model="demo", api_base=url, **kw)


def litellm_spec(url: str, **kw) -> BackendSpec:
    return BackendSpec(name=kw.pop("name", "api"), kind="litellm", model="openai/gpt-4o-mini", api_base=url,
                       api_key_env="STANDIN_TEST_KEY", **kw)


@pytest.fixture(autouse=True)
def _api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STANDIN_TEST_KEY", "sk-standin")


@pytest.fixture
def upstream():
    with run_standin(engine_extension=True, cached_tokens=2) as url:
        yield url




async def drain(stream) -> list[dict]:
    out = []
    async with contextlib.aclosing(stream) as s:
        async for chunk in s:
            out.append(chunk)
    return out


def content_of(chunks: list[dict], chat: bool = True) -> str:
    key = "delta" if chat else None
    parts = []
    for c in chunks:
        for ch in c["choices"]:
            parts.append((ch[key].get("content") if key else ch.get("text")) or "")
    return "".join(parts)


@pytest.mark.parametrize("make_spec", [engine_spec, litellm_spec], ids=["engine", "litellm"])
async def test_complete_chat_and_text(upstream: str, make_spec) -> None:
    backend = build_backend(make_spec(upstream))
    try:
        done = await backend.complete(CHAT, "chat")
        assert done.body["object"] == "chat.completion"
        assert done.body["choices"][0]["message"]["content"] == "tok0 tok1 tok2 tok3 tok4"
        assert done.usage == Usage(prompt_tokens=4, completion_tokens=5, cached_prompt_tokens=2)
        sent = standin_stats(upstream)["last_payload"]
        assert sent["model"] in ("demo", "gpt-4o-mini")  # model replaced by the backend's
        assert sent["messages"] == CHAT["messages"] and sent["max_tokens"] == 5
        assert not sent.get("stream")
        text = await backend.complete(TEXT, "completions")
        assert text.body["object"] == "text_completion"
        assert text.body["choices"][0]["text"] == "tok0 tok1 tok2 tok3"
        assert text.usage == Usage(3, 4, 2)
        if backend.spec.kind == "engine":
            assert sent["model"] == "demo"
            assert done.device_seconds == pytest.approx(9 * 0.001) and done.utilisation == 0.5
            assert done.body["switchyard"] == {"device_seconds": pytest.approx(0.009), "utilisation": 0.5}
        else:
            assert done.device_seconds is None
            assert "provider_specific_fields" not in done.body["choices"][0]
        assert CHAT["model"] == "ignored"  # the caller's payload is left alone
    finally:
        await backend.aclose()


@pytest.mark.parametrize("make_spec", [engine_spec, litellm_spec], ids=["engine", "litellm"])
async def test_stream_chat_and_text_with_usage(upstream: str, make_spec) -> None:
    backend = build_backend(make_spec(upstream))
    try:
        chunks = await drain(backend.stream(CHAT, "chat"))
        sent = standin_stats(upstream)["last_payload"]
        assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert content_of(chunks) == "tok0 tok1 tok2 tok3 tok4"
        assert usage_from_chunk(chunks[-1]) == Usage(4, 5, 2)
        tally = StreamTally(keep_text=True)
        for c in chunks:
            tally.observe(c)
        assert tally.complete_usage and tally.usage() == Usage(4, 5, 2) and tally.text() == "tok0 tok1 tok2 tok3 tok4"
        if backend.spec.kind == "engine":
            assert engine_stats(chunks[-1]) == (pytest.approx(0.009), 0.5, None)  # the stand-in names no device
            assert tally.device_seconds == pytest.approx(0.009)
        text_chunks = await drain(backend.stream(TEXT, "completions"))
        assert content_of(text_chunks, chat=False) == "tok0 tok1 tok2 tok3"
        assert usage_from_chunk(text_chunks[-1]) == Usage(3, 4, 2)
        # keep-alive: the engine's pooled clients (plain requests: http1.py; streams: aiohttp, already open from
        # the streams above) reuse their connections: one new for the plain requests, +1 this stats call's own
        if backend.spec.kind == "engine":
            before = standin_stats(upstream)["connections_total"]
            for _ in range(3):
                await backend.complete(CHAT, "chat")
                await drain(backend.stream(CHAT, "chat"))
            assert standin_stats(upstream)["connections_total"] == before + 2
    finally:
        await backend.aclose()


@pytest.mark.parametrize("make_spec", [engine_spec, litellm_spec], ids=["engine", "litellm"])
@pytest.mark.parametrize("status, retryable, fallback", [(400, False, False), (401, False, True),
                                                         (404, False, True), (422, False, False),
                                                         (429, True, True), (500, True, True), (503, True, True)])
async def test_http_errors_are_typed(upstream: str, make_spec, status: int, retryable: bool, fallback: bool) -> None:
    backend = build_backend(make_spec(upstream))
    try:
        standin_control(upstream, fail_next=2, fail_status=status, retry_after=0.25)
        with pytest.raises(UpstreamError) as exc:
            await backend.complete(CHAT, "chat")
        e = exc.value
        assert (e.kind, e.status, e.retryable, e.fallback, e.backend) == ("http", status, retryable, fallback,
                                                                          backend.name)
        assert e.retry_after == 0.25
        if make_spec is engine_spec or status in (400, 422, 429, 500):  # litellm drops some bodies
            assert e.body["error"]["message"] == f"standin: injected {status}"
        with pytest.raises(UpstreamError) as exc:
            await drain(backend.stream(CHAT, "chat"))
        assert exc.value.status == status
    finally:
        await backend.aclose()


@pytest.mark.parametrize("make_spec", [engine_spec, litellm_spec], ids=["engine", "litellm"])
async def test_connect_refused_and_timeout(make_spec) -> None:
    refused = build_backend(make_spec(f"http://127.0.0.1:{free_port()}/v1"))
    with pytest.raises(UpstreamError) as exc:
        await refused.complete(CHAT, "chat")
    assert exc.value.kind == "connect" and exc.value.retryable and exc.value.status is None
    with pytest.raises(UpstreamError) as exc:
        await drain(refused.stream(CHAT, "chat"))
    assert exc.value.kind == "connect"
    await refused.aclose()
    with run_standin(first_byte_delay_ms=3000) as url:
        slow = build_backend(make_spec(url, timeout_s=0.3))
        with pytest.raises(UpstreamError) as exc:
            await slow.complete(CHAT, "chat")
        assert exc.value.kind == "timeout" and exc.value.retryable
        await slow.aclose()


async def test_engine_mid_stream_drop_is_a_protocol_error() -> None:
    with run_standin(drop_after_tokens=2) as url:
        backend = build_backend(engine_spec(url))
        got: list[dict] = []
        with pytest.raises(UpstreamError) as exc:
            async with contextlib.aclosing(backend.stream({**CHAT, "max_tokens": 10}, "chat")) as s:
                async for chunk in s:
                    got.append(chunk)
        assert exc.value.kind == "protocol" and len(got) == 2
        await backend.aclose()


@pytest.mark.parametrize("make_spec", [engine_spec, litellm_spec], ids=["engine", "litellm"])
@pytest.mark.parametrize("how", ["cancel", "aclose"])
async def test_stream_cancellation_closes_upstream(make_spec, how: str) -> None:
    with run_standin(token_delay_ms=50) as url:
        backend = build_backend(make_spec(url))
        stream = backend.stream({**CHAT, "max_tokens": 200}, "chat")
        seen = asyncio.Event()

        async def consume() -> None:
            async for _chunk in stream:
                seen.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(seen.wait(), 10)
        assert standin_stats(url)["in_flight"] == 1
        if how == "cancel":  # a client disconnect cancels the request's task
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await stream.aclose()
        for _ in range(100):  # the upstream sees the disconnect long before its 200 × 50 ms stream ends
            stats = standin_stats(url)
            if stats["disconnects"] == 1:
                break
            await asyncio.sleep(0.02)
        assert stats["disconnects"] == 1 and stats["completed"] == 0 and stats["in_flight"] == 0
        await backend.aclose()


def test_build_backend_embedded_engine_needs_a_url() -> None:
    spec = BackendSpec(name="local", kind="engine", model="demo", launch="embedded")
    with pytest.raises(ValueError, match="api_base"):
        build_backend(spec)
    assert build_backend(spec, "http://127.0.0.1:8100/v1").api_base == "http://127.0.0.1:8100/v1"
    with_port = BackendSpec(name="local", kind="engine", model="demo", launch="embedded", engine_port=8123)
    assert build_backend(with_port).api_base == "http://127.0.0.1:8123/v1"


def test_stream_tally_without_usage_counts_chunks() -> None:
    tally = StreamTally()
    for piece in ("a", " b", "", " c"):
        tally.observe({"choices": [{"index": 0, "delta": {"content": piece}}]})
    assert not tally.complete_usage
    assert tally.usage(prompt_tokens=7) == Usage(7, 3, 0)
    assert usage_from_chunk({"choices": []}) is None
    assert usage_from_chunk({"usage": {"prompt_tokens": 3, "completion_tokens": 1,
                                       "prompt_tokens_details": None}}) == Usage(3, 1, 0)
