"""Retrain the difficulty model on a labelled set and keep the better of new and current.

Holds out a stratified share (default 30%) of the set, trains a new model on the rest with the same
training code as `router train`, and compares new and current model on the held-out rows by APGR
(CPT(50%) shown alongside). Too few rows, a single class, or a held-out part on which the strong
backend is not better are DataErrors. The new model keeps the current model's default_threshold; a
`threshold:` in the policy still takes precedence (recalibrate with `router calibrate` if the table
shows the share sent to `hard` moved).

The labelled set comes from whoever calls: `switchyard router retrain --from-ledger` reads it from the
gateway's shadow evaluations (gateway/shadow_labels.py); this module knows nothing of the ledger.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy and the router load lazily, so `switchyard --help` stays fast
    from router.dataset import LabelledSet

DEFAULT_MIN_ROWS = 50


@dataclass(slots=True)
class RetrainOutcome:
    rows: int
    train_rows: int
    holdout_rows: int
    current: dict  # router.metrics.evaluate() on the held-out rows
    new: dict
    current_version: str
    new_version: str | None  # set once written
    activated: bool
    written_to: Path | None


def split(ds: LabelledSet, holdout: float, seed: int) -> tuple:
    """(train, held-out) row index arrays, stratified by the training label (strong right and weak wrong)."""
    import numpy as np
    from sklearn.model_selection import train_test_split

    from router.dataset import DataError

    y = ds.strong & ~ds.weak
    idx = np.arange(len(ds))
    try:
        train, test = train_test_split(idx, test_size=holdout, random_state=seed, stratify=y)
    except ValueError as e:  # a class with a single row cannot be split
        raise DataError(f"{ds.source}: cannot hold out a stratified {holdout:.0%} ({e}); collect more labels") from e
    return np.sort(train), np.sort(test)


def retrain(ds: LabelledSet, current, *, holdout: float = 0.3, seed: int = 0, min_rows: int = DEFAULT_MIN_ROWS,
            min_gain: float = 0.0):
    """(outcome without file fields, the new model). Raises DataError / MetricError on unusable data."""
    _check_rows(ds, min_rows)
    train_idx, test_idx = split(ds, holdout, seed)
    new = _fit(ds, train_idx)
    # The new model keeps the current default threshold (a probability: "more likely than not needed"
    # at 0.5); the table shows what share of the held-out rows each model sends to `hard` with it.
    new.default_threshold = current.default_threshold
    current_report, new_report = _compare(ds.subset(test_idx), current, new, ds.source)
    better = new_report["apgr"] > current_report["apgr"] + min_gain
    outcome = RetrainOutcome(rows=len(ds), train_rows=int(train_idx.size), holdout_rows=int(test_idx.size),
                             current=current_report, new=new_report, current_version=current.version,
                             new_version=None, activated=better, written_to=None)
    return outcome, new


def _check_rows(ds: LabelledSet, min_rows: int) -> None:
    """Enough rows, and at least two that need the strong backend and two that do not."""
    from router.dataset import DataError

    n = len(ds)
    need = ds.strong & ~ds.weak
    if n < min_rows:
        raise DataError(f"{ds.source}: {n} labelled rows, fewer than --min-rows {min_rows}; let shadow "
                        f"evaluation collect more (or lower --min-rows)")
    if need.sum() < 2 or (~need).sum() < 2:
        raise DataError(f"{ds.source}: {int(need.sum())} of {n} rows need the strong backend; training needs at "
                        f"least 2 of each kind")


def _fit(ds: LabelledSet, train_idx):
    """A new model trained on the training rows with `router train`'s default configuration."""
    from router.dataset import DataError
    from router.train import TrainConfig, fit

    tr = ds.subset(train_idx)
    try:
        return fit(tr.requests, tr.weak, tr.strong, TrainConfig(),
                   meta={"trained_from": ds.source, "retrained_rows": int(train_idx.size)})
    except ValueError as e:
        raise DataError(f"{ds.source}: {e}") from e


def _compare(te: LabelledSet, current, new, source: str) -> tuple[dict, dict]:
    """Both models' reports on the held-out rows, with the share each sends to `hard` at the threshold."""
    import numpy as np

    from router.dataset import DataError
    from router.metrics import MetricError, evaluate

    try:
        current_report = evaluate(current.score_many(te.requests), te.weak, te.strong)
        new_report = evaluate(new.score_many(te.requests), te.weak, te.strong)
    except MetricError as e:
        raise DataError(f"{source}: the held-out rows cannot be evaluated: {e}") from e
    threshold = current.default_threshold if current.default_threshold is not None else 0.5
    for report, model in ((current_report, current), (new_report, new)):
        report["threshold"] = threshold
        report["strong_share"] = float(np.mean(model.score_many(te.requests) >= threshold))
        report["quality"] = float(np.mean(np.where(model.score_many(te.requests) >= threshold, te.strong, te.weak)))
    return current_report, new_report


def table(o: RetrainOutcome, new_version: str) -> str:
    """The current and new model side by side on the held-out rows."""
    t = o.current["threshold"]
    lines = [f"{'model':<9} {'version':<17} {'APGR':>7} {'CPT(50%)':>9} {f'hard share @{t:g}':>16} {'quality':>8}"]
    for name, version, r in (("current", o.current_version, o.current), ("new", new_version, o.new)):
        lines.append(f"{name:<9} {version:<17} {r['apgr']:>7.4f} {r['cpt50']:>9.1%} {r['strong_share']:>16.1%} "
                     f"{r['quality']:>8.3f}")
    return "\n".join(lines)
