"""Draft-model proposals: a small model with the target's vocabulary, on a model runner and KV pool of its own,
proposes k tokens per sequence autoregressively, batched across sequences (k forwards per step).

Each target sequence has a shadow sequence in the draft's pool. Before proposing, the shadow is synced to the
committed tokens: its tokens after the first disagreement (drafts the target rejected) are replaced, its
computed count is cut back to the agreeing prefix and its surplus blocks are freed; the first draft forward
then feeds what the draft has not seen (usually the target's last one or two tokens, a whole prompt the
first time) as a prefill chunk.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from hosted.block_manager import BlockManager
from hosted.model_runner import ModelRunner
from hosted.sampler import greedy_tokens
from hosted.scheduler import ScheduledBatch
from hosted.sequence import Sequence
from hosted.spec.planner import StepCost
from hosted.spec.rejection import target_probs


@dataclass(slots=True)
class _Shadow:
    seq: Sequence  # the draft's copy: committed tokens, then this step's drafts
    synced: int  # leading tokens known to equal the target sequence's (committed tokens never change)


class DraftProposer:
    def __init__(self, runner: ModelRunner, block_size: int) -> None:
        self.runner = runner
        self.block_manager = BlockManager(runner.num_blocks, block_size, enable_prefix_caching=False)
        self.cost = StepCost()  # seconds per draft forward by tokens fed
        self._shadows: dict[str, _Shadow] = {}

    def propose(self, seqs: list[Sequence], ks: list[int]) -> None:
        """Set seq.spec_token_ids (ks[i] tokens, fewer only when the draft's pool is full) and, for sampled
        requests without a seed, seq.spec_draft_probs (the distributions the drafts were drawn from)."""
        live: list[tuple[Sequence, Sequence, int]] = []
        for seq, k in zip(seqs, ks):
            shadow = self._reserve(seq, k) if k > 0 else None
            if shadow is not None:
                live.append((seq, shadow, k))
        if not live:
            return
        starts = {id(seq): seq.num_tokens for seq, _, _ in live}
        probs: dict[int, list[torch.Tensor]] = {id(seq): [] for seq, _, _ in live}
        for j in range(max(k for _, _, k in live)):
            step = [(seq, shadow) for seq, shadow, k in live if k > j]
            self._forward(step, probs)
        for seq, shadow, k in live:
            start = starts[id(seq)]
            seq.spec_token_ids = shadow.token_ids[start:start + k]
            rows = probs[id(seq)]
            seq.spec_draft_probs = torch.stack(rows) if rows else None

    def lag(self, seq: Sequence) -> int:
        """Tokens the draft would feed to catch up with seq before proposing (at least its last one)."""
        entry = self._shadows.get(seq.request_id)
        return seq.num_tokens - (min(entry.seq.num_computed_tokens, entry.synced) if entry is not None else 0)

    def release(self, seq: Sequence) -> None:
        """Forget seq's shadow and free its draft KV (finished, aborted or preempted)."""
        shadow = self._shadows.pop(seq.request_id, None)
        if shadow is not None:
            self.block_manager.free(shadow.seq)

    # ---- shadows ----------------------------------------------------------------------------------
    def _reserve(self, seq: Sequence, k: int) -> Sequence | None:
        """The synced shadow with blocks for k proposals, or None when the draft pool cannot hold them."""
        shadow = self._sync(seq)
        need = shadow.num_tokens + k - 1  # the last draft token is never fed to the draft
        if not self.block_manager.can_allocate(shadow, need):
            self.release(seq)  # start over from nothing only if that fits
            shadow = self._sync(seq)
            if not self.block_manager.can_allocate(shadow, need):
                self.release(seq)
                return None
        self.block_manager.allocate(shadow, need)
        return shadow

    def _sync(self, seq: Sequence) -> Sequence:
        entry = self._shadows.get(seq.request_id)
        if entry is None:
            shadow = Sequence(request_id=seq.request_id, token_ids=list(seq.token_ids),
                              num_prompt_tokens=seq.num_prompt_tokens, params=seq.params, arrival=seq.arrival)
            self._shadows[seq.request_id] = _Shadow(shadow, seq.num_tokens)
            return shadow
        shadow, mine, theirs = entry.seq, entry.seq.token_ids, seq.token_ids
        keep, limit = entry.synced, min(len(mine), len(theirs))
        while keep < limit and mine[keep] == theirs[keep]:
            keep += 1
        del mine[keep:]
        mine.extend(theirs[keep:])
        entry.synced = len(theirs)
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, keep, len(theirs) - 1)
        self.block_manager.truncate(shadow, shadow.num_computed_tokens)
        return shadow

    # ---- one draft forward ------------------------------------------------------------------------
    def _forward(self, step: list[tuple[Sequence, Sequence]], probs: dict[int, list[torch.Tensor]]) -> None:
        """Feed every shadow's uncomputed tokens (decodes first) and append one draft token to each."""
        t0 = time.perf_counter()
        step.sort(key=lambda pair: pair[1].num_uncomputed != 1)
        batch = ScheduledBatch(items=[(shadow, shadow.num_uncomputed) for _, shadow in step])
        batch.num_decodes = sum(1 for _, n in batch.items if n == 1)
        batch.num_tokens = sum(n for _, n in batch.items)
        logits, _ = self.runner.execute(batch)
        assert logits is not None
        tokens = greedy_tokens(logits).tolist()
        sampled = [i for i, (seq, _) in enumerate(step) if not seq.params.greedy and seq.generator is None]
        if sampled:
            # Sampled requests draw from the draft's own (temperature / top-k / top-p) distribution, which the
            # rejection sampler needs; greedy and seeded ones propose the draft's argmax (a point mass).
            q = target_probs(logits[sampled], [step[i][0].params for i in sampled])
            noise = torch.empty_like(q).exponential_()
            drawn = (q / noise.clamp_(min=1e-30)).argmax(dim=-1).tolist()
            for row, i in enumerate(sampled):
                tokens[i] = drawn[row]
                probs[id(step[i][0])].append(q[row])
        for (_, shadow), n, token in zip(step, (n for _, n in batch.items), tokens):
            shadow.num_computed_tokens += n
            shadow.token_ids.append(token)
        self.cost.observe(batch.num_tokens, time.perf_counter() - t0)
