"""Turn one step's logits into next tokens (and logprobs) for a batch of sequences.

Order of operations per row: raw logits -> (logprobs recorded here: log_softmax of the raw model
distribution, as OpenAI reports them) -> presence/frequency penalties -> greedy argmax, or
temperature -> top-k -> top-p -> sample. Sampling uses the exponential-race trick
(argmax of p / E with E ~ Exp(1)), which is an exact draw from p; a seeded request draws its noise
from its own torch.Generator, so its tokens do not depend on what else is in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hosted.sequence import Sequence


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    # Per row: (chosen token's logprob, [(token, logprob)] best first) or None if not requested.
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


def apply_penalties(logits: torch.Tensor, output_ids: list[list[int]], presence: torch.Tensor,
                    frequency: torch.Tensor) -> torch.Tensor:
    """OpenAI semantics: logit[j] -= frequency * count[j] + presence * (count[j] > 0), counting only
    generated tokens. logits [B, V] fp32 is modified in place and returned."""
    rows, vocab = logits.shape
    counts = torch.zeros(rows, vocab, dtype=logits.dtype, device=logits.device)
    for i, ids in enumerate(output_ids):
        if ids:
            idx = torch.tensor(ids, dtype=torch.int64, device=logits.device)
            counts[i].index_add_(0, idx, torch.ones(len(ids), dtype=logits.dtype, device=logits.device))
    logits -= frequency[:, None] * counts + presence[:, None] * (counts > 0).to(logits.dtype)
    return logits


def top_k_top_p_filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top_k (0 = off) and outside its top_p nucleus.
    The nucleus keeps the smallest set of most likely tokens whose probability reaches top_p."""
    vocab = logits.shape[-1]
    use_k = bool((top_k > 0).any())
    use_p = bool((top_p < 1.0).any())
    if not (use_k or use_p):
        return logits
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    if use_k:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], float("-inf"))
    if use_p:
        probs = sorted_logits.softmax(dim=-1)
        # Mass strictly before each token; a token is kept if that is below top_p (the first always is).
        before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(before >= top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, sorted_idx, sorted_logits)


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        """logits [B, V] fp32, row i belongs to seqs[i]."""
        params = [s.params for s in seqs]
        want_logprobs = [p.logprobs or p.top_logprobs > 0 for p in params]
        logprob_rows = None
        if any(want_logprobs):
            logprob_rows = torch.log_softmax(logits, dim=-1)

        if any(p.has_penalties for p in params):
            pen = [i for i, p in enumerate(params) if p.has_penalties]
            idx = torch.tensor(pen, device=logits.device)
            sub = logits.index_select(0, idx)
            presence = torch.tensor([params[i].presence_penalty for i in pen], dtype=sub.dtype, device=sub.device)
            frequency = torch.tensor([params[i].frequency_penalty for i in pen], dtype=sub.dtype, device=sub.device)
            sub = apply_penalties(sub, [seqs[i].output_token_ids() for i in pen], presence, frequency)
            logits = logits.index_copy(0, idx, sub)

        greedy = [p.greedy for p in params]
        if all(greedy):
            tokens = greedy_tokens(logits)
        else:
            tokens = self._sample_mixed(logits, seqs, greedy)
        token_list = tokens.tolist()
        return SampleResult(token_list, self._logprobs(logprob_rows, token_list, params, want_logprobs))

    def _sample_mixed(self, logits: torch.Tensor, seqs: list[Sequence], greedy: list[bool]) -> torch.Tensor:
        tokens = greedy_tokens(logits)
        rows = [i for i, g in enumerate(greedy) if not g]
        idx = torch.tensor(rows, device=logits.device)
        sub = logits.index_select(0, idx)
        params = [seqs[i].params for i in rows]
        temps = torch.tensor([p.temperature for p in params], dtype=sub.dtype, device=sub.device)
        sub = sub / temps[:, None]
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=sub.device)
        top_p = torch.tensor([p.top_p for p in params], dtype=sub.dtype, device=sub.device)
        sub = top_k_top_p_filter(sub, top_k, top_p)
        probs = sub.softmax(dim=-1)
        noise = torch.empty_like(probs)
        unseeded = [j for j, i in enumerate(rows) if seqs[i].generator is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], dtype=probs.dtype,
                                          device=probs.device).exponential_()
        for j, i in enumerate(rows):
            gen = seqs[i].generator
            if gen is not None:
                noise[j].exponential_(generator=gen)
        # Exp(1) draws can be exactly 0; keep 0-probability tokens at 0 instead of nan.
        choice = (probs / noise.clamp_(min=1e-30)).argmax(dim=-1)
        tokens[idx] = choice
        return tokens

    @staticmethod
    def _logprobs(logprob_rows: torch.Tensor | None, tokens: list[int], params, want: list[bool]):
        out: list[tuple[float, list[tuple[int, float]]] | None] = [None] * len(tokens)
        if logprob_rows is None:
            return out
        rows = [i for i, w in enumerate(want) if w]
        idx = torch.tensor(rows, device=logprob_rows.device)
        sub = logprob_rows.index_select(0, idx)
        chosen = sub.gather(1, torch.tensor([tokens[i] for i in rows], device=sub.device)[:, None])[:, 0].tolist()
        k = max(params[i].top_logprobs for i in rows)
        top_vals = top_ids = None
        if k > 0:
            top_vals, top_ids = sub.topk(k, dim=-1)
            top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
        for j, i in enumerate(rows):
            n = params[i].top_logprobs
            top = list(zip(top_ids[j][:n], top_vals[j][:n])) if n and top_ids is not None else []
            out[i] = (chosen[j], top)
        return out


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax (int64), the first index on ties; a NaN row picks its first NaN, as torch.argmax does.
    On CPU numpy's argmax does it: its vectorised scan beat torch's reductions by 6x at 1 x 49152 fp32 logits
    (7 vs 38-42 us) and 8-14x at 64 rows (0.37 vs 3.1 ms argmax, 5.2 ms max(dim)) on 2 threads here.
    Elsewhere `max(dim)` (same index; cheaper than argmax on the GPU's reductions)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.detach().numpy().argmax(axis=-1).astype("int64", copy=False))
    return logits.max(dim=-1).indices
