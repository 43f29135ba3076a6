"""Issue 30 item 7 (engine side): the engine server publishes its OpenAPI document, built from the pydantic models
it parses requests with; schemathesis finds no 5xx, no dropped connection, no response outside the document and
none without an `x-request-id`.

The real server app (hosted/server.py) on 127.0.0.1 under uvicorn in a thread, over a tiny random-weight Llama
with a 64-token context: whatever max_tokens schemathesis sends, no answer runs longer than that.
"""
from __future__ import annotations

import asyncio
import collections
import os
import threading
import time

import httpx
import pytest
import schemathesis
import uvicorn
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from hosted import openapi
from hosted.async_llm_engine import AsyncLLMEngine
from hosted.engine import EngineConfig, LLMEngine
from hosted.server import ServerState, build_app
from hosted.tokenizer import Tokenizer
from openai_wire.engine_requests import EngineChatRequest, EngineCompletionRequest
from openai_wire.request_json_schema import RequestSchemas
from tests.hosted.serving_helpers import build_tiny_chat_model, free_port

MODEL = "tiny"
EXAMPLES = 30 * int(os.environ.get("SWITCHYARD_FUZZ_SCALE", "1"))
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection]
SETTINGS = settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                    suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate, Phase.shrink],
                    print_blob=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_tiny_chat_model(tmp_path_factory.mktemp("openapi") / MODEL)
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model_dir=str(model_dir), num_kv_blocks=64, max_model_len=64,
                                                   max_num_seqs=16)))
    state = ServerState(model_name=MODEL, engine=engine, tokenizer=Tokenizer.from_dir(model_dir))
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1", port=port, log_level="warning",
                                       access_log=False))
    thread = threading.Thread(target=lambda: asyncio.run(uv.serve()), daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not uv.started:
        assert thread.is_alive() and time.time() < deadline, "engine server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(timeout=30)


def test_the_document_is_openapi_3_1_built_from_the_parsers_models(server):
    reply = httpx.get(server + "/openapi.json")
    assert reply.status_code == 200 and reply.headers["x-request-id"].startswith("req_")
    document = reply.json()
    assert document["openapi"] == "3.1.0" and document == openapi.build()
    assert set(document["paths"]) == {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"}
    schemas = document["components"]["schemas"]
    for path, model in (("/v1/chat/completions", EngineChatRequest), ("/v1/completions", EngineCompletionRequest)):
        post = document["paths"][path]["post"]
        ref = post["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model.__name__}"
        own = model.model_json_schema(ref_template="#/components/schemas/{model}", schema_generator=RequestSchemas)
        documented = schemas[model.__name__]
        assert {k: documented["properties"][k] for k in own["properties"]} == own["properties"]
        # unknown fields are refused by name (request_plan.reject_unsupported), so the document closes the object
        assert documented["additionalProperties"] is False and "user" in documented["properties"]
        assert post["responses"]["4XX"] == post["responses"]["5XX"] == {"$ref": "#/components/responses/Error"}
    assert "security" not in document  # the engine has no keys (it sits behind the gateway)


def test_a_request_id_is_kept_when_plain_and_replaced_when_not(server):
    """The gateway's id follows a request into the engine's answers (and log); anything else gets a fresh id."""
    assert httpx.get(server + "/health", headers={"x-request-id": "req_abc123"}).headers["x-request-id"] == \
        "req_abc123"
    fresh = httpx.get(server + "/health", headers={"x-request-id": "bad id\t<script>"}).headers["x-request-id"]
    assert fresh.startswith("req_") and len(fresh) == 36


def _operations() -> list[tuple[str, str, GenerationMode]]:
    return [(path, method, mode) for path, methods in openapi.build()["paths"].items()
            for method, spec in methods.items() for mode in GenerationMode
            if mode is GenerationMode.POSITIVE or "requestBody" in spec]


@pytest.mark.parametrize("path, method, mode", _operations())
def test_schemathesis(server, path, method, mode):
    operation = schemathesis.openapi.from_url(server + "/openapi.json")[path][method.upper()]
    statuses: collections.Counter = collections.Counter()

    @SETTINGS
    @given(case=operation.as_strategy(generation_mode=mode), ours=st.integers(0, 3))
    def run(case, ours):
        # Random model names end at a 404; most valid bodies name the served model instead.
        if mode is GenerationMode.POSITIVE and ours < 3 and isinstance(case.body, dict):
            case.body["model"] = MODEL
        response = case.call_and_validate(base_url=server, checks=CHECKS, timeout=60)
        assert response.headers.get("x-request-id", [""])[0].startswith("req_")
        statuses[response.status_code] += 1

    run()
    if mode is GenerationMode.POSITIVE:  # valid bodies were generated from, not only refused
        assert statuses[200], statuses


def test_an_escaped_exception_is_an_openai_500_with_the_request_id():
    """Before, an exception escaping a route of the engine server was Starlette's plain-text 500 with no id."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.routing import Route

    from openai_wire.request_ids import RequestIdMiddleware

    async def broken(request):
        raise RuntimeError("boom")

    app = Starlette(routes=[Route("/x", broken)], middleware=[Middleware(RequestIdMiddleware)])

    async def call() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                                     base_url="http://engine") as client:
            return await client.get("/x")

    reply = asyncio.run(call())
    rid = reply.headers["x-request-id"]
    assert reply.status_code == 500 and rid.startswith("req_")
    assert reply.json()["error"]["code"] == "internal_error" and rid in reply.json()["error"]["message"]
