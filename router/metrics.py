"""Router quality metrics: the quality-vs-strong-share curve, APGR and CPT (as in RouteLLM).

A router scores each request; requests with score >= threshold go to the strong backend.
Sweeping the threshold from above the highest score down to the lowest moves the strong-call
share from 0 to 1. Rows with equal scores cannot be split by any threshold, so the achievable
points are the boundaries between groups of tied scores; between two such points we join
with a straight line, which is the expected quality of breaking the tie at random. A router
that gives every row the same score is therefore exactly the straight line from always-weak
to always-strong, i.e. APGR = 0.5.

APGR is the area under the performance-gap-recovered curve,
    PGR(share) = (quality(share) - quality_weak) / (quality_strong - quality_weak),
over share in [0, 1]. CPT(x) is the smallest share at which PGR first reaches x.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class MetricError(ValueError):
    """The data cannot be evaluated (empty, mismatched lengths, NaN scores, no quality gap)."""


@dataclass(frozen=True, slots=True)
class RoutingCurve:
    share: np.ndarray       # strong-call share at each achievable point, 0 → 1, increasing
    quality: np.ndarray     # mean correctness at that point
    threshold: np.ndarray   # route strong iff score >= threshold reproduces the point (inf at share 0)
    weak_quality: float
    strong_quality: float

    @property
    def gap(self) -> float:
        return self.strong_quality - self.weak_quality

    @property
    def pgr(self) -> np.ndarray:
        if self.gap <= 0:
            raise MetricError(
                f"the strong model is not better than the weak one on this data (weak accuracy "
                f"{self.weak_quality:.3f}, strong {self.strong_quality:.3f}); APGR and CPT are undefined")
        return (self.quality - self.weak_quality) / self.gap


def _as_bool(a: object, name: str) -> np.ndarray:
    arr = np.asarray(a)
    if arr.dtype != bool:
        if not np.isin(arr, [0, 1]).all():
            raise MetricError(f"{name} must hold booleans (or 0/1)")
        arr = arr.astype(bool)
    return arr


def routing_curve(scores: object, weak_correct: object, strong_correct: object) -> RoutingCurve:
    s = np.asarray(scores, dtype=np.float64).ravel()
    w = _as_bool(weak_correct, "weak_correct").ravel()
    st = _as_bool(strong_correct, "strong_correct").ravel()
    n = s.size
    if n == 0:
        raise MetricError("no rows to evaluate")
    if w.size != n or st.size != n:
        raise MetricError(f"length mismatch: {n} scores, {w.size} weak labels, {st.size} strong labels")
    if not np.isfinite(s).all():
        raise MetricError("scores contain NaN or infinity")
    order = np.argsort(-s, kind="stable")
    s_sorted = s[order]
    gain = st[order].astype(np.int64) - w[order].astype(np.int64)
    # Ends of tie groups: k rows routed strong for each k in `ends`.
    ends = np.append(np.flatnonzero(np.diff(s_sorted) != 0) + 1, n)
    k = np.concatenate([[0], ends])
    cum = np.concatenate([[0], np.cumsum(gain)])[k]
    weak_q = float(w.mean())
    quality = weak_q + cum / n
    threshold = np.concatenate([[np.inf], s_sorted[ends - 1]])
    return RoutingCurve(share=k / n, quality=quality, threshold=threshold,
                        weak_quality=weak_q, strong_quality=float(st.mean()))


def apgr(curve: RoutingCurve) -> float:
    y = curve.pgr
    x = curve.share
    return float(np.sum((y[1:] + y[:-1]) * 0.5 * np.diff(x)))


def cpt(curve: RoutingCurve, target: float) -> float:
    """Smallest strong-call share at which PGR reaches `target` (e.g. 0.5), interpolating
    within a tie group (achievable by random tie-breaking)."""
    y = curve.pgr
    x = curve.share
    if y[0] >= target:
        return 0.0
    hit = np.flatnonzero(y >= target)
    if hit.size == 0:  # only possible for target > 1 on a curve that never exceeds the strong model
        return float("nan")
    i = int(hit[0])
    x0, x1, y0, y1 = x[i - 1], x[i], y[i - 1], y[i]
    return float(x0 + (target - y0) / (y1 - y0) * (x1 - x0))


def quality_at_share(curve: RoutingCurve, share: float) -> float:
    return float(np.interp(share, curve.share, curve.quality))


def evaluate(scores: object, weak_correct: object, strong_correct: object, curve_points: int = 21) -> dict:
    """Every figure `router eval` reports, as plain JSON-able values."""
    curve = routing_curve(scores, weak_correct, strong_correct)
    w = _as_bool(weak_correct, "weak_correct").ravel()
    st = _as_bool(strong_correct, "strong_correct").ravel()
    oracle = routing_curve(st.astype(np.int64) - w.astype(np.int64), w, st)
    grid = np.linspace(0.0, 1.0, curve_points)
    return {
        "n": int(w.size),
        "apgr": apgr(curve),
        "cpt20": cpt(curve, 0.2),
        "cpt50": cpt(curve, 0.5),
        "cpt80": cpt(curve, 0.8),
        "weak_accuracy": curve.weak_quality,
        "strong_accuracy": curve.strong_quality,
        "oracle_apgr": apgr(oracle),
        "oracle_strong_share": float(np.mean(st & ~w)),
        "curve": [{"strong_share": float(g), "quality": quality_at_share(curve, g)} for g in grid],
    }
