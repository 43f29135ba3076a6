"""Prompt-lookup proposals, and the goodput planner: speculate when verifying extra tokens is cheap and drafts
are likely accepted, never when verification costs what it saves (as at high batch)."""
from __future__ import annotations

import random

import pytest

from hosted.spec.ngram import NgramIndex
from hosted.spec.planner import (
    Acceptance,
    BackOff,
    Candidate,
    ScaledCost,
    StepCost,
    choose,
    expected_tokens,
    plan_drafts,
)


def _reference(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    for n in range(min(n_max, len(tokens)), n_min - 1, -1):
        pattern = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest occurrence before the suffix itself
            if tokens[start:start + n] == pattern:
                return tokens[start + n:start + n + k]
    return []


def test_ngram_proposes_after_the_latest_longest_match():
    idx = NgramIndex(1, 3)
    assert idx.propose([1, 2, 3, 8, 2, 3, 9, 1, 2, 3], 3) == [8, 2, 3]  # the 3-gram beats the later 2-gram
    assert NgramIndex(1, 2).propose([1, 2, 3, 8, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]
    assert NgramIndex(1, 3).propose([5, 1, 2, 7, 1, 2], 4) == [7, 1, 2]
    assert NgramIndex(1, 3).propose([1, 2, 3, 4], 4) == []
    assert NgramIndex(2, 3).propose([4, 1, 5, 1], 2) == []  # only a 1-gram repeats


def test_ngram_index_grows_incrementally_like_a_full_search():
    rng = random.Random(0)
    for trial in range(20):
        idx = NgramIndex(1, 3)
        tokens = [rng.randrange(6) for _ in range(3)]
        for _ in range(60):
            assert idx.propose(tokens, 4) == _reference(tokens, 4, 1, 3), (trial, tokens)
            tokens.extend(rng.randrange(6) for _ in range(rng.randrange(1, 4)))


def test_expected_tokens():
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(1.0, 4) == 5
    assert expected_tokens(0.0, 4) == 1


def test_acceptance_rate_is_accepted_over_examined():
    acc = Acceptance(decay=1.0)
    acc.update(4, 4)  # 4 examined, 4 accepted
    acc.update(4, 1)  # 2 examined (the second rejected), 1 accepted
    assert acc.rate(prior=0.5, prior_weight=0.0) == pytest.approx(5 / 6)


def _cost(points) -> StepCost:
    cost = StepCost()
    for tokens, seconds in points:
        cost.observe(tokens, seconds)
    return cost


def test_step_cost_interpolates_monotone_and_extrapolates_proportionally():
    cost = _cost([(1, 3.0), (5, 4.0), (9, 3.9), (64, 14.0)])
    assert cost(1) == pytest.approx(3.0)
    assert cost(3) == pytest.approx(3.5)
    assert cost(9) == pytest.approx(4.0)  # made non-decreasing
    assert cost(128) == pytest.approx(28.0)
    assert _cost([(8, 4.0)])(2) == pytest.approx(1.0)  # below the data: a plain step looks cheap


def test_speculates_when_verification_is_nearly_free():
    target = _cost([(1, 3.6e-3), (2, 4.4e-3), (5, 4.8e-3), (9, 5.7e-3), (33, 10.2e-3)])
    assert choose([Candidate(4, 0.8)], 1, 1, 2048, target, None) == [4]
    assert choose([Candidate(4, 0.02)], 1, 1, 2048, target, None) == [0]
    assert choose([Candidate(2, 0.9), Candidate(4, 0.02)], 2, 2, 2048, target, None)[1] == 0
    assert sum(choose([Candidate(4, 0.9)] * 8, 8, 8, 12, target, None)) <= 4  # the step's token budget


def test_never_speculates_when_cost_grows_with_tokens():
    """High batch: the step is compute-bound, every verified token costs as much as a decoded one."""
    target = _cost([(32, 32e-3), (64, 64e-3), (160, 160e-3)])
    for alpha in (0.3, 0.7, 0.95):
        assert choose([Candidate(4, alpha)] * 32, 32, 32, 2048, target, None) == [0] * 32


def test_a_draft_as_costly_as_the_target_is_not_worth_it():
    target = _cost([(1, 3.6e-3), (5, 4.8e-3), (9, 5.7e-3)])
    assert choose([Candidate(4, 0.99)], 1, 1, 2048, target, target) == [0]
    cheap = _cost([(1, 0.3e-3), (5, 0.4e-3)])
    assert choose([Candidate(4, 0.8)], 1, 1, 2048, target, cheap) == [4]


def test_a_per_sequence_verify_overhead_can_outweigh_the_tokens():
    """On CPU a verifying decode leaves the batched decode attention: that overhead counts, once per sequence."""
    target = _cost([(1, 3.6e-3), (8, 7.4e-3), (32, 15.5e-3), (64, 24e-3)])
    assert choose([Candidate(4, 0.75)] * 32, 32, 32, 2048, target, None, per_seq=0.0) != [0] * 32
    assert choose([Candidate(4, 0.75)] * 32, 32, 32, 2048, target, None, per_seq=1.5e-3) == [0] * 32
    # A draft that must first catch up on a long prompt is charged for it.
    cheap = _cost([(1, 0.3e-3), (5, 0.4e-3), (200, 8e-3)])
    assert choose([Candidate(4, 0.8, lag=1)], 1, 1, 2048, target, cheap) == [4]
    assert choose([Candidate(4, 0.8, lag=200)], 1, 1, 2048, target, cheap) == [0]


def _planned(backoff: BackOff, steps: int, decodes, drafts) -> list[int]:
    """The steps (0-based) on which `backoff` lets the planner run; decodes(step) and drafts(step) say how many
    decodes there are and whether the planner then chooses any drafts."""
    out = []
    for step in range(steps):
        if backoff.ready(decodes(step)):
            out.append(step)
            backoff.record(drafts(step), decodes(step))
    return out


def test_backoff_skips_planning_exponentially_while_speculation_stays_off():
    b = BackOff(patience=3, max_skip=8)
    # Three plans without drafts, then skips of 1, 2, 4, 8, 8, ... steps between plans.
    assert _planned(b, 60, lambda s: 32, lambda s: False) == [0, 1, 2, 4, 7, 12, 21, 30, 39, 48, 57]


def test_backoff_ends_when_the_planner_speculates_again():
    b = BackOff(patience=2, max_skip=64)
    # Off until step 10: plans at 0, 1, then skips 1, 2, 4; the plan at step 11 chooses drafts, so the planner
    # runs every step again until the streak builds up anew.
    planned = _planned(b, 20, lambda s: 32, lambda s: s >= 11 and s < 14)
    assert planned == [0, 1, 3, 6, 11, 12, 13, 14, 15, 17]
    assert BackOff().ready(8)  # nothing recorded: plan


def test_backoff_replans_at_once_when_the_batch_shrinks():
    b = BackOff(patience=1, max_skip=64, shrink=0.75)
    planned = _planned(b, 12, lambda s: 32 if s < 8 else 16, lambda s: False)
    # skips 1, 2, 4 steps after plans at 0, 2, 5 (the next due at 10); the batch halves at step 8: plan now,
    # and the back-off starts over from the new batch size.
    assert planned == [0, 2, 5, 8, 10]


@pytest.mark.parametrize("sizes", [(2, 4), (3, 3), (1, 1)])
def test_ngram_index_other_sizes_match_a_full_search(sizes):
    rng = random.Random(1)
    for trial in range(10):
        idx = NgramIndex(*sizes)
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 6))]
        for _ in range(40):
            assert idx.propose(tokens, 3) == _reference(tokens, 3, *sizes), (trial, tokens)
            tokens.extend(rng.randrange(4) for _ in range(rng.randrange(1, 5)))


def test_calibration_from_realised_goodput_scales_every_plan_with_drafts():
    """A plan the models expect to gain 10% is dropped once past speculating steps realised 15% less
    goodput than expected (the cost and acceptance models miss something: it is paid for from measurements)."""
    target = _cost([(8, 20e-3), (16, 24e-3), (40, 40e-3)])
    cands = [Candidate(4, 0.6)] * 8
    plan = plan_drafts(cands, 8, 8, 2048, target, None)
    assert any(plan.ks) and plan.seconds > 0 and plan.emitted > 8
    gain = (plan.emitted / plan.seconds) / (8 / target(8))
    assert 1.0 < gain < 1.5
    assert choose(cands, 8, 8, 2048, target, None, calibration=0.95 / gain) == [0] * 8
    assert choose(cands, 8, 8, 2048, target, None, calibration=1.05 / gain) == plan.ks


def test_no_drafts_before_a_plain_step_is_measured_and_an_unmeasured_draft_is_not_free():
    assert choose([Candidate(4, 0.9)] * 32, 32, 32, 2048, StepCost(), None) == [0] * 32
    target = _cost([(1, 3.6e-3), (5, 4.8e-3), (9, 5.7e-3)])
    assert choose([Candidate(4, 0.8)], 1, 1, 2048, target, ScaledCost(target, 1.0)) == [0]  # as big as the target
    assert choose([Candidate(4, 0.8)], 1, 1, 2048, target, ScaledCost(target, 0.05)) == [4]


def test_calibration_is_kept_per_batch_size_bucket():
    from hosted.spec.decoder import calibration_bucket

    assert [calibration_bucket(n) for n in (0, 1, 2, 3, 4, 7, 8, 31, 32)] == [1, 1, 2, 2, 3, 3, 4, 5, 6]
