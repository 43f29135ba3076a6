"""The engine's OpenAI server, driven by the official `openai` SDK against a real `switchyard engine serve`
subprocess on 127.0.0.1 (tiny random-weight Llama saved with transformers, byte-level BPE tokenizer)."""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
import torch

from hosted.tokenizer import Tokenizer
from tests.hosted.serving_helpers import EngineProcess, build_tiny_chat_model

openai = pytest.importorskip("openai")

MODEL = "tiny-llama"
LONG_TEXT = ("The engine streamed tokens while the server listened and answered every question. " * 6).strip()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_chat_model(tmp_path_factory.mktemp("serve") / MODEL)


@pytest.fixture(scope="module")
def server(model_dir):
    proc = EngineProcess(model_dir, "--max-num-seqs", "16", "--max-waiting", "64")
    yield proc
    code = proc.stop()
    assert code == 0, proc.log  # SIGTERM shuts down cleanly


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def _hf_greedy(hf_model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def _wait_idle(server: EngineProcess, timeout: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        idle = (m["switchyard_engine_requests_running"] == 0 and m["switchyard_engine_requests_waiting"] == 0
                and m["switchyard_engine_kv_blocks_free"] == m["switchyard_engine_kv_blocks_total"])
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


# ------------------------------------------------------------------------------------------------ basics
def test_health_models_and_metrics(server, client):
    assert httpx.get(server.base_url + "/health").json()["status"] == "ok"
    assert [m.id for m in client.models.list().data] == [MODEL]
    m = server.metrics()
    for name in ("switchyard_engine_time_to_first_token_seconds_count",
                 "switchyard_engine_time_per_output_token_seconds_count", "switchyard_engine_requests_running",
                 "switchyard_engine_requests_waiting", "switchyard_engine_kv_blocks_used",
                 "switchyard_engine_kv_blocks_free", "switchyard_engine_prefix_cache_hit_rate",
                 "switchyard_engine_busy_fraction", 'switchyard_engine_requests_total{status="success"}'):
        assert name in m, name


def test_chat_greedy_matches_transformers_and_streams_the_same_text(client, tokenizer, hf_model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=20,
                                          extra_body={"ignore_eos": True})
    prompt_ids = tokenizer.encode_chat(messages)
    expected_ids = _hf_greedy(hf_model, prompt_ids, 20)
    assert resp.choices[0].message.content == tokenizer.decode(expected_ids)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.usage.completion_tokens == 20
    assert resp.usage.total_tokens == len(prompt_ids) + 20
    ext = resp.model_extra["switchyard"]
    assert ext["device_seconds"] > 0 and 0 <= ext["utilisation"] <= 1
    assert ext["device_kind"] == "cpu"  # each answer says what served it (the gateway prices the row by it)

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=20,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == resp.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["length"]
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 20
    assert usage_chunk.model_extra["switchyard"]["device_seconds"] > 0

    # Without include_usage the extension rides on the last chunk.
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=5,
                                                 stream=True))
    assert chunks[-1].choices[0].finish_reason is not None
    assert "switchyard" in chunks[-1].model_extra and chunks[-1].usage is None


def test_content_parts_are_joined_like_vllm(client, tokenizer):
    parts = [{"type": "text", "text": "First part."}, {"type": "text", "text": "Second part."}]
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}],
                                          max_tokens=1)
    joined = [{"role": "user", "content": "First part.\nSecond part."}]
    assert resp.usage.prompt_tokens == len(tokenizer.encode_chat(joined))
    with pytest.raises(openai.BadRequestError):  # images are not text: refused, not silently dropped
        client.chat.completions.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])


def test_completion_prompt_forms(client, tokenizer, hf_model):
    text_prompt = "The quick brown fox"
    ids = tokenizer.encode(text_prompt)
    expected = tokenizer.decode(_hf_greedy(hf_model, ids, 12))
    by_text = client.completions.create(model=MODEL, prompt=text_prompt, temperature=0, max_tokens=12,
                                        extra_body={"ignore_eos": True})
    by_ids = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=12,
                                       extra_body={"ignore_eos": True})
    assert by_text.choices[0].text == by_ids.choices[0].text == expected
    assert by_text.usage.prompt_tokens == len(ids)

    many = client.completions.create(model=MODEL, prompt=[text_prompt, "Hello there"], temperature=0,
                                     max_tokens=12, extra_body={"ignore_eos": True})
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == expected
    many_ids = client.completions.create(model=MODEL, prompt=[ids, tokenizer.encode("Hello there")],
                                         temperature=0, max_tokens=12, extra_body={"ignore_eos": True})
    assert [c.text for c in many_ids.choices] == [c.text for c in many.choices]
    assert many.usage.prompt_tokens == len(ids) + len(tokenizer.encode("Hello there"))
    assert many.usage.completion_tokens == 24

    streamed = client.completions.create(model=MODEL, prompt=text_prompt, temperature=0, max_tokens=12,
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected
    echoed = client.completions.create(model=MODEL, prompt=text_prompt, temperature=0, max_tokens=12, echo=True,
                                       extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == text_prompt + expected


def test_cached_tokens_on_a_repeated_long_prompt(client):
    messages = [{"role": "system", "content": LONG_TEXT}, {"role": "user", "content": "Summarise."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 64
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 64 and cached % 16 == 0 and cached < second.usage.prompt_tokens
    assert first.choices[0].message.content == second.choices[0].message.content


def test_n_choices_share_the_prompt(server, client):
    before = server.metrics()["switchyard_engine_prefix_cache_hit_tokens"]
    prompt = LONG_TEXT + " A fresh prompt for n."
    resp = client.completions.create(model=MODEL, prompt=prompt, n=3, temperature=0, max_tokens=6,
                                     extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert len({c.text for c in resp.choices}) == 1  # greedy: the same continuation three times
    assert resp.usage.completion_tokens == 18
    hits = server.metrics()["switchyard_engine_prefix_cache_hit_tokens"] - before
    full_blocks = (resp.usage.prompt_tokens // 16) * 16
    assert hits >= 2 * min(full_blocks, resp.usage.prompt_tokens - 1) - 32  # choices 1 and 2 reused choice 0's KV

    sampled = client.completions.create(model=MODEL, prompt="Once upon", n=2, temperature=1.0, seed=3,
                                        max_tokens=16, extra_body={"ignore_eos": True})
    assert len(sampled.choices) == 2 and sampled.choices[0].text != sampled.choices[1].text
    single = client.completions.create(model=MODEL, prompt="Once upon", temperature=1.0, seed=3, max_tokens=16,
                                       extra_body={"ignore_eos": True})
    assert single.choices[0].text == sampled.choices[0].text  # choice 0 keeps the request's seed
    streamed = client.completions.create(model=MODEL, prompt="Once upon", n=2, temperature=1.0, seed=3,
                                         max_tokens=16, stream=True, extra_body={"ignore_eos": True})
    texts = ["", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in sampled.choices]


def test_logprobs_chat_and_completions(client):
    messages = [{"role": "user", "content": "Count."}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8,
                                          logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert len(content) == 8
    for entry in content:
        tops = entry.top_logprobs
        assert len(tops) == 3
        assert [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        assert entry.logprob == pytest.approx(tops[0].logprob, abs=1e-5)  # greedy picks the top token
        assert entry.logprob <= 0
    joined = bytes(b for entry in content for b in entry.bytes).decode("utf-8", errors="replace")
    assert joined == resp.choices[0].message.content

    comp = client.completions.create(model=MODEL, prompt="Hello", temperature=0, max_tokens=6, logprobs=2,
                                     extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)
    stream = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8,
                                            logprobs=True, top_logprobs=3, stream=True,
                                            extra_body={"ignore_eos": True})
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]


def test_stop_strings_cut_the_text(client):
    prompt = "The quick brown fox"
    full = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=40,
                                     extra_body={"ignore_eos": True}).choices[0].text
    candidates = [full[i:i + 2] for i in range(3, len(full) - 2) if "\ufffd" not in full[i:i + 2]]
    assert candidates, full
    stop = candidates[len(candidates) // 2]
    cut = full[:full.index(stop)]
    resp = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=40, stop=[stop, "@@@@"],
                                     extra_body={"ignore_eos": True})
    assert resp.choices[0].text == cut
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens < 40
    pieces = [c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=40, stop=stop, stream=True,
        extra_body={"ignore_eos": True}) if c.choices]
    assert "".join(pieces) == cut


def test_seed_reproducibility(client):
    kw = {"model": MODEL, "prompt": "Once upon a time", "temperature": 1.0, "max_tokens": 24,
          "extra_body": {"ignore_eos": True}}
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    c = client.completions.create(seed=4321, **kw).choices[0].text
    assert a == b
    assert a != c


def test_stop_token_ids_and_penalties(client, tokenizer, hf_model):
    ids = tokenizer.encode("Hello")
    greedy = _hf_greedy(hf_model, ids, 30)
    k = next(i for i in range(2, 30) if greedy[i] not in greedy[:i])
    resp = client.completions.create(model=MODEL, prompt="Hello", temperature=0, max_tokens=30,
                                     extra_body={"ignore_eos": True, "stop_token_ids": [greedy[k]]})
    # The stop token ends the request: counted as generated, not rendered.
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens == k + 1
    assert resp.choices[0].text == tokenizer.decode(greedy[:k])
    plain = client.completions.create(model=MODEL, prompt="Hello", temperature=0, max_tokens=30,
                                      extra_body={"ignore_eos": True})
    assert plain.choices[0].text == tokenizer.decode(greedy)
    assert len(set(greedy)) < len(greedy)  # the unpenalised greedy text repeats tokens ...
    penalised = client.completions.create(model=MODEL, prompt="Hello", temperature=0, max_tokens=30,
                                          frequency_penalty=2.0, presence_penalty=2.0,
                                          extra_body={"ignore_eos": True})
    assert penalised.choices[0].text != plain.choices[0].text  # ... which the penalties change


# ------------------------------------------------------------------------------------------------ errors
def test_bad_requests_get_openai_400s(server, client):
    too_long = "word " * 700
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=too_long, max_tokens=10)
    body = info.value.body
    assert body["code"] == "context_length_exceeded" and "512" in body["message"]
    prompt_len = len(Tokenizer.from_dir(server_model_dir(server)).encode(too_long))
    assert str(prompt_len) in body["message"]

    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="", max_tokens=10)
    assert info.value.body["code"] == "empty_prompt"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[], max_tokens=10)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=-1)
    assert info.value.body["param"] == "temperature"
    # (top_p 0 and an empty stop string are OpenAI's to accept: tests/e2e/test_schema_parity.py)
    for bad in ({"n": 0}, {"max_tokens": 0}, {"presence_penalty": 3}, {"top_logprobs": 2}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], **bad)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[10**6], max_tokens=3)
    assert "vocabulary" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert info.value.body["code"] == "model_not_found"

    raw = httpx.post(server.base_url + "/v1/chat/completions", content=b"{not json",
                     headers={"content-type": "application/json"})
    assert raw.status_code == 400
    assert set(raw.json()["error"]) == {"message", "type", "param", "code"}
    m = _wait_idle(server)
    assert m['switchyard_engine_requests_total{status="invalid"}'] >= 10
    assert m['switchyard_engine_requests_total{status="not_found"}'] >= 1


def server_model_dir(server: EngineProcess):
    args = server.proc.args
    return args[args.index("--model") + 1]


# ------------------------------------------------------------------------------------------------ disconnects
def test_streaming_disconnect_aborts_and_frees_blocks(server):
    before = server.metrics()['switchyard_engine_requests_total{status="aborted"}']
    body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 480, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", server.base_url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data: ") and '"text"' in line:
                got += 1
                if got >= 1:  # the first token; the rest comes in decode bursts of up to 20 ms each
                    break
        running = server.metrics()["switchyard_engine_requests_running"]
        assert running >= 1  # still generating when we hang up
    m = _wait_idle(server)
    assert m["switchyard_engine_requests_running"] == 0
    assert m["switchyard_engine_kv_blocks_free"] == m["switchyard_engine_kv_blocks_total"]
    assert m['switchyard_engine_requests_total{status="aborted"}'] == before + 1


def test_plain_disconnect_aborts_and_frees_blocks(server):
    before = server.metrics()['switchyard_engine_requests_total{status="aborted"}']
    body = json.dumps({"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 480, "n": 4,
                       "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head + body)
        deadline = time.monotonic() + 20
        while server.metrics()["switchyard_engine_requests_running"] < 1:  # hang up mid-generation
            assert time.monotonic() < deadline
            time.sleep(0.005)
    m = _wait_idle(server)
    assert m["switchyard_engine_requests_running"] == 0
    assert m["switchyard_engine_kv_blocks_free"] == m["switchyard_engine_kv_blocks_total"]
    assert m['switchyard_engine_requests_total{status="aborted"}'] == before + 1
