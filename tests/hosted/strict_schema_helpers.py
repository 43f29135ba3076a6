"""The engine's own OpenAI server on a real 127.0.0.1 socket (uvicorn in a thread) over a tiny random-weight
Llama with a byte-level BPE tokenizer: at temperature 1 its near-uniform logits sample widely among whatever
the grammar allows, which makes it a good fuzzer of constrained decoding. Shared by the strict-schema tests."""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from hosted.async_llm_engine import AsyncLLMEngine
from hosted.engine import EngineConfig, LLMEngine
from hosted.server import ServerState, build_app
from hosted.tokenizer import Tokenizer
from tests.hosted.serving_helpers import build_tiny_chat_model, free_port

MODEL = "tiny-strict"
SCHEMA_PARAM = "response_format.json_schema.schema"


@dataclass
class TinyEngineServer:
    base_url: str  # http://127.0.0.1:PORT
    engine: AsyncLLMEngine
    tokenizer: Tokenizer


@contextmanager
def tiny_engine_server(directory: Path, max_num_seqs: int = 16) -> Iterator[TinyEngineServer]:
    model_dir = build_tiny_chat_model(directory, seed=31, max_position_embeddings=2048)
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model_dir=str(model_dir), num_kv_blocks=512,
                                                   max_num_seqs=max_num_seqs)))
    tokenizer = Tokenizer.from_dir(model_dir)
    app = build_app(ServerState(model_name=MODEL, engine=engine, tokenizer=tokenizer))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           access_log=False))

    def target() -> None:
        asyncio.run(server.serve())

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("engine server did not start")
        time.sleep(0.02)
    try:
        yield TinyEngineServer(f"http://127.0.0.1:{port}", engine, tokenizer)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def schema_body(schema: object, *, strict: bool | None = True, **extra: object) -> dict:
    spec: dict = {"name": "out", "schema": schema}
    if strict is not None:
        spec["strict"] = strict
    return {"model": MODEL, "messages": [{"role": "user", "content": "Answer in JSON."}],
            "response_format": {"type": "json_schema", "json_schema": spec}, **extra}
