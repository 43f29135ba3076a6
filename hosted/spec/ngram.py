"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the sequence's last n tokens
(longest n first), from its own prompt and output. No model: an index of where each n-gram last ended."""
from __future__ import annotations


class NgramIndex:
    """For one sequence: n-gram (as a tuple, n_min <= n <= n_max) -> position just after its latest occurrence.

    Updated incrementally: each call indexes the n-grams ending at the tokens added since the last call, except
    those ending at the last token (that is the pattern being looked up). Committed tokens never change, so the
    index stays valid across preemption and rejected drafts (which never enter `tokens`).
    """

    __slots__ = ("_after", "_indexed", "matched", "n_max", "n_min")

    def __init__(self, n_min: int, n_max: int) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got {n_min}..{n_max}")
        self.n_min = n_min
        self.n_max = n_max
        self._after: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are indexed
        self.matched = 0  # n of the last proposal's match (0: none); longer matches are accepted more often

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens continuing `tokens`, or [] when its last n_min tokens never occurred before."""
        last = len(tokens) - 1
        after = self._after
        for n in range(self.n_min, self.n_max + 1):  # in C: the n-grams ending at first..last-1, in order
            first = max(self._indexed, n - 1)
            if first < last:
                grams = zip(*(tokens[first - n + 1 + i:last - n + 1 + i] for i in range(n)))
                after.update(zip(grams, range(first + 1, last + 1)))
        self._indexed = max(self._indexed, last)
        self.matched = 0
        if k <= 0:
            return []
        for n in range(min(self.n_max, len(tokens)), self.n_min - 1, -1):
            pos = after.get(tuple(tokens[len(tokens) - n:]))
            if pos is not None:
                self.matched = n
                return tokens[pos:pos + k]
        return []
