"""Divergences between the teacher's and the student's next-token distributions, over the head's tokens.

The teacher is known by its top-k tokens (the engine reports k = 20 raw logprobs per token). Its target over
the student's H head tokens is: the top-k probabilities of the tokens the head covers, plus the mass outside
the top k spread evenly over all H (so no head token has probability 0, which reverse KL needs), renormalised
over the head (the mass of top-k tokens the head lacks is dropped: the draft can never propose them).
  fkl  KL(teacher || student): mass-covering, the classic distillation loss;
  rkl  KL(student || teacher): mode-seeking;
  jsd  Jensen-Shannon with weight 1/2: bounded, in between.
DistillSpec (Zhou et al., 2023) found the best choice depends on the task and decoding; all three are here.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

DIVERGENCES = ("fkl", "rkl", "jsd")


def head_index(vocab_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[vocab_size] int64: each token's row in the head, -1 for tokens outside it."""
    index = torch.full((vocab_size,), -1, dtype=torch.int64)
    index[vocab_ids] = torch.arange(len(vocab_ids))
    return index


def teacher_targets(top_ids: torch.Tensor, top_logprobs: torch.Tensor, index: torch.Tensor,
                    head_size: int) -> torch.Tensor:
    """[N, H] teacher distributions over the head from [N, k] top ids / logprobs."""
    probs = top_logprobs.float().exp()
    rows = index[top_ids.long()]  # [N, k] head rows, -1 outside
    covered = rows >= 0
    dense = torch.zeros(top_ids.shape[0], head_size)
    dense.scatter_add_(1, rows.clamp(min=0), torch.where(covered, probs, torch.zeros_like(probs)))
    rest = (1.0 - probs.sum(dim=1, keepdim=True)).clamp(min=0.0)
    dense += rest / head_size
    return dense / dense.sum(dim=1, keepdim=True).clamp(min=1e-12)


def divergence(name: str, student_logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over rows of the named divergence between `target` [N, H] and softmax(student_logits) [N, H]."""
    log_q = F.log_softmax(student_logits.float(), dim=-1)
    log_p = target.clamp(min=1e-12).log()
    if name == "fkl":
        return (target * (log_p - log_q)).sum(dim=-1).mean()
    q = log_q.exp()
    if name == "rkl":
        return (q * (log_q - log_p)).sum(dim=-1).mean()
    if name == "jsd":
        log_m = (0.5 * (target + q)).clamp(min=1e-12).log()
        return 0.5 * ((target * (log_p - log_m)).sum(dim=-1) + (q * (log_q - log_m)).sum(dim=-1)).mean()
    raise ValueError(f"--divergence must be one of {', '.join(DIVERGENCES)}, got {name!r}")
