"""`switchyard router retrain --from-ledger`: train on the gateway's shadow evaluations, keep the better model.

Reads the `shadow_evals` table (rows the gateway labelled by mirroring requests; gateway/shadow.py), holds
out a stratified share (default 30%) of it, trains a new difficulty model on the rest with the same
training code as `router train`, and compares new and current model on the held-out rows by APGR (CPT(50%)
shown alongside). Only a strictly better new model (by more than --min-gain APGR) is written: atomically
over the current model file (the file the policy's `model_path` names, so a running gateway reloads it), or
to --out. Otherwise nothing is written. Too few rows, a single class, or a held-out part on which the strong
backend is not better are user errors: one `error:` line, exit 2, nothing written.

The one network access of router/: the ledger database the operator names (the gateway's default URL
otherwise). The new model keeps the current model's default_threshold; a `threshold:` in the policy still
takes precedence (recalibrate with `router calibrate` if the table shows the share sent to `hard` moved).
"""
from __future__ import annotations

import argparse
import json
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


def load_shadow_set(database_url: str, route: str | None = None) -> LabelledSet:
    """shadow_evals rows (optionally one route's) as a LabelledSet; chat rows keep their messages."""
    import numpy as np
    import sqlalchemy as sa

    from gateway import db
    from gateway.ledger.models import ShadowEvalRow
    from router.dataset import DataError, LabelledSet

    t = ShadowEvalRow.__table__
    query = sa.select(t.c.prompt_text, t.c.messages_json, t.c.weak_correct, t.c.strong_correct, t.c.route)
    if route is not None:
        query = query.where(t.c.route == route)
    engine = sa.create_engine(db.sync_url(database_url))
    try:
        with engine.connect() as conn:
            if not sa.inspect(conn).has_table("shadow_evals"):
                raise DataError(f"{db._redact(database_url)}: no shadow_evals table; run `switchyard db upgrade` "
                                f"and let a route with `shadow:` collect labels")
            rows = conn.execute(query.order_by(t.c.id)).all()
    except sa.exc.OperationalError as e:
        raise DataError(f"{db._redact(database_url)}: cannot read the ledger ({e.orig or e})") from e
    finally:
        engine.dispose()
    requests = [json.loads(r.messages_json) if r.messages_json else r.prompt_text for r in rows]
    return LabelledSet(requests, np.array([bool(r.weak_correct) for r in rows], dtype=bool),
                       np.array([bool(r.strong_correct) for r in rows], dtype=bool),
                       [r.route for r in rows], f"shadow_evals{f' (route {route})' if route else ''}")


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
    import numpy as np

    from router.dataset import DataError
    from router.metrics import MetricError, evaluate
    from router.train import TrainConfig, fit

    n = len(ds)
    need = ds.strong & ~ds.weak
    if n < min_rows:
        raise DataError(f"{ds.source}: {n} labelled rows, fewer than --min-rows {min_rows}; let shadow "
                        f"evaluation collect more (or lower --min-rows)")
    if need.sum() < 2 or (~need).sum() < 2:
        raise DataError(f"{ds.source}: {int(need.sum())} of {n} rows need the strong backend; training needs at "
                        f"least 2 of each kind")
    train_idx, test_idx = split(ds, holdout, seed)
    tr, te = ds.subset(train_idx), ds.subset(test_idx)
    try:
        new = fit(tr.requests, tr.weak, tr.strong, TrainConfig(),
                  meta={"trained_from": ds.source, "retrained_rows": int(train_idx.size)})
    except ValueError as e:
        raise DataError(f"{ds.source}: {e}") from e
    try:
        current_report = evaluate(current.score_many(te.requests), te.weak, te.strong)
        new_report = evaluate(new.score_many(te.requests), te.weak, te.strong)
    except MetricError as e:
        raise DataError(f"{ds.source}: the held-out rows cannot be evaluated: {e}") from e
    # The new model keeps the current default threshold (a probability: "more likely than not needed"
    # at 0.5); the table shows what share of the held-out rows each model sends to `hard` with it.
    threshold = current.default_threshold if current.default_threshold is not None else 0.5
    new.default_threshold = current.default_threshold
    for report, model in ((current_report, current), (new_report, new)):
        report["threshold"] = threshold
        report["strong_share"] = float(np.mean(model.score_many(te.requests) >= threshold))
        report["quality"] = float(np.mean(np.where(model.score_many(te.requests) >= threshold, te.strong, te.weak)))
    better = new_report["apgr"] > current_report["apgr"] + min_gain
    outcome = RetrainOutcome(rows=n, train_rows=int(train_idx.size), holdout_rows=int(test_idx.size),
                             current=current_report, new=new_report, current_version=current.version,
                             new_version=None, activated=better, written_to=None)
    return outcome, new


def _table(o: RetrainOutcome, new_version: str) -> str:
    t = o.current["threshold"]
    lines = [f"{'model':<9} {'version':<17} {'APGR':>7} {'CPT(50%)':>9} {f'hard share @{t:g}':>16} {'quality':>8}"]
    for name, version, r in (("current", o.current_version, o.current), ("new", new_version, o.new)):
        lines.append(f"{name:<9} {version:<17} {r['apgr']:>7.4f} {r['cpt50']:>9.1%} {r['strong_share']:>16.1%} "
                     f"{r['quality']:>8.3f}")
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    from gateway import settings
    from router.dataset import DataError
    from router.model import DifficultyModel, default_model_path, load_default_model

    if not args.from_ledger:
        raise DataError("retrain reads the gateway's shadow evaluations: pass --from-ledger")
    if not 0.05 <= args.holdout <= 0.5:
        raise DataError(f"--holdout must be between 0.05 and 0.5, got {args.holdout}")
    url = settings.database_url(args.database_url)
    ds = load_shadow_set(url, args.route)
    current_path = Path(args.model) if args.model else default_model_path()
    current = DifficultyModel.load(current_path) if args.model else load_default_model()
    outcome, new = retrain(ds, current, holdout=args.holdout, seed=args.seed, min_rows=args.min_rows,
                           min_gain=args.min_gain)
    print(f"{ds.source}: {outcome.rows} labelled rows; trained on {outcome.train_rows}, "
          f"compared on {outcome.holdout_rows} held out (stratified, seed {args.seed})")
    print(f"comparing with the model in {current_path}")
    if not outcome.activated:
        print(_table(outcome, "(unsaved)"))
        print(f"kept the current model: the new one is not better on the held-out rows (APGR "
              f"{outcome.new['apgr']:.4f} vs {outcome.current['apgr']:.4f}, needed > +{args.min_gain:g}); "
              f"nothing was written")
        return 0
    target = Path(args.out) if args.out else current_path
    version = new.save(target)  # temp file + rename: a gateway watching the file sees old or new, never half
    outcome.new_version, outcome.written_to = version, target
    print(_table(outcome, version))
    what = "replacing the current model (a running gateway reloads it)" if target == current_path else "(--out)"
    print(f"activated: the new model is better (APGR +{outcome.new['apgr'] - outcome.current['apgr']:.4f}); "
          f"wrote {target} {what}")
    return 0


def register(rsub: argparse._SubParsersAction, guard) -> None:
    r = rsub.add_parser("retrain", help="retrain on the gateway's shadow evaluations; keep the better model",
                        description="Train a new difficulty model on the shadow_evals table, compare it with the "
                                    "current one on a stratified held-out part (APGR, CPT(50%)), and replace "
                                    "the current model file (or write --out) only if the new one is better.")
    r.add_argument("--from-ledger", action="store_true", help="read labels from the ledger's shadow_evals table")
    r.add_argument("--database-url", default=None,
                   help="ledger database (default: $SWITCHYARD_DATABASE_URL, else sqlite:///data/switchyard.db)")
    r.add_argument("--route", default=None, help="only this route's rows (default: all)")
    r.add_argument("--model", default=None, metavar="CURRENT",
                   help="the current model file, replaced if the new model is better (default: the default model)")
    r.add_argument("--out", default=None, metavar="PATH", help="write the better model here instead")
    r.add_argument("--min-rows", type=int, default=DEFAULT_MIN_ROWS,
                   help=f"refuse with fewer labelled rows (default {DEFAULT_MIN_ROWS})")
    r.add_argument("--holdout", type=float, default=0.3, help="share held out for the comparison (default 0.3)")
    r.add_argument("--min-gain", type=float, default=0.0, help="APGR the new model must gain to replace (default 0)")
    r.add_argument("--seed", type=int, default=0, help="seed of the held-out split (default 0)")
    r.set_defaults(func=guard(_run))
