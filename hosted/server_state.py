"""What the engine server knows between requests: the loaded engine and tokenizer (or why not), metrics,
and a cache of each token's text and bytes for logprobs."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from hosted.async_llm_engine import AsyncLLMEngine
from hosted.metrics import EngineMetrics
from hosted.precision import Precision
from hosted.tokenizer import Tokenizer
from openai_wire import APIError

_TOKEN_TEXT_CACHE_MAX = 1_000_000


@dataclass
class ServerState:
    model_name: str
    engine: AsyncLLMEngine | None = None
    tokenizer: Tokenizer | None = None
    metrics: EngineMetrics = field(default_factory=EngineMetrics)
    load_error: str | None = None
    precision: Precision | None = None  # what the model loads as, and why (hosted/precision.py): /health says it
    created: int = field(default_factory=lambda: int(time.time()))
    _token_text: dict[int, tuple[str, list[int]]] = field(default_factory=dict)

    def ready(self) -> tuple[AsyncLLMEngine, Tokenizer]:
        """The engine and tokenizer, or a 503 saying why requests cannot be served yet (or any more)."""
        if self.engine is None or self.tokenizer is None:
            msg = f"the model failed to load: {self.load_error}" if self.load_error else "the model is still loading"
            raise APIError(503, msg, type="service_unavailable", code="model_not_ready",
                           headers={"Retry-After": "5"})
        if not self.engine.alive:
            raise APIError(503, f"the engine is not running: {self.engine.dead or 'shutting down'}",
                           type="service_unavailable", code="engine_down")
        return self.engine, self.tokenizer

    def token_text(self, token_id: int) -> tuple[str, list[int]]:
        """(text, bytes) of one token, as logprobs report it."""
        cached = self._token_text.get(token_id)
        if cached is None:
            assert self.tokenizer is not None
            raw = self.tokenizer.token_bytes(token_id)
            cached = (raw.decode("utf-8", errors="replace"), list(raw))
            if len(self._token_text) < _TOKEN_TEXT_CACHE_MAX:
                self._token_text[token_id] = cached
        return cached
