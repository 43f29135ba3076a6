"""One request's state inside the engine: its tokens, how many have KV in the cache, and its blocks."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from hosted.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """A request being served.

    `token_ids` is the prompt followed by every generated token. `num_computed_tokens` counts the
    leading tokens whose K/V are in the cache; a step feeds tokens [num_computed_tokens, len) (or a
    chunk of them) and samples a new token once the whole sequence has been computed. So a decode is
    just a sequence with exactly one uncomputed token, and a preempted sequence recomputes from zero.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    arrival: int  # monotonically increasing admission order; lower = higher priority
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Chained prefix-cache hash of each *full* block in block_table that has been hashed so far.
    block_hashes: list[int] = field(default_factory=list)
    # Their 128-bit chain digests (hosted/kv_tiers.chain_key): a block's identity in the host and disk tiers.
    block_keys: list[bytes] = field(default_factory=list)
    # Prompt tokens served from the prefix cache at first admission, restored ones (from host memory, from
    # disk: hosted/kv_tiers.py) included.
    num_cached_tokens: int = 0
    num_restored_host_tokens: int = 0
    num_restored_disk_tokens: int = 0
    admitted_once: bool = False
    device_seconds: float = 0.0
    generator: torch.Generator | None = None
    finish_reason: str | None = None
    # Counts of generated tokens, only kept for requests with presence/frequency penalties.
    output_counts: dict[int, int] | None = None
    # Speculative decoding (hosted/spec/): draft tokens verified this step after the last token (a decode
    # then feeds 1 + len(spec_token_ids) tokens), their draft distributions ([k, V], None = point masses),
    # the request's totals, and the proposer's per-sequence state.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_draft_probs: torch.Tensor | None = None
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_state: Any = None
    # Constrained decoding: this sequence's xgrammar GrammarMatcher (params.grammar), fed every generated token.
    matcher: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]
