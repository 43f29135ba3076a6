"""Speculative decoding in the engine's step: before scheduling, give the running decodes draft tokens (as many
as the goodput planner chooses); after the one target forward, verify them with the rejection sampler and roll
back the KV of the rejected ones.

A decode verifying k drafts feeds its last token and the k drafts as one prefill chunk over its paged KV
(`Sequence.spec_token_ids`, scheduled by `Scheduler`, fed and given k + 1 logit rows by `ModelRunner`). After
the step it keeps the accepted drafts and one target token; its computed count is cut back to the positions
whose KV belongs to kept tokens and its surplus blocks are freed before any block is entered into the prefix
cache, so no cached block ever holds a rejected token.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from hosted.block_manager import BlockManager
from hosted.config import EngineConfig, ModelConfig
from hosted.model_runner import ModelRunner
from hosted.sampler import Sampler, SampleResult
from hosted.scheduler import Scheduler
from hosted.sequence import Sequence
from hosted.spec import rejection
from hosted.spec.draft import DraftProposer
from hosted.spec.eagle import EagleProposer
from hosted.spec.ngram import NgramIndex
from hosted.spec.planner import (
    Acceptance,
    BackOff,
    Candidate,
    Ledger,
    Plan,
    ScaledCost,
    StepCost,
    plan_drafts,
)

PROBE_EVERY = 32  # steps without speculation after which a sequence may verify one draft, to re-measure
PROBE_COST = 0.02  # the most a probe may cost, as a fraction of the sequence's share of the steps since
OVERHEAD_WEIGHT = 0.2  # of a new measurement in the per-verifying-decode overhead's running mean
SEQ_DECAY = 0.8  # forgetting of a sequence's own acceptance counts, per verification
SEQ_PRIOR_WEIGHT = 3.0  # examined drafts' worth of the overall rate in a sequence's estimate
CALIBRATION_WEIGHT = 0.2  # of a speculating step's realised / expected goodput in the running calibration
CALIBRATION_RELAX = 0.02  # per plan without drafts, how far the calibration drifts back towards 1 (re-trying)
CALIBRATION_RANGE = (0.25, 1.5)


@dataclass(slots=True)
class SeqSpec:
    """Per-sequence speculation state (Sequence.spec_state)."""

    acceptance: Acceptance  # shared by both proposers when n-gram lookup runs alongside a draft (partial)
    ngram: NgramIndex | None = None  # n-gram lookup (ngram, or alongside a draft)
    since: int = 0  # the decoder's step count when it last verified a draft (or arrived)
    kind: int = 0  # what its pending proposal came from: the n-gram match length (0: the draft model)


@dataclass(slots=True)
class Sampled:
    """One sequence's tokens from one step: accepted drafts (if any) and one token of the target's."""

    token_ids: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None  # per token, when requested
    num_proposed: int = 0
    num_accepted: int = 0


class SpecDecoder:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, runner: ModelRunner,
                 max_model_len: int) -> None:
        self.method = config.spec_method
        self.k_max = config.num_speculative_tokens
        self.adaptive = config.spec_adaptive
        self.alongside = config.spec_ngram_alongside  # n-gram lookup per sequence beside the draft
        self.ngram_sizes = (config.spec_ngram_min, config.spec_ngram_max)
        self.max_model_len = max_model_len
        self.budget = config.max_num_batched_tokens
        # Seconds per target forward (+ sampling) by tokens fed, from steps without drafts; and what each
        # verifying decode adds beyond that (on CPU the prefill path's attention runs sequence by sequence).
        self.target_cost = StepCost()
        self.verify_overhead = 0.0
        self._verifying = 0  # decodes that verified drafts in the current step
        # Over all sequences, by proposal kind (n-gram match length; 0 for the draft model): the prior of each
        # sequence's own estimate.
        self.acceptance: dict[int, Acceptance] = {}
        self.draft: DraftProposer | EagleProposer | None = None
        self.draft_weight_ratio = 0.0
        if self.method == "draft":
            self.draft = _build_draft(config, model_config, runner, max_model_len)
            self.draft_weight_ratio = _weight_ratio(self.draft.runner, runner)
        elif self.method == "eagle":
            assert config.draft_model_dir is not None
            self.draft = EagleProposer(config.draft_model_dir, runner)
            self.draft_weight_ratio = self.draft.weight_bytes() / max(_model_bytes(runner), 1)
        self.num_proposed = 0  # draft tokens verified, all requests
        self.num_accepted = 0  # of them, kept as output
        self.verifications: dict[tuple[int, int], int] = {}  # (drafts verified, accepted) -> verifications
        self.propose_seconds = 0.0
        self._pending: list[Sequence] = []
        self._step = 0  # propose() calls so far
        self.backoff = BackOff()  # adaptive: skip planning while the planner keeps speculation off
        # Adaptive: realised goodput of speculating vs plain decode-only steps per batch bucket; holds a bucket
        # off where speculating has not paid, whatever the models predict (never slower than no speculation).
        self.ledger = Ledger()
        self._decode_only = False  # this step feeds decodes only (what the ledger compares)
        self._emitted = 0  # tokens this step emitted, every sequence's
        # Realised over expected goodput of the steps that speculated as planned (running mean), per batch-size
        # bucket (calibration_bucket): the planner's models of acceptance (iid) and cost (the forward) miss
        # different things at batch 1 and at batch 32, and one batch size's lesson must not steer another's.
        self.calibrations: dict[int, float] = {}
        self._bucket = 0  # this step's bucket
        self._plan: Plan | None = None  # this step's plan, when it has drafts and no probes were added
        self._plan_decodes: set[int] = set()  # id() of the decodes it covers
        self._realised = 0  # tokens those decodes emitted this step

    # ---- before scheduling ------------------------------------------------------------------------
    def propose(self, scheduler: Scheduler) -> None:
        """Set spec_token_ids on the running decodes that should speculate this step."""
        t0 = time.perf_counter()
        self._verifying = 0
        self._plan, self._realised = None, 0
        for seq in self._pending:  # anything proposed last step and not scheduled
            seq.spec_token_ids = []
            seq.spec_draft_probs = None
        self._pending = []
        self._step += 1
        if isinstance(self.draft, EagleProposer):
            self.draft.ingest()  # the last forward's features, before anything is planned from them
        # Constrained sequences (a grammar matcher) get no drafts: every token they emit is masked by the grammar.
        decodes = [s for s in scheduler.running if s.num_uncomputed == 1 and s.matcher is None]
        self._bucket = calibration_bucket(len(decodes))
        base = self._base_tokens(scheduler, len(decodes))
        self._decode_only = bool(decodes) and base == len(decodes) == len(scheduler.running)
        if not decodes:  # nothing to plan for (a prompt's step): the back-off's state stays as it is
            self.propose_seconds = time.perf_counter() - t0
            return
        if self.adaptive and (not self.ledger.allowed(self._bucket, self._step)
                              or not self.backoff.ready(len(decodes))):
            # Resting: nothing proposed; a feature-level draft captures again only for the step before the next
            # plan (capture slows every forward and stops native greedy bursts).
            self._arm(self.resting_steps(len(decodes)) == 0)
            self.propose_seconds = time.perf_counter() - t0
            return
        self._arm(True)
        seqs, cands, proposals = [], [], []
        for seq in decodes:
            state = seq.spec_state
            if state is None:
                lookup = self.draft is None or self.alongside
                state = seq.spec_state = SeqSpec(Acceptance(decay=SEQ_DECAY),
                                                 NgramIndex(*self.ngram_sizes) if lookup else None,
                                                 since=self._step)
            cap = min(self.k_max, seq.params.max_tokens - seq.num_output_tokens - 1,
                      self.max_model_len - seq.num_tokens - 1)
            proposal, kind = [], 0
            if state.ngram is not None:
                proposal = state.ngram.propose(seq.token_ids, cap)
                kind = state.ngram.matched
            if self.draft is not None and (not proposal or not self._lookup_pays(kind)):
                proposal, kind = [], 0  # the draft proposes for it
            state.kind = kind
            available = len(proposal) if kind or self.draft is None else cap
            if available > 0:
                seqs.append(seq)
                prior = self._overall(kind).rate(0.5)
                lag = self.draft.lag(seq) if self.draft is not None and not kind else 1
                cands.append(Candidate(available, state.acceptance.rate(prior, SEQ_PRIOR_WEIGHT), lag,
                                       drafted=self.draft is not None and not kind))
                proposals.append(proposal)
        if cands:
            if self.adaptive:
                calibration = self.calibrations.get(self._bucket, 1.0)
                plan = plan_drafts(cands, base, len(decodes), self.budget, self.target_cost,
                                   self._draft_cost(), self.verify_overhead, calibration)
                ks = list(plan.ks)
                self.backoff.record(any(ks), len(decodes))  # the planner's choice: probes do not end it
                self._probe(seqs, ks, base, len(decodes))
                if any(plan.ks) and ks == plan.ks and plan.seconds > 0:
                    self._plan, self._plan_decodes = plan, {id(s) for s in decodes}
                elif not any(plan.ks):
                    self.calibrations[self._bucket] = calibration + CALIBRATION_RELAX * (1.0 - calibration)
            else:
                ks = [c.max_k for c in cands]
            for seq, proposal, k in zip(seqs, proposals, ks):
                if proposal:
                    seq.spec_token_ids = proposal[:k]
            if self.draft is not None:
                drafted = [(s, k) for s, c, k in zip(seqs, cands, ks) if c.drafted]
                if drafted:
                    self.draft.propose([s for s, _ in drafted], [k for _, k in drafted])
            self._pending = [s for s in seqs if s.spec_token_ids]
        self.propose_seconds = time.perf_counter() - t0

    def resting_steps(self, num_decodes: int) -> int:
        """Steps from the next one on in which speculation stays off whatever happens (the back-off's skips, the
        ledger's hold at this batch size): the engine may run them as native greedy bursts (then `rested`)."""
        if not self.adaptive:
            return 0
        held = self.ledger.held_for(calibration_bucket(num_decodes), self._step + 1)
        skips = self.backoff.left if num_decodes >= self.backoff.shrink * self.backoff.decodes else 0
        return max(held, skips)

    def rested(self, steps: int, seconds: float = 0.0, num_decodes: int = 0) -> None:
        """`steps` decode steps of `num_decodes` sequences ran outside propose in `seconds` (a greedy burst while
        resting): count them as skipped, and as the plain goodput speculation has to beat (the ledger's)."""
        if self.adaptive and steps > 0 and num_decodes > 0:
            self.ledger.record(calibration_bucket(num_decodes), self._step, False, steps * num_decodes, seconds)
        self._step += steps
        self.backoff.left = max(0, self.backoff.left - steps)

    def _arm(self, on: bool) -> None:
        """Feature capture on only when a feature-level draft may propose from it."""
        if isinstance(self.draft, EagleProposer):
            self.draft.arm(on)

    def _lookup_pays(self, kind: int) -> bool:
        """With n-gram lookup alongside a draft: whether a match of this length has been accepted at least as
        often as the draft's proposals (both start from the same prior, so a draft untried yet still loses to a
        long match only once measured)."""
        return self._overall(kind).rate(0.5) >= self._overall(0).rate(0.5)

    def _draft_cost(self) -> StepCost | ScaledCost | None:
        """The draft's measured cost per forward, or until it has one the target's scaled by the weights."""
        if self.draft is None:
            return None
        return self.draft.cost if self.draft.cost.known else ScaledCost(self.target_cost, self.draft_weight_ratio)

    def _base_tokens(self, scheduler: Scheduler, num_decodes: int) -> int:
        """About what this step feeds without drafts: the decodes, and prefill work up to the token budget."""
        prefill = sum(s.num_uncomputed for s in scheduler.running if s.num_uncomputed > 1)
        prefill += sum(s.num_tokens - s.num_computed_tokens for s in scheduler.waiting)
        return num_decodes + min(prefill, max(0, self.budget - num_decodes))

    def _probe(self, seqs: list[Sequence], ks: list[int], base: int, num_decodes: int) -> None:
        """Give one draft to a sequence the planner has kept off for PROBE_EVERY steps, to re-measure its
        acceptance, when that costs at most PROBE_COST of its share of the steps since (a draft model first
        catches up on every token it missed, so an expensive draft once switched off stays off; at high batch a
        sequence's share of a step is small, so nobody probes). Steps skipped by the back-off count as idle."""
        step = self.target_cost(base)
        extra = self.target_cost(base + 1) - step + self.verify_overhead
        lost = self.ledger.lost(self._bucket)  # measured losing at this batch size: only the ledger re-tests
        for i, seq in enumerate(seqs):
            state = seq.spec_state
            idle = self._step - state.since
            if ks[i] == 0 and idle >= PROBE_EVERY and not lost:
                draft_cost = self._draft_cost()
                drafted = draft_cost is not None and not state.kind
                cost = extra + (draft_cost(self.draft.lag(seq)) if drafted else 0.0)
                if cost <= PROBE_COST * idle * step / num_decodes:
                    ks[i] = 1
            if ks[i]:
                state.since = self._step + 1  # idle from the next step on

    # ---- after the forward ------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, seqs: list[Sequence], sampler: Sampler) -> list[Sampled]:
        """Tokens for every sequence that reached its end this step (rows as ModelRunner.execute returns them)."""
        spec = [i for i, s in enumerate(seqs) if s.spec_token_ids]
        if not spec:
            return self._count(seqs, plain_samples(sampler(logits, seqs)))
        counts = rejection.row_counts(seqs)
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        out: list[Sampled | None] = [None] * len(seqs)
        plain = [i for i, s in enumerate(seqs) if not s.spec_token_ids]
        if plain:
            result = sampler(logits[[starts[i] for i in plain]], [seqs[i] for i in plain])
            for i, got in zip(plain, plain_samples(result)):
                out[i] = got
        spec_seqs = [seqs[i] for i in spec]
        self._verifying = len(spec_seqs)
        spec_logits = logits[[r for i in spec for r in range(starts[i], starts[i + 1])]]
        emitted = rejection.verify(spec_logits, spec_seqs)
        row = 0
        for i, seq, tokens in zip(spec, spec_seqs, emitted):
            p = seq.params
            lps = None
            if p.logprobs or p.top_logprobs > 0:
                lps = _logprobs(spec_logits[row:row + len(tokens)], tokens, p.top_logprobs)
            k = len(seq.spec_token_ids)
            out[i] = Sampled(tokens, lps, k, len(tokens) - 1)
            row += k + 1
        return self._count(seqs, [o for o in out if o is not None])

    def _count(self, seqs: list[Sequence], sampled: list[Sampled]) -> list[Sampled]:
        """Note the tokens emitted (the ledger's) and those the planned decodes emitted (the calibration's);
        returns `sampled`."""
        self._emitted = sum(len(g.token_ids) for g in sampled)
        if self._plan is not None:
            self._realised = sum(len(g.token_ids) for s, g in zip(seqs, sampled) if id(s) in self._plan_decodes)
        return sampled

    def settle(self, seq: Sequence, got: Sampled, num_kept: int, block_manager: BlockManager) -> None:
        """After seq.token_ids got the first `num_kept` of got.token_ids (fewer at EOS / max_tokens): its KV keeps
        the last fed token and the kept drafts; the rest is rolled back."""
        k = got.num_proposed
        kept_drafts = min(got.num_accepted, num_kept)
        seq.num_computed_tokens -= k - kept_drafts  # the step counted 1 + k tokens computed
        block_manager.truncate(seq, seq.num_tokens)
        seq.spec_token_ids = []
        seq.spec_draft_probs = None
        seq.spec_proposed += k
        seq.spec_accepted += kept_drafts
        self.num_proposed += k
        self.num_accepted += kept_drafts
        key = (k, got.num_accepted)
        self.verifications[key] = self.verifications.get(key, 0) + 1
        seq.spec_state.acceptance.update(k, got.num_accepted)
        self._overall(seq.spec_state.kind).update(k, got.num_accepted)

    def _overall(self, kind: int) -> Acceptance:
        acc = self.acceptance.get(kind)
        if acc is None:
            acc = self.acceptance[kind] = Acceptance(decay=0.98)
        return acc

    def observe(self, num_tokens: int, seconds: float) -> None:
        """One target forward + sampling step's measured cost: a plain step refines the cost by tokens, a step
        that verified drafts the overhead per verifying decode (what it cost beyond its tokens)."""
        if self.adaptive and self._decode_only:  # whole steps, proposing included
            self.ledger.record(self._bucket, self._step, self._verifying > 0, self._emitted,
                               seconds + self.propose_seconds)
        self._emitted = 0
        if not self._verifying:
            self.target_cost.observe(num_tokens, seconds)
            return
        per_seq = max(0.0, seconds - self.target_cost(num_tokens)) / self._verifying
        self.verify_overhead += OVERHEAD_WEIGHT * (per_seq - self.verify_overhead)
        plan = self._plan
        if plan is not None and self._realised:
            # Realised goodput counts the whole speculating step: the forward, and proposing (draft forwards).
            realised = self._realised / max(seconds + self.propose_seconds, 1e-9)
            ratio = realised / (plan.emitted / plan.seconds)
            low, high = CALIBRATION_RANGE
            cal = self.calibrations.get(self._bucket, 1.0)
            self.calibrations[self._bucket] = min(high, max(low, cal + CALIBRATION_WEIGHT * (ratio - cal)))
        self._plan = None

    def release(self, seq: Sequence) -> None:
        """seq finished, was aborted or was preempted: free its draft KV (the draft recomputes it if needed)."""
        if self.draft is not None:
            self.draft.release(seq)


def acceptance_by_position(verifications: dict[tuple[int, int], int]) -> list[float]:
    """P(draft j accepted | j drafts verified and drafts 1..j-1 accepted), j = 1.. (SpecDecoder.verifications)."""
    depth = max((k for k, _ in verifications), default=0)
    rates = []
    for j in range(1, depth + 1):
        reached = sum(n for (k, a), n in verifications.items() if k >= j and a >= j - 1)
        kept = sum(n for (k, a), n in verifications.items() if k >= j and a >= j)
        rates.append(kept / reached if reached else 0.0)
    return rates


def plain_samples(result: SampleResult) -> list[Sampled]:
    """The plain sampler's one token per sequence, as Sampled."""
    return [Sampled([t], [lp] if lp is not None else None) for t, lp in zip(result.token_ids, result.logprobs)]


def _logprobs(rows: torch.Tensor, tokens: list[int], top_n: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """Raw-distribution logprobs of each emitted token from its target row, as the sampler reports them."""
    lp = torch.log_softmax(rows, dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in tokens]
    if top_n:
        vals, ids = lp.topk(top_n, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    return list(zip(chosen, tops))


def calibration_bucket(num_decodes: int) -> int:
    """Batch sizes that share a calibration: powers of two (1, 2-3, 4-7, ...)."""
    return max(num_decodes, 1).bit_length()


def _weight_ratio(draft: ModelRunner, target: ModelRunner) -> float:
    """The draft's parameter bytes read per forward over the target's (an untied embedding is a lookup, not
    read whole): a first guess of its cost per forward."""
    return _model_bytes(draft) / max(_model_bytes(target), 1)


def _model_bytes(runner: ModelRunner) -> int:
    tied = runner.model_config.tie_word_embeddings
    return sum(p.numel() * p.element_size() for name, p in runner.model.named_parameters()
               if tied or not name.startswith("embed_tokens"))


def _build_draft(config: EngineConfig, model_config: ModelConfig, runner: ModelRunner,
                 max_model_len: int) -> DraftProposer:
    assert config.draft_model_dir is not None
    draft_config = ModelConfig.from_dir(config.draft_model_dir)
    if draft_config.vocab_size != model_config.vocab_size:
        raise ValueError(f"draft model {config.draft_model_dir!r} has vocabulary size {draft_config.vocab_size}, "
                         f"the target {model_config.vocab_size}: a draft must share the target's tokenizer")
    if draft_config.max_position_embeddings < max_model_len:
        raise ValueError(f"draft model {config.draft_model_dir!r} supports {draft_config.max_position_embeddings} "
                         f"positions, fewer than max_model_len={max_model_len}; lower --max-model-len")
    # The draft's pool holds as many blocks as the target's (its blocks are smaller when the draft is).
    draft_engine = dataclasses.replace(config, model_dir=config.draft_model_dir, num_kv_blocks=runner.num_blocks,
                                       speculative=None, draft_model_dir=None)
    return DraftProposer(ModelRunner(draft_config, draft_engine, max_model_len), config.block_size)
