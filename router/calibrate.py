"""Pick a routing threshold from labelled data (a target strong-call share, or a budget).

Convention (shared with the gateway): a request goes to the strong (`hard`) backend iff
score >= threshold. Writing the threshold into a policy file is the gateway's job
(gateway/policy_edit.py); `switchyard router calibrate --write` receives it by injection.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np


class CalibrationError(ValueError):
    """The requested target cannot be met, or the policy cannot be edited safely."""


@dataclass(frozen=True, slots=True)
class Calibration:
    threshold: float
    strong_share: float      # share of the calibration rows routed strong at this threshold
    target: str              # what was asked, in words


def _groups(scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct scores, descending, and how many rows score at or above each."""
    s = np.sort(np.asarray(scores, dtype=np.float64))[::-1]
    ends = np.append(np.flatnonzero(np.diff(s) != 0) + 1, s.size)
    return s, ends


def threshold_for_count(scores: np.ndarray, k: int) -> float:
    """A threshold that sends exactly the k highest-scoring rows strong (k at a tie-group end):
    halfway between the last strong and the first weak score, so it is robust on new data."""
    s = np.sort(np.asarray(scores, dtype=np.float64))[::-1]
    if k <= 0:
        return 1.0
    if k >= s.size:
        return 0.0
    return float((s[k - 1] + s[k]) / 2.0)


def for_strong_share(scores: np.ndarray, target: float) -> Calibration:
    if not 0.0 <= target <= 1.0:
        raise CalibrationError(f"--target-strong-share must be between 0 and 1, got {target}")
    s, ends = _groups(scores)
    ks = np.concatenate([[0], ends])
    k = int(ks[np.argmin(np.abs(ks - target * s.size))])  # nearest achievable share (ties split no further)
    thr = threshold_for_count(s, k)
    return Calibration(thr, float(np.mean(s >= thr)), f"strong share {target:g}")


def max_strong_share_for_budget(max_usd_per_1k: float, weak_usd: float, strong_usd: float) -> float:
    if strong_usd <= weak_usd:
        raise CalibrationError(f"the strong backend must cost more per request than the weak one "
                               f"(got weak {weak_usd:g}, strong {strong_usd:g} USD)")
    per_request = max_usd_per_1k / 1000.0
    if per_request < weak_usd:
        raise CalibrationError(f"a budget of {max_usd_per_1k:g} USD per 1k requests is below the cost of "
                               f"sending everything to the weak backend ({weak_usd * 1000:g} USD per 1k)")
    return min(1.0, (per_request - weak_usd) / (strong_usd - weak_usd))


def for_budget(scores: np.ndarray, max_usd_per_1k: float, weak_usd: float, strong_usd: float) -> Calibration:
    cap = max_strong_share_for_budget(max_usd_per_1k, weak_usd, strong_usd)
    s, ends = _groups(scores)
    ks = np.concatenate([[0], ends])
    k = int(ks[ks <= cap * s.size + 1e-9].max())  # the most strong calls the budget allows
    thr = threshold_for_count(s, k)
    return Calibration(thr, float(np.mean(s >= thr)),
                       f"at most {max_usd_per_1k:g} USD per 1k requests (strong share <= {cap:.4f})")


def policy_snippet(threshold: float, model_path: str) -> str:
    return (f"strategy: difficulty\n"
            f"threshold: {threshold:.6f}\n"
            f"model_path: {json.dumps(model_path)}\n")
