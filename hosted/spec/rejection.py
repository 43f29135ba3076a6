"""Speculative sampling: keep a prefix of each sequence's draft tokens so that its output follows the target
distribution exactly, then add one token of the target's own.

A sequence verifying k draft tokens d_0..d_{k-1} brings k + 1 rows of target logits: row j is the target's
next-token distribution at draft token j's position, row k the one after the last draft token. Rows are
processed as `hosted/sampler.py` processes them: presence/frequency penalties over the tokens generated so
far (the draft tokens ahead of the row included), then greedy argmax, or temperature -> top-k -> top-p ->
softmax. Three rules, each exact:

* greedy: keep d_j while it is the row's argmax, then emit the argmax (tokens identical to plain decoding);
* point-mass draft (n-grams; a draft model proposing its argmax): draw the target's own token x_j in each
  row with the sampler's exponential race and keep d_j while x_j == d_j, emitting x_j at the first mismatch
  (or the bonus token at row k). With q the point mass at d this is the standard rule: accept with
  p(d) = min(1, p(d) / q(d)), and on rejection x is a draw from p restricted to x != d, i.e. from
  norm(max(0, p - q)). A seeded request draws its noise from its generator one row at a time, exactly as
  many rows as it emits, so its tokens are those of plain decoding whatever k was;
* draft distribution q (a draft model sampling): accept d_j with probability min(1, p_j(d_j) / q_j(d_j));
  at the first rejection sample norm(max(0, p_j - q_j)); if all k are accepted, sample row k.
"""
from __future__ import annotations

import torch

from hosted.sampler import apply_penalties, greedy_tokens, top_k_top_p_filter
from hosted.sequence import Sequence


def row_counts(seqs: list[Sequence]) -> list[int]:
    """Logit rows each verifying sequence owns (1 + its draft tokens), in order."""
    return [1 + len(s.spec_token_ids) for s in seqs]


def verify(logits: torch.Tensor, seqs: list[Sequence]) -> list[list[int]]:
    """logits [sum(1 + k_i), V] fp32, raw, the rows of seqs[i] consecutive. Returns each sequence's emitted
    tokens: its accepted draft tokens followed by one target token (so len - 1 drafts were accepted)."""
    counts = row_counts(seqs)
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    logits = _penalised(logits, seqs, counts, starts)
    out: list[list[int]] = [[] for _ in seqs]
    greedy = [i for i, s in enumerate(seqs) if s.params.greedy]
    if greedy:
        argmax = greedy_tokens(logits).tolist()
        for i in greedy:
            out[i] = accept_matches(seqs[i].spec_token_ids, argmax[starts[i]:starts[i + 1]])
    sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if sampled:
        rows = [r for i in sampled for r in range(starts[i], starts[i + 1])]
        probs = target_probs(logits[rows], [seqs[i].params for i in sampled for _ in range(counts[i])])
        unseeded_point = [i for i in sampled if seqs[i].generator is None and seqs[i].spec_draft_probs is None]
        race = _raced(probs) if unseeded_point else None
        j = 0
        for i in sampled:
            seq, p = seqs[i], probs[j:j + counts[i]]
            if seq.spec_draft_probs is not None:
                out[i] = accept_by_ratio(p, seq.spec_token_ids, seq.spec_draft_probs, seq.generator)
            elif seq.generator is not None:
                out[i] = _accept_point_seeded(p, seq.spec_token_ids, seq.generator)
            else:
                assert race is not None
                out[i] = accept_matches(seq.spec_token_ids, race[j:j + counts[i]])
            j += counts[i]
    return out


def accept_matches(draft: list[int], target: list[int]) -> list[int]:
    """Point-mass rule given the target's own token per row (argmax, or a draw): keep the agreeing prefix."""
    a = 0
    while a < len(draft) and draft[a] == target[a]:
        a += 1
    return draft[:a] + [target[a]]


def accept_by_ratio(p: torch.Tensor, draft: list[int], q: torch.Tensor,
                    generator: torch.Generator | None = None) -> list[int]:
    """Standard speculative sampling. p [k + 1, V] target probabilities, q [k, V] the draft distributions the
    draft tokens were sampled from."""
    k = len(draft)
    d = torch.tensor(draft, dtype=torch.int64, device=p.device)
    pd = p[:k].gather(1, d[:, None])[:, 0]
    qd = q.to(p.dtype).gather(1, d[:, None])[:, 0]
    u = torch.rand(k, dtype=p.dtype, device=p.device, generator=generator)
    rejected = (u * qd >= pd).tolist()  # accept iff u < p/q (q(d) > 0: d was drawn from q)
    a = rejected.index(True) if True in rejected else k
    if a < k:
        residual = (p[a] - q[a].to(p.dtype)).clamp_(min=0.0)
        if not bool(residual.sum() > 0):  # p == q up to rounding: nothing to correct
            residual = p[a]
        x = exponential_race(residual, generator)
    else:
        x = exponential_race(p[k], generator)
    return draft[:a] + [x]


def target_probs(logits: torch.Tensor, params: list) -> torch.Tensor:
    """Sampled rows (penalties already applied): temperature -> top-k -> top-p -> softmax, as the sampler."""
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    x = logits / temps[:, None]
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=logits.device)
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=logits.device)
    return top_k_top_p_filter(x, top_k, top_p).softmax(dim=-1)


def exponential_race(weights: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """An exact draw from weights / weights.sum() (argmax of w / E, E ~ Exp(1)), as the sampler draws."""
    noise = torch.empty_like(weights).exponential_(generator=generator)
    return int((weights / noise.clamp_(min=1e-30)).argmax())


def _accept_point_seeded(p: torch.Tensor, draft: list[int], generator: torch.Generator) -> list[int]:
    """Row by row, drawing noise only for the rows that emit (the plain sampler's draw order)."""
    out: list[int] = []
    for j in range(len(draft) + 1):
        x = exponential_race(p[j], generator)
        out.append(x)
        if j == len(draft) or x != draft[j]:
            return out
    return out


def _raced(probs: torch.Tensor) -> list[int]:
    """Exponential-race draws for every row at once, from the global RNG (unseeded point-mass drafts)."""
    noise = torch.empty_like(probs).exponential_()
    return (probs / noise.clamp_(min=1e-30)).argmax(dim=-1).tolist()


def _penalised(logits: torch.Tensor, seqs: list[Sequence], counts: list[int], starts: list[int]) -> torch.Tensor:
    """Apply presence/frequency penalties row by row; row j of a sequence also counts its drafts d_0..d_{j-1}."""
    pen = [i for i, s in enumerate(seqs) if s.params.has_penalties]
    if not pen:
        return logits
    rows = [r for i in pen for r in range(starts[i], starts[i + 1])]
    histories: list[list[int]] = []
    presence: list[float] = []
    frequency: list[float] = []
    for i in pen:
        seq = seqs[i]
        generated = seq.output_token_ids()
        for j in range(counts[i]):
            histories.append(generated + seq.spec_token_ids[:j])
            presence.append(seq.params.presence_penalty)
            frequency.append(seq.params.frequency_penalty)
    idx = torch.tensor(rows, device=logits.device)
    sub = apply_penalties(logits.index_select(0, idx), histories,
                          torch.tensor(presence, dtype=logits.dtype, device=logits.device),
                          torch.tensor(frequency, dtype=logits.dtype, device=logits.device))
    return logits.index_copy(0, idx, sub)
