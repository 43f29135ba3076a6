"""EAGLE proposals: a feature-level draft (eagle_model.EagleDraft) drafts k tokens per sequence from the target's
own hidden states, which the target's forward captures (LlamaForCausalLM.capture_layers) for every row it feeds.

Per sequence: `feats` holds the fused features of positions the target has fed (row p: position p), `cache` the
draft's KV of the pairs (feature p, token p + 1) fed so far. Before proposing, `ingest` files the last forward's
captured rows; positions past the sequence's computed count (rejected drafts) are never used, and rows of a
position written again replace the old ones. A proposal first feeds the pairs that arrived since (the catch-up,
usually the accepted drafts + 1), which yields the first draft, then k - 1 steps on the draft's own outputs;
their KV is dropped afterwards (the cache length goes back), so only target-fed positions stay.

Partial: the draft's KV is a per-sequence contiguous tensor, not blocks of the paged pool, and sequences draft
one after another (no batching across sequences).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from hosted.model_runner import ModelRunner
from hosted.sequence import Sequence
from hosted.spec.eagle_checkpoint import load_eagle
from hosted.spec.eagle_model import DraftCache, EagleDraft
from hosted.spec.planner import StepCost
from hosted.spec.rejection import target_probs


@dataclass(slots=True)
class _State:
    cache: DraftCache
    feats: torch.Tensor  # [capacity, H] fused target features, row p - base for position p
    base: int = 0  # the first position with features (> 0 after a prefix-cache hit: the draft starts there)
    avail: int = 0  # positions [base, avail) have features
    broken: bool = False  # a gap in the features (never proposes again)


class EagleProposer:
    def __init__(self, draft_dir: str, runner: ModelRunner) -> None:
        model = runner.model
        self.draft: EagleDraft = load_eagle(draft_dir)
        s = self.draft.shape
        cfg = runner.model_config
        if (s.vocab_size, s.hidden_size) != (cfg.vocab_size, cfg.hidden_size) or \
                max(s.feature_layers) >= cfg.num_hidden_layers:
            raise ValueError(f"EAGLE draft {draft_dir!r} was made for another target (vocabulary {s.vocab_size}, "
                             f"hidden {s.hidden_size}, layers {s.feature_layers}); this one has {cfg.vocab_size}, "
                             f"{cfg.hidden_size}, {cfg.num_hidden_layers} layers")
        self.draft.attach_target(model.embed_tokens.weight, model.norm.weight, model.lm_head_weight,
                                 runner.cos_sin.cpu())
        self.runner = runner
        self.vocab_size = cfg.vocab_size
        self._layers = tuple(s.feature_layers)
        model.capture_layers = self._layers  # every forward now keeps these layers' streams (see arm)
        self.cost = StepCost()  # seconds per draft forward by pairs fed
        self._states: dict[str, _State] = {}

    # ---- features from the target's last forward ------------------------------------------------------
    def ingest(self) -> None:
        model, items = self.runner.model, self.runner.captured_items
        feats = model.captured
        if feats is None or not items:
            return
        with torch.inference_mode():
            fused = self.draft.fuse(feats.float())
        row = 0
        for seq, start, n in items:
            st = self._states.get(seq.request_id)
            if st is None:
                # A prompt prefix from the prefix cache is not fed: the draft's context starts after it.
                st = self._states[seq.request_id] = _State(DraftCache.empty(self.draft.shape),
                                                           fused.new_zeros(max(256, n), fused.shape[1]),
                                                           base=start, avail=start)
                st.cache.length = start
            if start > st.avail:
                # Positions went by without features (capture was off while the planner rested): the draft's
                # context starts again here, as after a prefix-cache hit.
                st = self._states[seq.request_id] = _State(DraftCache.empty(self.draft.shape),
                                                           st.feats, base=start, avail=start)
                st.cache.length = start
            if start < st.base:
                st.broken = True
            elif not st.broken:
                b = st.base
                if start + n - b > st.feats.shape[0]:
                    grown = st.feats.new_zeros(max(start + n - b, 2 * st.feats.shape[0]), st.feats.shape[1])
                    grown[:st.avail - b] = st.feats[:st.avail - b]
                    st.feats = grown
                st.feats[start - b:start + n - b] = fused[row:row + n]
                st.avail = start + n
                st.cache.length = min(st.cache.length, start)  # re-fed positions are fed to the draft again
            row += n
        model.captured, self.runner.captured_items = None, []

    def arm(self, on: bool) -> None:
        """Capture features in the target's forwards (on), or not: capture costs every forward and stops native
        greedy bursts, so it is off while the planner keeps speculation off (the draft restarts after the gap)."""
        self.runner.model.capture_layers = self._layers if on else None

    def lag(self, seq: Sequence) -> int:
        """Pairs the draft feeds for seq before its first draft (the catch-up)."""
        st = self._states.get(seq.request_id)
        if st is None:
            return seq.num_tokens
        return max(1, min(st.avail, seq.num_tokens - 1) - st.cache.length)  # positions, base cancels

    def release(self, seq: Sequence) -> None:
        self._states.pop(seq.request_id, None)

    # ---- drafting ---------------------------------------------------------------------------------
    def propose(self, seqs: list[Sequence], ks: list[int]) -> None:
        """Set seq.spec_token_ids (ks[i] tokens; none when its features have a gap) and, for sampled requests
        without a seed, seq.spec_draft_probs (the distributions the drafts were drawn from)."""
        for seq, k in zip(seqs, ks):
            if k > 0:
                self._propose_one(seq, k)

    def _propose_one(self, seq: Sequence, k: int) -> None:
        st = self._states.get(seq.request_id)
        last = seq.num_tokens - 1  # pairs up to position last - 1 (token `last` is the newest committed one)
        if st is None or st.broken or min(st.avail, seq.num_computed_tokens) < last:
            return
        t0 = time.perf_counter()
        draft, cache = self.draft, st.cache
        tokens = seq.token_ids
        rows = 1
        b = st.base  # cache.length, avail and last are positions; the cache's rows start at b
        if cache.length < last:
            start = cache.length
            ids = torch.tensor(tokens[start + 1:last + 1], dtype=torch.int64)
            out = draft.extend(cache, st.feats[start - b:last - b], ids, start - b, b)
            cache.length, cache.last = last, out[-1:]
            rows = last - start
        if cache.last is None:
            return
        sampled = not seq.params.greedy and seq.generator is None
        h = cache.last
        proposal: list[int] = []
        probs: list[torch.Tensor] = []
        for j in range(k):
            if j:
                t0 = time.perf_counter()
                h = draft.extend(cache, h, torch.tensor(proposal[-1:]), last + j - 1 - b, b)
            token, q = self._next(h, seq, sampled)
            proposal.append(token)
            if q is not None:
                probs.append(q)
            self.cost.observe(rows if j == 0 else 1, time.perf_counter() - t0)  # one draft forward
        seq.spec_token_ids = proposal
        seq.spec_draft_probs = torch.stack(probs) if probs else None

    def weight_bytes(self) -> int:
        """Bytes the draft reads per forward (its layer, fusion maps and head rows)."""
        d = self.draft
        return sum(p.numel() * 4 for p in d.parameters()) + d.head.numel() * 4

    def _next(self, h: torch.Tensor, seq: Sequence, sampled: bool) -> tuple[int, torch.Tensor | None]:
        """The draft's token after output stream h: its argmax, or for unseeded sampled requests a draw from its
        (temperature / top-k / top-p) distribution over the whole vocabulary, returned with it."""
        with torch.inference_mode():
            rows = self.draft.logits(h)
        ids = self.draft.vocab_ids
        if not sampled:
            return int(ids[int(rows[0].argmax())]), None
        full = rows.new_full((1, self.vocab_size), float("-inf")).index_copy_(1, ids, rows)
        q = target_probs(full, [seq.params])[0]
        noise = torch.empty_like(q).exponential_()
        return int((q / noise.clamp_(min=1e-30)).argmax()), q
