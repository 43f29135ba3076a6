"""Completions and Responses requests on chat-only upstreams (issue 31 #4), and fixed routes that skip to a capable
fallback (issue 31 #11): a real gateway, stand-in upstreams on 127.0.0.1 (one serving chat only: 404 on
/v1/completions and /v1/responses, as llama.cpp and older vLLM answer) and the official openai SDK."""
from __future__ import annotations

import time

import httpx
import openai
import pytest

from gateway.policy import PolicyError, parse_policy
from gateway.testing.standin import run_standin, standin_control, standin_stats
from tests.e2e.conftest import MASTER_KEY, ledger_rows, run_gateway

PRICES = "api_key_env: STANDIN_API_KEY, input_usd_per_mtok: 10, output_usd_per_mtok: 90"
LEARNERS = [f"learn-{endpoint}-{mode}" for endpoint in ("completions", "responses") for mode in ("plain", "stream")]
# A model litellm's map does not know (a self-hosted one): litellm sends its completions to /v1/completions.
API = "{kind: litellm, model: openai/llama-3.1-8b-instruct, api_base: CHAT, PRICES}"
POLICY = """
backends:
  declared: {kind: litellm, model: openai/llama-3.1-8b-instruct, api_base: CHAT, PRICES, endpoints: [chat]}
  eng-declared: {kind: engine, model: small, api_base: CHAT, gpu_hour_usd: 3.6, endpoints: [chat]}
  eng-learns: {kind: engine, model: small, api_base: CHAT, gpu_hour_usd: 3.6}
  learn-echo: API
LEARNER_BACKENDS
  full: {kind: litellm, model: openai/gpt-3.5-turbo-instruct, api_base: FULL, PRICES}
  vision: {kind: litellm, model: openai/gpt-4o-mini, api_base: FULL, PRICES}
  eng-full: {kind: engine, model: small, api_base: FULL, gpu_hour_usd: 3.6}
routes:
  declared: {backend: declared}
  eng-declared: {backend: eng-declared}
  eng-learns: {backend: eng-learns}
  learn-echo: {backend: learn-echo}
  chat-then-full: {backend: declared, fallbacks: [full]}
  pictures: {backend: eng-full, fallbacks: [vision]}
  full: {backend: full}
LEARNER_ROUTES
""".replace("LEARNER_BACKENDS", "\n".join(f"  {n}: API" for n in LEARNERS)).replace(
    "LEARNER_ROUTES", "\n".join(f"  {n}: {{backend: {n}}}" for n in LEARNERS)).replace("API", API).replace(
    "PRICES", PRICES)
TEXT4 = "tok0 tok1 tok2 tok3"


@pytest.fixture(scope="module")
def upstreams():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STANDIN_API_KEY", "sk-standin")
        with run_standin(chat_only=True, engine_extension=True) as chat, \
                run_standin(engine_extension=True) as full:
            yield chat, full


@pytest.fixture(scope="module")
def gateway(upstreams, tmp_path_factory):
    chat, full = upstreams
    with run_gateway(POLICY.replace("CHAT", f'"{chat}"').replace("FULL", f'"{full}"'), tmp_path_factory.mktemp("translate")) as running:
        yield running


@pytest.fixture
def chat(upstreams):
    standin_control(upstreams[0], reset=True)
    return upstreams[0]


@pytest.fixture
def full(upstreams):
    standin_control(upstreams[1], reset=True)
    return upstreams[1]


def _client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key=MASTER_KEY, max_retries=0)


def _rows(gateway, route: str) -> list[dict]:
    gateway.call(gateway.gw.services.ledger.flush)
    return ledger_rows(gateway.config.database_url, "route = :r", {"r": route})


def _api_cost(prompt: int, completion: int) -> float:
    return (prompt * 10 + completion * 90) / 1e6


def _completion(client: openai.OpenAI, route: str, stream: bool, **extra) -> tuple[str, tuple[int, int]]:
    """(text, (prompt_tokens, completion_tokens)) of one completions request, plain or streamed."""
    if not stream:
        reply = client.completions.create(model=route, prompt="one two three", max_tokens=4, **extra)
        assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
        assert reply.choices[0].finish_reason == "length"
        return reply.choices[0].text, (reply.usage.prompt_tokens, reply.usage.completion_tokens)
    chunks = list(client.completions.create(model=route, prompt="one two three", max_tokens=4, stream=True,
                                            stream_options={"include_usage": True}, **extra))
    assert all(c.object == "text_completion" for c in chunks)
    [usage] = [c.usage for c in chunks if c.usage]
    assert [c.finish_reason for c in chunks for c in c.choices if c.finish_reason] == ["length"]
    return "".join(c.text for chunk in chunks for c in chunk.choices), (usage.prompt_tokens, usage.completion_tokens)


def _response(client: openai.OpenAI, route: str, stream: bool) -> tuple[str, tuple[int, int]]:
    kwargs = {"model": route, "input": "one two three", "instructions": "be brief", "max_output_tokens": 16}
    if not stream:
        reply = client.responses.create(**kwargs)
        assert reply.object == "response" and reply.status == "incomplete"
        return reply.output_text, (reply.usage.input_tokens, reply.usage.output_tokens)
    events = list(client.responses.create(stream=True, **kwargs))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == deltas
    return deltas, (final.usage.input_tokens, final.usage.output_tokens)


TEXT16 = " ".join(f"tok{i}" for i in range(16))


# ------------------------------------------------------------------ declared chat-only: `endpoints: [chat]`


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_completions_on_a_declared_chat_only_api_are_sent_as_chat(gateway, chat, stream) -> None:
    text, usage = _completion(_client(gateway), "declared", stream)
    assert text == TEXT4 and usage == (3, 4)
    stats = standin_stats(chat)
    assert (stats["completion_requests"], stats["chat_requests"]) == (0, 1)  # never tried: the policy says so
    sent = stats["last_payload"]
    assert sent["messages"] == [{"role": "user", "content": "one two three"}] and "prompt" not in sent
    assert sent["max_tokens"] == 4
    [row] = [r for r in _rows(gateway, "declared") if r["stream"] == stream and r["endpoint"].startswith("compl")]
    assert row["endpoint"] == "completions via chat" and row["status"] == "ok" and row["backend"] == "declared"
    assert (row["prompt_tokens"], row["completion_tokens"]) == (3, 4)
    assert row["cost_usd"] == pytest.approx(_api_cost(3, 4))


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_responses_on_a_declared_chat_only_api_are_sent_as_chat(gateway, chat, stream) -> None:
    text, usage = _response(_client(gateway), "declared", stream)
    assert text == TEXT16 and usage == (5, 16)  # "be brief" + "one two three"
    stats = standin_stats(chat)
    assert (stats["responses_requests"], stats["chat_requests"]) == (0, 1)
    assert stats["last_payload"]["messages"] == [{"role": "system", "content": "be brief"},
                                                 {"role": "user", "content": "one two three"}]
    [row] = [r for r in _rows(gateway, "declared") if r["stream"] == stream and r["endpoint"].startswith("resp")]
    assert row["endpoint"] == "responses via chat" and row["status"] == "ok"
    assert (row["prompt_tokens"], row["completion_tokens"]) == (5, 16)
    assert row["cost_usd"] == pytest.approx(_api_cost(5, 16))


# ------------------------------------------------------------------ learned from the upstream's 404


@pytest.mark.parametrize("name", LEARNERS)
def test_the_first_404_is_retried_as_chat_and_learned(gateway, chat, name) -> None:
    endpoint, stream = name.split("-")[1], name.endswith("stream")
    client = _client(gateway)
    counter = "completion_requests" if endpoint == "completions" else "responses_requests"
    for i in range(2):
        text, usage = (_completion if endpoint == "completions" else _response)(client, name, stream)
        assert text == (TEXT4 if endpoint == "completions" else TEXT16)
        stats = standin_stats(chat)
        # the first request met the 404 and was retried as chat; the second went to chat at once
        assert (stats[counter], stats["not_found"], stats["chat_requests"]) == (1, 1, i + 1)
    rows = _rows(gateway, name)
    assert [r["endpoint"] for r in rows] == [f"{endpoint} via chat"] * 2
    assert all(r["status"] == "ok" and r["cost_usd"] == pytest.approx(_api_cost(*usage)) for r in rows)
    assert [r["attempts"] for r in rows] == [1, 1]


@pytest.mark.parametrize("route", ["eng-learns", "eng-declared"])
def test_engine_backends_translate_completions_too(gateway, chat, route) -> None:
    client = _client(gateway)
    for stream in (False, True, False):
        text, usage = _completion(client, route, stream)
        assert text == TEXT4 and usage == (3, 4)
    stats = standin_stats(chat)
    assert stats["completion_requests"] == (1 if route == "eng-learns" else 0) and stats["chat_requests"] == 3
    rows = _rows(gateway, route)
    assert [r["endpoint"] for r in rows] == ["completions via chat"] * 3
    for r in rows:  # the engine's device time (7 tokens × 1 ms) at $3.6/h, whatever the translation
        assert r["gpu_seconds"] == pytest.approx(0.007) and r["cost_usd"] > 0


def test_a_404_from_chat_too_is_not_learned(gateway, full) -> None:
    """A wrong model name answers 404 everywhere: the backend is misconfigured, not chat-only."""
    client = _client(gateway)
    standin_control(full, fail_next=2, fail_status=404)
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model="full", prompt="one two three", max_tokens=4)
    assert err.value.status_code == 502 and err.value.body["code"] == "backend_misconfigured"
    stats = standin_stats(full)
    assert (stats["completion_requests"], stats["chat_requests"]) == (1, 1)  # tried natively, then once as chat
    reply = client.completions.create(model="full", prompt="one two three", max_tokens=4)
    assert reply.choices[0].text == TEXT4
    assert standin_stats(full)["completion_requests"] == 2  # still sent natively
    assert _rows(gateway, "full")[-1]["endpoint"] == "completions"


# ------------------------------------------------------------------ what a chat completion cannot carry


@pytest.mark.parametrize(("param", "extra"), [("echo", {"echo": True}), ("logprobs", {"logprobs": 2}),
                                              ("suffix", {"suffix": "end"}), ("best_of", {"best_of": 2}),
                                              ("prompt", {"prompt": [1, 2, 3]})])
def test_untranslatable_parameters_are_a_400_naming_them(gateway, chat, param, extra) -> None:
    kwargs = {"model": "declared", "prompt": "one two three", "max_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as err:
        _client(gateway).completions.create(**kwargs)
    assert err.value.body["param"] == param and err.value.body["code"] == "unsupported_parameter"
    assert f"'{param}' cannot be served by a chat-only backend" in err.value.body["message"]
    assert standin_stats(chat)["requests"] == 0


def test_untranslatable_parameters_go_to_a_fallback_that_serves_completions(gateway, chat, full) -> None:
    raw = _client(gateway).completions.with_raw_response.create(model="chat-then-full", prompt="one two three",
                                                                 max_tokens=4, echo=True)
    assert raw.headers["x-switchyard-backend"] == "full"
    assert standin_stats(chat)["requests"] == 0 and standin_stats(full)["completion_requests"] == 1
    assert standin_stats(full)["last_payload"]["echo"] is True
    [row] = _rows(gateway, "chat-then-full")
    assert (row["backend"], row["route_reason"], row["endpoint"]) == ("full", "capability", "completions")


def test_untranslatable_parameters_after_a_404_are_a_400_and_teach_nothing(gateway, chat) -> None:
    client = _client(gateway)
    for _ in range(2):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="learn-echo", prompt="one two three", max_tokens=4, echo=True)
        assert err.value.body["param"] == "echo"
    stats = standin_stats(chat)
    assert (stats["completion_requests"], stats["chat_requests"]) == (2, 0)  # each tried natively, none as chat
    assert _client(gateway).completions.create(model="learn-echo", prompt="x", max_tokens=4).choices[0].text == TEXT4


# ------------------------------------------------------------------ issue 31 #11: fixed routes and capabilities


def test_a_fixed_route_skips_to_the_fallback_that_has_the_capability(gateway, full) -> None:
    image = [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                          {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]
    raw = _client(gateway).chat.completions.with_raw_response.create(model="pictures", messages=image, max_tokens=4)
    assert raw.headers["x-switchyard-backend"] == "vision"  # eng-full (an engine) has no images
    assert raw.parse().choices[0].message.content == TEXT4
    [row] = _rows(gateway, "pictures")
    assert (row["backend"], row["route_reason"], row["status"]) == ("vision", "capability", "ok")


# ------------------------------------------------------------------ the policy field


def test_endpoints_must_name_chat() -> None:
    base = "backends:\n  b: {kind: litellm, model: openai/gpt-4o-mini, endpoints: %s}\nroutes:\n  r: {backend: b}\n"
    assert parse_policy(base % "[chat, completions]", "p.yaml").backends["b"].endpoints == ["chat", "completions"]
    with pytest.raises(PolicyError, match=r"p\.yaml:2:.*'endpoints' must include chat"):
        parse_policy(base % "[completions]", "p.yaml")
    with pytest.raises(PolicyError, match="embeddings"):
        parse_policy(base % "[chat, embeddings]", "p.yaml")


def test_a_llama_named_model_streams_without_fetching_a_tokenizer(gateway, chat, monkeypatch) -> None:
    """litellm counted a stream's tokens with a tokenizer fetched from the Hugging Face Hub for "llama…" names:
    offline, the first such stream stalled ~27 s on the fetch's retries. Nothing downloads at run time."""
    import litellm.utils

    fetched: list[str] = []

    def fetch(model: str, *args, **kwargs):
        fetched.append(model)
        raise OSError("no network in this test")

    monkeypatch.setattr(litellm.utils, "_return_huggingface_tokenizer", fetch)
    text, _ = _completion(_client(gateway), "declared", stream=True)
    assert text == TEXT4 and fetched == []


def test_several_choices_translate_with_their_indices(gateway, chat) -> None:
    client = _client(gateway)
    reply = client.completions.create(model="declared", prompt="one two three", max_tokens=4, n=2)
    assert [(c.index, c.text) for c in reply.choices] == [(0, TEXT4), (1, TEXT4)]
    assert reply.usage.completion_tokens == 8
    chunks = list(client.completions.create(model="declared", prompt="one two three", max_tokens=4, n=2, stream=True))
    for index in (0, 1):
        assert "".join(c.text for chunk in chunks for c in chunk.choices if c.index == index) == TEXT4
    assert standin_stats(chat)["last_payload"]["n"] == 2


def test_a_client_leaving_a_translated_stream_closes_the_upstream(gateway, chat) -> None:
    standin_control(chat, token_delay_ms=100)
    with httpx.stream("POST", f"{gateway.base_url}/completions", timeout=10,
                      headers={"authorization": f"Bearer {MASTER_KEY}"},
                      json={"model": "declared", "prompt": "one two three", "max_tokens": 50, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:")).startswith('data: {"id":"cmpl-')
    deadline = time.monotonic() + 10  # the gateway notices the disconnect, closes the upstream, queues the row
    while not (rows := [r for r in _rows(gateway, "declared") if r["status"] == "client_closed"]) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert standin_stats(chat)["disconnects"] == 1 and standin_stats(chat)["completed"] == 0
    assert [(r["endpoint"], r["backend"]) for r in rows] == [("completions via chat", "declared")]
    assert rows[0]["completion_tokens"] < 50
