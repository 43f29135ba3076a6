"""Per-key requests-per-minute and tokens-per-minute limits over a sliding 60-second window.

This process's own windows; replicas share theirs through Redis (gateway/shared_state.py, the same interface,
whose admit() may return an awaitable the proxy awaits)."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from gateway import errors
from gateway.keys import KeyInfo

WINDOW_S = 60.0


@dataclass(slots=True)
class _Window:
    requests: deque = field(default_factory=deque)  # admission times
    tokens: deque = field(default_factory=deque)  # (time, tokens)
    token_sum: int = 0

    def trim(self, now: float) -> None:
        horizon = now - WINDOW_S
        while self.requests and self.requests[0] <= horizon:
            self.requests.popleft()
        while self.tokens and self.tokens[0][0] <= horizon:
            self.token_sum -= self.tokens.popleft()[1]


class RateLimiter:
    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._windows: dict[str, _Window] = {}

    def admit(self, key: KeyInfo, estimated_prompt_tokens: int) -> None:
        """Count this request or raise 429 with Retry-After. Returns None: nothing left to await."""
        if key.rpm is None and key.tpm is None:
            return
        now = self._clock()
        window = self._windows.setdefault(key.id, _Window())
        window.trim(now)
        if key.rpm is not None and len(window.requests) >= key.rpm:
            retry = window.requests[0] + WINDOW_S - now
            raise errors.rate_limited(f"Rate limit reached for key {key.id}: {key.rpm} requests per minute.", retry)
        if key.tpm is not None and window.token_sum + estimated_prompt_tokens > key.tpm:
            retry = (window.tokens[0][0] + WINDOW_S - now) if window.tokens else WINDOW_S
            raise errors.rate_limited(
                f"Rate limit reached for key {key.id}: {key.tpm} tokens per minute "
                f"({window.token_sum} used in the last minute).", retry)
        window.requests.append(now)

    def record_tokens(self, key: KeyInfo, tokens: int) -> None:
        if key.tpm is None or tokens <= 0:
            return
        window = self._windows.setdefault(key.id, _Window())
        window.tokens.append((self._clock(), tokens))
        window.token_sum += tokens
