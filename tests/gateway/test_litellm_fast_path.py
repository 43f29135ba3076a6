"""`kind: litellm` backends on OpenAI-wire providers take the fast path (gateway/backends/openai_wire_fast.py): no
`litellm.acompletion`, litellm's request translation, one pooled session. It must send what the full litellm call
sends and answer what it answers; `fast_path: false` keeps the full call."""
from __future__ import annotations

import asyncio
import contextlib

import litellm
import pytest

from gateway.backends import UpstreamError, build_backend
from gateway.backends.litellm_backend import LiteLLMBackend
from gateway.policy import BackendSpec, parse_policy
from gateway.testing.standin import run_standin, standin_stats

KEY = "sk-fastpath-0123456789abcdef"
USER = [{"role": "user", "content": "hello there friend"}]


@pytest.fixture
def upstream(monkeypatch):
    monkeypatch.setenv("SY_FAST_KEY", KEY)
    with run_standin() as url:
        yield url


def spec(url: str | None, model: str = "openai/gpt-4o-mini", **kw) -> BackendSpec:
    return BackendSpec(name=kw.pop("name", "api"), kind="litellm", model=model, api_base=url,
                       api_key_env=kw.pop("api_key_env", "SY_FAST_KEY"), **kw)


async def sent_and_answered(url: str, backend: LiteLLMBackend, payload: dict, endpoint: str, stream: bool):
    """(what the upstream received, what the backend answered) for one call."""
    try:
        if stream:
            async with contextlib.aclosing(backend.stream(dict(payload), endpoint)) as chunks:
                answer = [c async for c in chunks]
        else:
            answer = (await backend.complete(dict(payload), endpoint)).body
    finally:
        await backend.aclose()
    return standin_stats(url)["last_payload"], answer


def test_the_fast_path_is_chosen_once_per_backend_for_openai_wire_providers_only():
    assert LiteLLMBackend(spec("http://127.0.0.1:9/v1"))._fast is not None
    assert LiteLLMBackend(spec("http://127.0.0.1:9/v1", model="hosted_vllm/qwen"))._fast is not None
    assert LiteLLMBackend(spec(None))._fast is not None  # openai/… without api_base: OpenAI's own URL
    assert LiteLLMBackend(spec("http://127.0.0.1:9/v1", fast_path=False))._fast is None
    for model in ("anthropic/claude-3-5-sonnet-20240620", "azure/my-deployment"):
        assert LiteLLMBackend(spec("http://127.0.0.1:9", model=model))._fast is None
    # litellm sends a known chat model's completions as chat: that endpoint stays litellm's
    assert "completions" not in LiteLLMBackend(spec("http://127.0.0.1:9/v1"))._fast.endpoints
    assert "completions" in LiteLLMBackend(spec("http://127.0.0.1:9/v1", model="openai/my-model"))._fast.endpoints


def test_the_policy_option_reads_from_yaml():
    text = "backends:\n  a: {kind: litellm, model: openai/m, fast_path: false}\n  b: {kind: litellm, model: openai/m}\n" \
           "routes:\n  r: {backend: a}\n"
    policy = parse_policy(text, "p.yaml")
    assert (policy.backends["a"].fast_path, policy.backends["b"].fast_path) == (False, True)


CASES = [  # (model, endpoint, payload, stream)
    ("openai/gpt-4o-mini", "chat", {"messages": USER, "max_tokens": 3, "temperature": 0.5, "seed": 7}, False),
    ("openai/gpt-4o-mini", "chat", {"messages": USER, "max_tokens": 3, "stream_options": {"include_usage": False}},
     True),
    ("openai/gpt-4o-mini", "chat", {"messages": [{"role": "developer", "content": "be brief"}, *USER],
                                    "max_tokens": 2, "metadata": {"team": "a"}, "user": "u-1"}, False),
    ("openai/o3-mini", "chat", {"messages": USER, "max_tokens": 4}, False),  # litellm: max_completion_tokens
    ("openai/gpt-4o-mini", "chat", {"messages": USER, "max_tokens": 2, "top_k": 5}, False),  # not OpenAI's: as is
    ("openai/o3-mini", "chat", {"messages": USER, "temperature": 0.5}, False),  # litellm refuses: the same 400
    ("hosted_vllm/qwen", "chat", {"messages": USER, "max_tokens": 2, "tools": [{"type": "function", "function": {
        "name": "f", "strict": True, "parameters": {"type": "object", "properties": {},
                                                    "additionalProperties": False}}}]}, False),
    ("openai/my-model", "completions", {"prompt": "hello there", "max_tokens": 3}, False),
    ("openai/my-model", "completions", {"prompt": "hello there", "max_tokens": 3}, True),
    ("openai/text-embedding-3-small", "embeddings", {"input": ["a b", "c"], "encoding_format": "base64"}, False),
    ("openai/text-embedding-3-small", "embeddings", {"input": "a b", "dimensions": 4}, False),
    ("openai/gpt-4o-mini", "responses", {"input": "hello there", "max_output_tokens": 3}, False),
    ("openai/gpt-4o-mini", "responses", {"input": "hello there", "max_output_tokens": 3}, True),
]


async def _outcome(url: str, backend: LiteLLMBackend, payload: dict, endpoint: str, stream: bool):
    try:
        return await sent_and_answered(url, backend, payload, endpoint, stream)
    except UpstreamError as e:
        return e


def _comparable(answer, endpoint: str):
    """What a client reads of an answer (ids, timestamps and litellm's null fields aside)."""
    if isinstance(answer, list):
        return [_comparable(a, endpoint) for a in answer if a.get("choices") or a.get("usage") or a.get("type")]
    if endpoint == "responses":
        response = answer.get("response", answer)
        return answer.get("type"), answer.get("delta"), response.get("status"), \
            (response.get("usage") or {}).get("output_tokens")
    if endpoint == "embeddings":
        return [d["embedding"] for d in answer["data"]], answer["usage"]
    usage = answer.get("usage") or {}
    return ([(c.get("text"), (c.get("message") or c.get("delta") or {}).get("content"), c.get("finish_reason"))
             for c in answer["choices"]], usage.get("prompt_tokens"), usage.get("completion_tokens"))


@pytest.mark.parametrize(("model", "endpoint", "payload", "stream"), CASES)
async def test_the_fast_path_sends_and_answers_what_the_full_litellm_call_does(upstream, model, endpoint, payload,
                                                                               stream):
    payload = {"model": "route-name", **payload}
    full = await _outcome(upstream, LiteLLMBackend(spec(upstream, model, fast_path=False)), payload, endpoint, stream)
    fast_backend = LiteLLMBackend(spec(upstream, model))
    assert fast_backend._fast is not None and endpoint in fast_backend._fast.endpoints
    fast = await _outcome(upstream, fast_backend, payload, endpoint, stream)
    if isinstance(full, UpstreamError):  # refused by litellm's translation: the same typed error, nothing sent
        assert isinstance(fast, UpstreamError), fast
        assert (fast.kind, fast.status, fast.detail) == (full.kind, full.status, full.detail)
        assert standin_stats(upstream)["requests"] == 0
        return
    assert fast[0] == full[0]  # the upstream received the same request
    assert _comparable(fast[1], endpoint) == _comparable(full[1], endpoint)


async def test_the_fast_path_does_not_call_litellm_and_reuses_one_connection(upstream, monkeypatch):
    async def refuse(*args, **kwargs):
        raise AssertionError("litellm called on the fast path")

    for name in ("acompletion", "atext_completion", "aembedding", "aresponses"):
        monkeypatch.setattr(litellm, name, refuse)
    backend = build_backend(spec(upstream))
    before = standin_stats(upstream)["connections_total"]
    try:
        for _ in range(5):
            assert (await backend.complete({"model": "m", "messages": USER, "max_tokens": 2}, "chat")).usage \
                       .completion_tokens == 2
            async with contextlib.aclosing(backend.stream({"model": "m", "messages": USER, "max_tokens": 2},
                                                          "chat")) as chunks:
                assert [c async for c in chunks][-1]["usage"]["completion_tokens"] == 2
    finally:
        await backend.aclose()
    # one pooled connection for the five plain calls (http1.py), one for the five streams (aiohttp), +1: the
    # stats call's own
    assert standin_stats(upstream)["connections_total"] - before == 3


async def test_client_fields_never_steer_the_call_and_a_rotated_key_is_read_per_call(upstream, monkeypatch):
    backend = build_backend(spec(upstream))
    try:
        body = {"model": "m", "messages": USER, "max_tokens": 2, "api_base": "http://127.0.0.1:9/v1",
                "api_key": "sk-client", "timeout": 0.001, "extra_body": {"x": 1}, "num_retries": 5}
        assert (await backend.complete(body, "chat")).usage.completion_tokens == 2
        sent = standin_stats(upstream)["last_payload"]
        assert not {"api_base", "api_key", "timeout", "extra_body", "x", "num_retries"} & set(sent)
        assert sent["model"] == "gpt-4o-mini"
        assert backend._fast.api_key() == KEY
        monkeypatch.setenv("SY_FAST_KEY", "sk-rotated-0123456789")
        assert backend._fast.api_key() == "sk-rotated-0123456789"
    finally:
        await backend.aclose()


@pytest.mark.parametrize("fields", [
    {"messages": [{"role": "user", "content": 42}]},
    {"messages": USER, "response_format": "json"},
    {"messages": "hello"},
])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_litellm_would_refuse_is_the_clients_fault_and_never_sent(upstream, fields, stream):
    backend = build_backend(spec(upstream, model="openai/m"))
    with pytest.raises(UpstreamError) as err:
        await sent_and_answered(upstream, backend, {"model": "m", **fields}, "chat", stream)
    e = err.value
    assert (e.kind, e.retryable, e.fallback, e.counts_against_backend) == ("request", False, False, False)
    assert "litellm" not in (e.detail or "").lower()
    assert standin_stats(upstream)["requests"] == 0


async def test_without_a_key_the_call_is_litellms_and_fails_as_it_did(upstream, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    backend = build_backend(spec(upstream, api_key_env=None))
    with pytest.raises(UpstreamError) as err:
        await backend.complete({"model": "m", "messages": USER}, "chat")
    assert "OPENAI_API_KEY" in (err.value.detail or "") and standin_stats(upstream)["requests"] == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_a_reload_closing_the_backend_lets_the_calls_in_flight_finish(monkeypatch, stream):
    """A policy reload closes a replaced backend at once (gateway/backend_pool.py); requests in flight finish on
    the policy they started with, so the fast path's pool closes only after them."""
    monkeypatch.setenv("SY_FAST_KEY", KEY)
    with run_standin(first_byte_delay_ms=300, token_delay_ms=20) as url:
        backend = build_backend(spec(url))
        payload = {"model": "m", "messages": USER, "max_tokens": 5}
        if stream:
            chunks = backend.stream(dict(payload), "chat")
            first = await chunks.__anext__()
            await backend.aclose()
            rest = [c async for c in chunks]
            assert first["choices"] and rest[-1]["usage"]["completion_tokens"] == 5
        else:
            call = asyncio.create_task(backend.complete(dict(payload), "chat"))
            for _ in range(200):
                if standin_stats(url)["in_flight"] == 1:
                    break
                await asyncio.sleep(0.01)
            await backend.aclose()
            assert (await call).usage.completion_tokens == 5
        fast = backend._fast  # and then its pools are closed
        assert fast._session is None or fast._session.closed
        assert fast._pool is None or fast._pool._idle == []
