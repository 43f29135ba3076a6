"""Issue 33 #3: one OpenAI request schema, so the gateway and the engine refuse the same bodies alike.

The same bodies go to a real engine server (hosted/server.py over a tiny random-weight Llama, uvicorn on
127.0.0.1) and to a real gateway whose route is that engine. For each invalid body both answer the same status,
error type and `param`, and the gateway answers it itself: the engine never sees it (its count of refused
requests does not move). The bodies where the two schemas once disagreed (top_p 0, n 100, an empty stop
string, a 63-bit seed, tool_choice "auto" without tools) are OpenAI's to accept: both serve them.
"""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import uvicorn

from hosted.async_llm_engine import AsyncLLMEngine
from hosted.engine import EngineConfig, LLMEngine
from hosted.server import ServerState, build_app
from hosted.tokenizer import Tokenizer
from tests.e2e.conftest import MASTER_KEY, free_port, run_gateway
from tests.e2e.policy_builder import engine as engine_backend
from tests.e2e.policy_builder import fixed, policy
from tests.hosted.serving_helpers import build_tiny_chat_model, parse_metrics

ENGINE_MODEL = "tiny"
MSG = [{"role": "user", "content": "hello"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CHAT, COMPLETIONS = "/chat/completions", "/completions"


def policy_text(engine_url: str) -> str:
    eng = engine_backend(f"{engine_url}/v1", model="tiny", gpu_hour_usd=2.0, max_retries=0)
    return policy(backends={"eng": eng}, routes={"local": fixed("eng")})


def chat(**fields) -> tuple[str, dict]:
    return CHAT, {"messages": MSG, "max_tokens": 2, **fields}


def completion(**fields) -> tuple[str, dict]:
    return COMPLETIONS, {"prompt": "hello", "max_tokens": 2, **fields}


# (endpoint, body without `model`, the param both must name)
INVALID = [
    (*chat(top_p=1.5), "top_p"),
    (*chat(top_p=-0.1), "top_p"),
    (*chat(n=129), "n"),
    (*chat(n=0), "n"),
    (*chat(temperature="0.5"), "temperature"),
    (*chat(temperature=True), "temperature"),
    (*chat(max_tokens=-1), "max_tokens"),
    (*chat(max_tokens=1.5), "max_tokens"),
    (*chat(max_completion_tokens=0), "max_completion_tokens"),
    (*chat(presence_penalty=3), "presence_penalty"),
    (*chat(seed=2**64), "seed"),
    (*chat(messages=[{"role": "robot", "content": "x"}]), "messages[0]"),
    (*chat(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    (*chat(messages=[{"role": "user"}]), "messages[0].content"),
    (*chat(messages=[{"role": "assistant"}]), "messages[0].content"),
    (*chat(messages=[]), "messages"),
    (*chat(messages="hello"), "messages"),
    (*chat(tools=[{"type": "retrieval"}]), "tools[0].type"),
    (*chat(tools=[{"type": "function", "function": {"name": "has space"}}]), "tools[0].function.name"),
    (*chat(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools[0].function.name"),
    (*chat(tools=[TOOL], tool_choice="sometimes"), "tool_choice"),
    (*chat(tool_choice="required"), "tool_choice"),
    (*chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice.function.name"),
    (*chat(response_format={"type": "yaml"}), "response_format"),
    (*chat(response_format={"type": "json_schema"}), "response_format.json_schema"),
    (*chat(response_format={"type": "json_schema", "json_schema": {"name": "out", "schema": True}}),
     "response_format.json_schema.schema"),
    (*chat(logprobs=1), "logprobs"),
    (*chat(top_logprobs=2), "top_logprobs"),
    (*chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (*chat(stop=["a", "b", "c", "d", "e"]), "stop"),
    (*chat(stop=5), "stop"),
    (*chat(stream="yes"), "stream"),
    (*chat(stream_options=True), "stream_options"),
    (*chat(top_k="5"), "top_k"),
    (*chat(ignore_eos="yes"), "ignore_eos"),
    (*chat(stop_token_ids=[-1]), "stop_token_ids[0]"),
    (*completion(prompt=[-1]), "prompt"),
    (*completion(prompt=""), "prompt"),
    (*completion(logprobs=6), "logprobs"),
    (*completion(echo="y"), "echo"),
]

# Where the two schemas disagreed: OpenAI's reference accepts each, and so do both servers now.
ONCE_DISAGREED = [
    chat(top_p=0),
    chat(n=100, max_tokens=1),
    chat(stop=["", "\n"]),
    chat(seed=2**63 - 1),
    chat(tool_choice="auto"),
    completion(top_p=0, n=65, max_tokens=1),
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model_dir = build_tiny_chat_model(tmp_path_factory.mktemp("parity") / ENGINE_MODEL)
    llm = AsyncLLMEngine(LLMEngine(EngineConfig(model_dir=str(model_dir), num_kv_blocks=256, max_model_len=128,
                                                max_num_seqs=16)))
    state = ServerState(model_name=ENGINE_MODEL, engine=llm, tokenizer=Tokenizer.from_dir(model_dir))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1", port=port, log_level="warning",
                                           access_log=False))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "engine server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def gateway(engine, tmp_path_factory):
    with run_gateway(policy_text(engine), tmp_path_factory.mktemp("parity-gateway")) as running:
        yield running.base_url


def _post(base: str, endpoint: str, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(base + endpoint, json=body, headers=headers, timeout=120)


def _refused_by_engine(engine: str) -> float:
    metrics = parse_metrics(httpx.get(engine + "/metrics", timeout=10).text)
    return metrics.get('switchyard_engine_requests_total{status="invalid"}', 0.0)


def _error(reply: httpx.Response) -> tuple[int, str | None, str | None]:
    error = reply.json().get("error") or {}
    return reply.status_code, error.get("type"), error.get("param")


@pytest.mark.parametrize("endpoint, body, param", INVALID, ids=[f"{p}:{i}" for i, (_, _, p) in enumerate(INVALID)])
def test_both_servers_refuse_alike_and_the_engine_never_sees_what_the_gateway_refused(engine, gateway, endpoint,
                                                                                      body, param):
    direct = _error(_post(engine + "/v1", endpoint, {"model": ENGINE_MODEL, **body}))
    before = _refused_by_engine(engine)
    routed = _error(_post(gateway, endpoint, {"model": "local", **body}, authorization=f"Bearer {MASTER_KEY}"))
    assert direct == routed == (400, "invalid_request_error", param)
    assert _refused_by_engine(engine) == before  # the gateway answered it without routing it


@pytest.mark.parametrize("endpoint, body", ONCE_DISAGREED, ids=[str(b) for _, b in ONCE_DISAGREED])
def test_what_either_once_refused_alone_both_serve(engine, gateway, endpoint, body):
    direct = _post(engine + "/v1", endpoint, {"model": ENGINE_MODEL, **body})
    routed = _post(gateway, endpoint, {"model": "local", **body}, authorization=f"Bearer {MASTER_KEY}")
    assert (direct.status_code, routed.status_code) == (200, 200), (direct.text, routed.text)
    n = body.get("n", 1)
    assert len(direct.json()["choices"]) == len(routed.json()["choices"]) == n
