"""`switchyard router …` subcommands: train, eval, calibrate (and the steps of retrain).

Handlers import numpy/sklearn lazily so `switchyard --help` stays fast. Every user error
(bad data, bad model file, impossible target, policy that cannot be edited) prints one
`error: …` line naming the file and the fix, exits with status 2, and writes nothing.

The router knows nothing of the gateway: what needs it comes in from the `switchyard` command
(gateway/cli.py). `register` takes the function that writes a threshold into a policy file
(`calibrate --write`) and returns the `router` group's subparsers, to which the gateway adds
`retrain`; that subcommand loads its labelled set from the ledger and hands it to `retrain_from`.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from router.defaults import DEFAULT_C, DEFAULT_LABEL_RULE, LABEL_RULES

if TYPE_CHECKING:
    from router.dataset import LabelledSet

# (policy file, route, threshold, model path) -> the new policy text; raises CalibrationError
PolicyWriter = Callable[[str, str, float, str], str]


def _data_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, help="labelled rows: CSV or JSONL")
    p.add_argument("--prompt-col", default="prompt", help="column with the prompt text (default: prompt; "
                   "rows may instead carry an OpenAI `messages` list)")
    p.add_argument("--weak-col", default="weak_correct", help="column: did the weak model answer correctly")
    p.add_argument("--strong-col", default="strong_correct", help="column: did the strong model answer correctly")


def _load_data(args: argparse.Namespace):
    from router.dataset import load_labelled

    return load_labelled(args.data, args.prompt_col, args.weak_col, args.strong_col)


def _user_errors() -> tuple[type[BaseException], ...]:
    from router.calibrate import CalibrationError
    from router.dataset import DataError
    from router.metrics import MetricError
    from router.model import ModelFileError

    return DataError, ModelFileError, MetricError, CalibrationError


def guard(handler):
    """Wrap a handler: a user error is one `error:` line and exit 2; Ctrl-C writes nothing and exits 130."""
    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except _user_errors() as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("interrupted; nothing was written", file=sys.stderr)
            return 130

    return run


# ---- train ---------------------------------------------------------------------------------

def _train(args: argparse.Namespace) -> int:
    import time

    from router.train import TrainConfig, featurize, fit_featurized

    ds = _load_data(args)
    tc = TrainConfig(label=args.label_rule, C=args.C)
    print(f"read {len(ds)} rows from {args.data} (weak accuracy {ds.weak.mean():.3f}, "
          f"strong accuracy {ds.strong.mean():.3f})", flush=True)
    t0 = time.perf_counter()
    f = featurize(ds.requests, tc.features, progress=not args.quiet)
    print(f"features: {time.perf_counter() - t0:.1f}s; fitting logistic regression "
          f"(label rule {tc.label}, C={tc.C:g})…", flush=True)
    t1 = time.perf_counter()
    try:
        model = fit_featurized(f, ds.weak, ds.strong, tc, meta={"trained_from": str(args.data)})
    except ValueError as e:  # e.g. a single class under the label rule
        from router.dataset import DataError

        raise DataError(f"{args.data}: {e}") from e
    version = model.save(args.out)
    print(f"fitted in {time.perf_counter() - t1:.1f}s; wrote {args.out} (version {version})")
    return 0


# ---- eval ----------------------------------------------------------------------------------

def _eval(args: argparse.Namespace) -> int:
    import json

    from router.metrics import evaluate, routing_curve
    from router.model import DifficultyModel

    model = DifficultyModel.load(args.model)
    ds = _load_data(args)
    scores = model.score_many(ds.requests)
    report = evaluate(scores, ds.weak, ds.strong)
    report["model"] = str(args.model)
    report["model_version"] = model.version
    report["data"] = str(args.data)
    if args.plot:
        from router.plot import plot_curves

        plot_curves(args.plot, {"difficulty model": routing_curve(scores, ds.weak, ds.strong)}, ds.weak,
                    ds.strong, title=f"Router quality on {len(ds)} rows")
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"rows: {report['n']}   weak accuracy {report['weak_accuracy']:.3f}   "
          f"strong accuracy {report['strong_accuracy']:.3f}")
    print(f"APGR {report['apgr']:.4f}   (random 0.5000, oracle {report['oracle_apgr']:.4f})")
    print(f"CPT(20%) {report['cpt20']:.1%}   CPT(50%) {report['cpt50']:.1%}   CPT(80%) {report['cpt80']:.1%}")
    print("strong share   quality")
    for pt in report["curve"][::2]:
        print(f"  {pt['strong_share']:>9.0%}   {pt['quality']:.3f}")
    if args.plot:
        print(f"plot: {args.plot}")
    return 0


# ---- calibrate -----------------------------------------------------------------------------

def _calibrate(args: argparse.Namespace, write_policy: PolicyWriter | None = None) -> int:
    from router import calibrate as cal
    from router.metrics import quality_at_share, routing_curve
    from router.model import DifficultyModel

    if args.write and not args.route:
        raise cal.CalibrationError("--write needs --route NAME (the route in the policy to update)")
    if args.write and write_policy is None:
        raise cal.CalibrationError("--write needs the gateway's policy editor; run it as `switchyard router calibrate`")
    if args.max_usd_per_1k_requests is not None and args.strong_usd_per_request is None:
        raise cal.CalibrationError("--max-usd-per-1k-requests needs --strong-usd-per-request "
                                   "(and --weak-usd-per-request if the weak backend is not free)")
    model = DifficultyModel.load(args.model)
    ds = _load_data(args)
    scores = model.score_many(ds.requests)
    if args.target_strong_share is not None:
        c = cal.for_strong_share(scores, args.target_strong_share)
    else:
        c = cal.for_budget(scores, args.max_usd_per_1k_requests, args.weak_usd_per_request,
                           args.strong_usd_per_request)
    curve = routing_curve(scores, ds.weak, ds.strong)
    quality = quality_at_share(curve, c.strong_share)
    print(f"# target: {c.target}")
    print(f"# on {len(ds)} rows: {c.strong_share:.1%} strong calls, quality {quality:.3f} "
          f"(always weak {curve.weak_quality:.3f}, always strong {curve.strong_quality:.3f})")
    if args.strong_usd_per_request is not None:
        usd = 1000 * (args.weak_usd_per_request + c.strong_share
                      * (args.strong_usd_per_request - args.weak_usd_per_request))
        print(f"# expected cost: {usd:.4g} USD per 1k requests")
    print(cal.policy_snippet(c.threshold, str(args.model)), end="")
    if args.write:
        write_policy(args.write, args.route, c.threshold, str(args.model))
        print(f"# wrote threshold and model_path into routes.{args.route} of {args.write}")
    if args.store_in_model:
        model.default_threshold = c.threshold
        version = model.save(args.model)
        print(f"# stored default_threshold in {args.model} (new version {version})")
    return 0


# ---- retrain -------------------------------------------------------------------------------

def retrain_from(args: argparse.Namespace, load_set: Callable[[], LabelledSet]) -> int:
    """`router retrain` once its labelled set can be loaded: train on part of it, compare with the current
    model on the rest, print the table, and write the new model only if it is better."""
    from pathlib import Path

    from router.dataset import DataError
    from router.model import DifficultyModel
    from router.retrain import retrain, table
    from router.train import default_model_path, load_default_model

    if not 0.05 <= args.holdout <= 0.5:
        raise DataError(f"--holdout must be between 0.05 and 0.5, got {args.holdout}")
    ds = load_set()
    current_path = Path(args.model) if args.model else default_model_path()
    current = DifficultyModel.load(current_path) if args.model else load_default_model()
    outcome, new = retrain(ds, current, holdout=args.holdout, seed=args.seed, min_rows=args.min_rows,
                           min_gain=args.min_gain)
    print(f"{ds.source}: {outcome.rows} labelled rows; trained on {outcome.train_rows}, "
          f"compared on {outcome.holdout_rows} held out (stratified, seed {args.seed})")
    print(f"comparing with the model in {current_path}")
    if not outcome.activated:
        print(table(outcome, "(unsaved)"))
        print(f"kept the current model: the new one is not better on the held-out rows (APGR "
              f"{outcome.new['apgr']:.4f} vs {outcome.current['apgr']:.4f}, needed > +{args.min_gain:g}); "
              f"nothing was written")
        return 0
    target = Path(args.out) if args.out else current_path
    version = new.save(target)  # temp file + rename: a gateway watching the file sees old or new, never half
    outcome.new_version, outcome.written_to = version, target
    print(table(outcome, version))
    what = "replacing the current model (a running gateway reloads it)" if target == current_path else "(--out)"
    print(f"activated: the new model is better (APGR +{outcome.new['apgr'] - outcome.current['apgr']:.4f}); "
          f"wrote {target} {what}")
    return 0


# ---- the `router` group --------------------------------------------------------------------

def register(sub: argparse._SubParsersAction, policy_writer: PolicyWriter | None = None) -> argparse._SubParsersAction:
    """Add `router train|eval|calibrate`; `policy_writer` backs `calibrate --write`. Returns the group's
    subparsers, for the caller to add commands that need more than the router (`retrain --from-ledger`)."""
    p = sub.add_parser("router", help="the difficulty router", description="Train, evaluate and calibrate the router.")
    rsub = p.add_subparsers(dest="router_command", required=True)
    _add_train(rsub)
    _add_eval(rsub)
    _add_calibrate(rsub, policy_writer)
    return rsub


def _add_train(rsub: argparse._SubParsersAction) -> None:
    t = rsub.add_parser("train", help="train a difficulty model from labelled rows",
                        description="Train a difficulty model: P(the strong backend is needed) for a request, "
                                    "from rows saying whether a weak and a strong model answered correctly.")
    _data_args(t)
    t.add_argument("--out", required=True, help="model file to write (replaced atomically)")
    t.add_argument("--label-rule", default=DEFAULT_LABEL_RULE, choices=list(LABEL_RULES),
                   help="what the model learns (default: gain = P(strong right) and P(weak right), scored by "
                        "their difference; strong_only = strong right and weak wrong; see docs/router.md)")
    t.add_argument("--C", type=float, default=DEFAULT_C,
                   help=f"inverse regularisation strength (default {DEFAULT_C})")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.set_defaults(func=guard(_train))


def _model_and_data_parser(rsub: argparse._SubParsersAction, name: str, help: str,
                           description: str) -> argparse.ArgumentParser:
    """A subcommand that scores labelled rows with a trained model: --model, then the data flags."""
    p = rsub.add_parser(name, help=help, description=description)
    p.add_argument("--model", required=True, help="model file from `router train`")
    _data_args(p)
    return p


def _add_eval(rsub: argparse._SubParsersAction) -> None:
    e = _model_and_data_parser(rsub, "eval", help="APGR / CPT of a model on labelled rows",
                               description="Sweep the threshold from 0%% to 100%% strong calls; report APGR, "
                                           "CPT(20/50/80%%) and the quality curve.")
    e.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    e.add_argument("--plot", default=None, metavar="FILE.png", help="draw quality vs strong-call share")
    e.set_defaults(func=guard(_eval))


def _add_calibrate(rsub: argparse._SubParsersAction, policy_writer: PolicyWriter | None) -> None:
    c = _model_and_data_parser(rsub, "calibrate", help="pick a threshold for a strong-call share or a budget",
                               description="Pick the routing threshold on labelled rows and print the policy "
                                           "snippet (or write it into a policy route).")
    target = c.add_mutually_exclusive_group(required=True)
    target.add_argument("--target-strong-share", type=float, default=None,
                        help="share of requests to send to the strong backend, 0..1")
    target.add_argument("--max-usd-per-1k-requests", type=float, default=None,
                        help="cost ceiling; needs --strong-usd-per-request")
    c.add_argument("--weak-usd-per-request", type=float, default=0.0, help="average cost of a weak call (default 0)")
    c.add_argument("--strong-usd-per-request", type=float, default=None, help="average cost of a strong call")
    c.add_argument("--write", default=None, metavar="POLICY", help="policy YAML to update in place")
    c.add_argument("--route", default=None, help="route (a `strategy: difficulty` route) to update with --write")
    c.add_argument("--store-in-model", action="store_true",
                   help="also store the threshold in the model file as its default_threshold")
    c.set_defaults(func=guard(partial(_calibrate, write_policy=policy_writer)))
