"""An upstream is not trusted: redaction of its text, bounded reading of its answers, and how the backends and
the fallback loop type a malformed or oversized answer (against the stand-in over real sockets)."""
from __future__ import annotations

import contextlib

import pytest

from gateway.backends import BreakerRegistry, UpstreamError, build_backend, complete_with_fallbacks
from gateway.backends.guard import AnswerRejected, SSELines
from gateway.policy import BackendSpec
from gateway.redact import configured_secrets, redact
from gateway.testing.standin import run_standin, standin_control, standin_stats

CHAT = {"model": "x", "messages": [{"role": "user", "content": "one two"}], "max_tokens": 3}
KEY = "sk-live-4f9a8b7c6d5e4f3a2b1c"


# ---------------------------------------------------------------- redaction


@pytest.mark.parametrize(("text", "leaks"), [
    ("Incorrect API key provided: Bearer sk-abc123def456ghi. Find your key at platform", ["sk-abc123def456ghi"]),
    ("litellm.AuthenticationError: AuthenticationError: OpenAIException - bad key sk-proj-AbC123xYz789",
     ["litellm", "OpenAIException", "sk-proj-AbC123xYz789"]),
    (('Traceback (most recent call last):\n  File "/opt/venv/lib/python3.11/site-packages/httpx/_client.py", '
      "line 10, in send\nboom"), ["site-packages", "/opt/venv", "_client.py", "Traceback"]),
    ("aws AKIAIOSFODNN7EXAMPLE secret wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
     ["AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"]),
    ("azure key 0123456789abcdef0123456789abcdef and jwt eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.sig",
     ["0123456789abcdef0123456789abcdef", "eyJhbGciOiJIUzI1NiJ9"]),
    ("see https://admin:hunter2@proxy.internal/x?api_key=abc123 and x-api-key: k-99", ["hunter2", "abc123", "k-99"]),
    ("<litellm.types.utils.ModelResponse object at 0x7f00deadbeef> failed at /home/ops/app/main.py",
     ["0x7f00deadbeef", "/home/ops", "main.py"]),
])
def test_redact_masks_secrets_tokens_paths_and_internals(text, leaks):
    out = redact(text)
    for leak in leaks:
        assert leak not in out, (leak, out)


def test_redact_masks_configured_secret_values_and_keeps_ordinary_text(monkeypatch):
    monkeypatch.setenv("SY_TEST_KEY", "plainpassword")
    secrets = configured_secrets(["SY_TEST_KEY", "SY_UNSET_KEY", None])
    assert secrets == ["plainpassword"]
    assert redact("the key plainpassword was refused", secrets) == "the key [redacted] was refused"
    kept = ("The model `claude-3-5-sonnet-20241022` does not exist; try Meta-Llama-3-70B-Instruct. "
            "POST /v1/chat/completions: max_tokens must be at most 4096.")
    assert redact(kept) == kept


# ---------------------------------------------------------------- bounded SSE lines


def test_sse_lines_split_across_reads_and_bound_events_and_the_total():
    lines = SSELines(max_line=64, max_total=10_000)
    assert lines.feed(b'data: {"a"') == []
    assert lines.feed(b": 1}\n\n: keep-alive\nevent: x\ndata: [DO") == [b'data: {"a": 1}', b"", b": keep-alive",
                                                                        b"event: x"]
    assert lines.feed(b"NE]\n") == [b"data: [DONE]"]
    with pytest.raises(AnswerRejected) as exc:
        SSELines(max_line=64, max_total=10_000).feed(b"x" * 65)  # one event past the cap, no newline yet
    assert exc.value.kind == "too_large"
    total = SSELines(max_line=64, max_total=100)
    with pytest.raises(AnswerRejected) as exc:
        for _ in range(20):
            total.feed(b"data: {}\n\n")
    assert exc.value.kind == "too_large" and total.total <= 110
    with pytest.raises(AnswerRejected) as exc:
        SSELines(max_line=64, max_total=10_000).feed(b"<html>oops</html>\n")
    assert exc.value.kind == "malformed"


# ---------------------------------------------------------------- backends against the stand-in


def spec(kind: str, url: str, **kw) -> BackendSpec:
    model = "openai/m" if kind == "litellm" else "m"
    return BackendSpec(name=kw.pop("name", kind), kind=kind, model=model, api_base=url, api_key_env="SY_UT_KEY",
                       timeout_s=2, **kw)


@pytest.fixture
def upstream(monkeypatch):
    monkeypatch.setenv("SY_UT_KEY", KEY)
    with run_standin(engine_extension=True) as url:
        yield url


async def _call(backend, stream: bool):
    try:
        if stream:
            async with contextlib.aclosing(backend.stream(dict(CHAT), "chat")) as chunks:
                return [c async for c in chunks]
        return await backend.complete(dict(CHAT), "chat")
    finally:
        await backend.aclose()


CASES = [  # (fault, stream, expected kind)
    ("not_json", False, "malformed"), ("not_json", True, "malformed"), ("not_sse", True, "malformed"),
    ("bad_sse", False, "malformed"), ("bad_sse", True, "malformed"), ("huge", False, "too_large"),
    ("huge", True, "too_large"), ("huge_stream", True, "too_large"),
]


@pytest.mark.parametrize("kind", ["engine", "litellm"])
@pytest.mark.parametrize(("fault", "stream", "expected"), CASES)
async def test_a_bad_answer_is_the_upstreams_failure(upstream, kind, fault, stream, expected):
    standin_control(upstream, fault=fault, fault_next=1, huge_bytes=300_000)
    backend = build_backend(spec(kind, upstream, max_response_bytes=100_000, max_stream_bytes=200_000))
    with pytest.raises(UpstreamError) as exc:
        await _call(backend, stream)
    err = exc.value
    assert err.kind == expected, err
    assert err.retryable and err.fallback and err.counts_against_backend


async def test_an_engine_stream_ending_without_done_is_malformed(upstream):
    standin_control(upstream, fault="no_done", fault_next=1)
    with pytest.raises(UpstreamError) as exc:
        await _call(build_backend(spec("engine", upstream)), stream=True)
    assert exc.value.kind == "malformed" and "[DONE]" in exc.value.message


@pytest.mark.parametrize("kind", ["engine", "litellm"])
async def test_an_upstream_401_quoting_our_key_is_redacted_at_the_source(upstream, kind):
    standin_control(upstream, fail_next=1, fail_status=401,
                    fail_message="bad key {authorization} in /usr/lib/python3/site-packages/x.py")
    with pytest.raises(UpstreamError) as exc:
        await _call(build_backend(spec(kind, upstream)), stream=False)
    err = exc.value
    assert err.status == 401 and "bad key" in err.detail
    for text in (err.detail, err.message):
        assert KEY not in text and "site-packages" not in text


async def test_malformed_answers_move_the_breaker_and_fall_back(upstream, monkeypatch):
    with run_standin(engine_extension=True) as good:
        standin_control(upstream, fault="not_json", fault_next=10)
        registry = BreakerRegistry()
        bad = build_backend(spec("engine", upstream, name="bad", max_retries=0, failure_threshold=2))
        spare = build_backend(spec("engine", good, name="spare"))
        try:
            for _ in range(3):
                _, served, _ = await complete_with_fallbacks([bad, spare], dict(CHAT), "chat", registry)
                assert served.name == "spare"
            assert registry["bad"].times_opened == 1
            assert standin_stats(upstream)["requests"] == 2  # open after two: the third skipped it
            with pytest.raises(UpstreamError) as exc:
                await complete_with_fallbacks([bad], dict(CHAT), "chat", registry)
            assert exc.value.kind == "circuit_open" and exc.value.attempts == 0
            assert 0 < exc.value.retry_after <= 30
        finally:
            await bad.aclose()
            await spare.aclose()
