"""The rejection sampler keeps the target's distribution exactly: over growing sample counts the histogram of
emitted tokens closes in on the target's probabilities, while its distance to the draft's stays put."""
from __future__ import annotations

import torch

from hosted.sampling_params import SamplingParams
from hosted.sequence import Sequence
from hosted.spec import rejection

V = 8
COUNTS = (500, 4000, 32000)


def _tv(hist: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((hist / hist.sum() - probs).abs().sum())


def _seq(draft: list[int], params: SamplingParams, q: torch.Tensor | None = None) -> Sequence:
    seq = Sequence(request_id="s", token_ids=[1, 2, 3], num_prompt_tokens=3, params=params, arrival=0)
    seq.num_computed_tokens = 2
    seq.spec_token_ids = list(draft)
    seq.spec_draft_probs = q
    return seq


def _distances(emitted: list[list[int]], counts, target: torch.Tensor, draft: torch.Tensor):
    """TV distance of the pooled histogram of the first n sequences' emitted tokens, for each n in counts."""
    to_target, to_draft = [], []
    for n in counts:
        hist = torch.bincount(torch.tensor([t for out in emitted[:n] for t in out]), minlength=V).double()
        to_target.append(_tv(hist, target))
        to_draft.append(_tv(hist, draft))
    return to_target, to_draft


def _assert_converges(to_target, to_draft, gap: float) -> None:
    # Sampling noise shrinks like 1/sqrt(n): 64x the samples, 8x closer (3x asked, for slack).
    assert to_target[-1] < to_target[0] / 3, to_target
    assert to_target[-1] < 0.02, to_target
    # The distance to the draft stays at the true gap: it does not shrink at all.
    assert all(abs(d - gap) < 0.05 for d in to_draft), (to_draft, gap)
    assert (to_target[0] - to_target[-1]) > 5 * abs(to_draft[0] - to_draft[-1])


def test_draft_distribution_rule_follows_the_target():
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([2.0, 1.5, 0.3, 0.0, -0.5, -1.0, 1.0, 0.2])
    p = logits.softmax(-1)
    q = torch.tensor([0.02, 0.03, 0.3, 0.25, 0.2, 0.1, 0.05, 0.05])  # far from p
    k = 3
    params = SamplingParams(temperature=1.0)
    seqs = []
    for _ in range(COUNTS[-1]):
        draft = torch.multinomial(q, k, replacement=True, generator=gen).tolist()  # drafts drawn from q
        seqs.append(_seq(draft, params, q.expand(k, V)))
    torch.manual_seed(1)
    emitted = rejection.verify(logits.expand(len(seqs) * (k + 1), V).contiguous(), seqs)
    assert all(1 <= len(out) <= k + 1 for out in emitted)
    assert all(out[:-1] == s.spec_token_ids[:len(out) - 1] for out, s in zip(emitted, seqs))
    _assert_converges(*_distances(emitted, COUNTS, p, q), gap=0.5 * float((p - q).abs().sum()))
    # Acceptance rate is sum(min(p, q)) per token, as the theory says.
    accepted = sum(len(out) - 1 for out in emitted)
    examined = sum(min(len(out), k) for out in emitted)
    assert abs(accepted / examined - float(torch.minimum(p, q).sum())) < 0.02


def test_point_mass_rule_follows_the_processed_target():
    """n-gram drafts: temperature, top-k and top-p shape the target exactly as the plain sampler's."""
    logits = torch.tensor([1.0, 2.5, 0.5, 2.0, -1.0, 0.0, 1.8, -0.3])
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.95)
    scaled = logits / 0.7
    keep = scaled >= scaled.topk(5).values[-1]
    probs = torch.where(keep, scaled, torch.tensor(float("-inf"))).softmax(-1)
    order = probs.argsort(descending=True)
    before = probs[order].cumsum(0) - probs[order]
    probs[order[before >= 0.95]] = 0.0
    target = probs / probs.sum()
    draft_token = 2  # a poor proposal: not among the likeliest
    point = torch.zeros(V)
    point[draft_token] = 1.0
    seqs = [_seq([draft_token, draft_token], params) for _ in range(COUNTS[-1])]
    torch.manual_seed(2)
    emitted = rejection.verify(logits.expand(len(seqs) * 3, V).contiguous(), seqs)
    _assert_converges(*_distances(emitted, COUNTS, target, point), gap=1.0 - float(target[draft_token]))


def test_greedy_keeps_the_agreeing_prefix_then_the_argmax():
    assert rejection.accept_matches([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]
    assert rejection.accept_matches([5, 6, 7], [4, 6, 7, 1]) == [4]
    assert rejection.accept_matches([5, 6, 7], [5, 6, 7, 1]) == [5, 6, 7, 1]
    logits = torch.full((3, V), -1.0)
    logits[0, 4] = logits[1, 6] = logits[2, 0] = 3.0
    seqs = [_seq([4, 6], SamplingParams(temperature=0.0)), _seq([4, 1], SamplingParams(temperature=0.0))]
    assert rejection.verify(torch.cat([logits, logits]), seqs) == [[4, 6, 0], [4, 6]]


def test_penalties_count_the_drafts_ahead_of_each_row():
    """Row 1 sees draft 0 as generated: a frequency penalty there flips its argmax away from that token."""
    logits = torch.zeros(2, V)
    logits[:, 3] = 1.0  # both rows prefer token 3 ...
    logits[:, 5] = 0.9  # ... by less than the penalty on a token already generated
    seq = _seq([3], SamplingParams(temperature=0.0, frequency_penalty=0.5))
    assert rejection.verify(logits, [seq]) == [[3, 5]]


def test_seeded_point_mass_draws_exactly_the_plain_samplers_tokens():
    from hosted.sampler import Sampler

    gen_logits = torch.Generator().manual_seed(5)
    rows = torch.randn(4, V, generator=gen_logits)
    params = SamplingParams(temperature=1.0, seed=9)
    plain_seq = _seq([], params)
    plain_seq.generator = torch.Generator().manual_seed(9)
    sampler = Sampler(torch.device("cpu"))
    plain = [sampler(rows[j:j + 1], [plain_seq]).token_ids[0] for j in range(4)]
    seq = _seq(plain[:2] + [(plain[2] + 1) % V], params)  # two right, the third wrong
    seq.generator = torch.Generator().manual_seed(9)
    assert rejection.verify(rows, [seq]) == [plain[:3]]
