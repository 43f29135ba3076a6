"""Per-request sampling parameters (the engine-level view; the server maps OpenAI fields onto these)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_TOP_LOGPROBS = 20


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None  # per-request generator -> reproducible whatever else is in the batch
    presence_penalty: float = 0.0  # OpenAI semantics, over generated tokens only
    frequency_penalty: float = 0.0
    stop_token_ids: list[int] = field(default_factory=list)  # in addition to the model's EOS ids
    ignore_eos: bool = False
    logprobs: bool = False  # logprobs of the raw model distribution (before penalties/temperature)
    top_logprobs: int = 0  # 0..20
    # A compiled xgrammar grammar (hosted/structured.py) every generated token must follow; None = free text.
    # Shared by the request's sequences; each gets its own matcher.
    grammar: Any = None

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first bad field."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (0.0 <= float(self.temperature) <= 100.0):
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not (0.0 < float(self.top_p) <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = float(getattr(self, name))
            if not (-2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not isinstance(self.top_logprobs, int) or not (0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        for tok in self.stop_token_ids:
            if not isinstance(tok, int) or tok < 0 or (vocab_size is not None and tok >= vocab_size):
                raise ValueError(f"stop_token_ids holds {tok!r}, not a token id of this model")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
