"""Router quality benchmark: APGR / CPT of the difficulty model against baselines.

1. MMLU (../shared/data/routing/mmlu_pairs.csv, not shipped): k-fold cross-validation (default 5)
   and one 70/30 split, for baselines (random, prompt length, per-subject prior, TF-IDF + LR)
   and the project's model (default: the two-head `gain` rule) with feature-set, label-rule and C
   ablations (the single-head ablations use `strong_only`).
2. The project's seed set (router/data/): other task families, repeated 5-fold CV; APGR per
   family of the model's out-of-fold scores against the prompt-length heuristic.

Prints tables, files bench/results/router_quality/<machine>.json and a PNG of the 70/30 curves.
    .venv/bin/python -m bench.router_quality [--data FILE] [--folds 5] [--quick]
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench import store
from router.dataset import LabelledSet, load_labelled
from router.features import FeatureConfig
from router.metrics import evaluate, routing_curve
from router.train import (
    DenseScaler,
    Featurized,
    TrainConfig,
    design_matrix,
    featurize,
    fit_featurized,
    fit_logistic,
    inverse_document_frequency,
    labels,
    seed_files,
)

ROOT = Path(__file__).resolve().parent.parent

Scorer = Callable[[np.ndarray, np.ndarray], np.ndarray]  # (train rows, test rows) -> test scores


def prompt_text(r: object) -> str:
    if isinstance(r, str):
        return r
    return "\n".join(str(m.get("content") or "") for m in r if isinstance(m, dict))


class Methods:
    """Every router under test, as train/test scorers over one data set featurised once."""

    def __init__(self, ds: LabelledSet, seed: int) -> None:
        self.ds = ds
        self.seed = seed
        self.texts = [prompt_text(r) for r in ds.requests]
        self.cfg = FeatureConfig()
        t = time.perf_counter()
        self.f = featurize(ds.requests, self.cfg)
        self.featurize_s = time.perf_counter() - t

    def sub(self, rows: np.ndarray, blocks: tuple[int, ...], dense: bool) -> Featurized:
        return Featurized([[self.f.blocks[i][b] for b in blocks] for i in rows],
                          self.f.dense[rows] if dense else np.zeros((rows.size, 0)))

    # -- baselines
    def random(self, tr: np.ndarray, te: np.ndarray) -> np.ndarray:
        return np.random.default_rng(self.seed + int(te[0])).random(te.size)

    def prompt_length(self, tr: np.ndarray, te: np.ndarray) -> np.ndarray:
        return np.array([len(self.texts[i]) for i in te], dtype=float)

    def family_prior(self, tr: np.ndarray, te: np.ndarray) -> np.ndarray:
        y, _ = labels(self.ds.weak, self.ds.strong, "strong_only")
        fam = np.array(self.ds.family)
        prior = {f: y[tr][fam[tr] == f].mean() for f in set(fam[tr])}
        return np.array([prior.get(f, y[tr].mean()) for f in fam[te]])

    def tfidf_lr(self, tr: np.ndarray, te: np.ndarray) -> np.ndarray:
        from sklearn.feature_extraction.text import TfidfVectorizer
        from sklearn.linear_model import LogisticRegression

        y, _ = labels(self.ds.weak, self.ds.strong, "strong_only")
        v = TfidfVectorizer()
        x = v.fit_transform([self.texts[i] for i in tr])
        clf = LogisticRegression(max_iter=1000).fit(x, y[tr])
        return clf.decision_function(v.transform([self.texts[i] for i in te]))

    # -- ours, ablations at the matrix level (same features and weighting as the product)
    def ablation(self, blocks: tuple[int, ...], dense: bool, label: str = "strong_only", C: float = 1.0) -> Scorer:
        def run(tr: np.ndarray, te: np.ndarray) -> np.ndarray:
            y, keep = labels(self.ds.weak, self.ds.strong, label)
            rows = tr[keep[tr]]
            ftr, fte = self.sub(rows, blocks, dense), self.sub(te, blocks, dense)
            idf = inverse_document_frequency(ftr.blocks, self.cfg.n_bits)
            sc = DenseScaler.fit(ftr.dense)
            w, b = fit_logistic(design_matrix(ftr, self.cfg, idf, sc), y[rows], C)
            return design_matrix(fte, self.cfg, idf, sc) @ w + b

        return run

    def product(self, tr: np.ndarray, te: np.ndarray, tc: TrainConfig | None = None) -> np.ndarray:
        """The shipped path end to end: fit_featurized, then DifficultyModel.score per request."""
        model = fit_featurized(Featurized([self.f.blocks[i] for i in tr], self.f.dense[tr]),
                               self.ds.weak[tr], self.ds.strong[tr], tc or TrainConfig())
        return model.score_many([self.ds.requests[i] for i in te])


def mmlu_methods(m: Methods, quick: bool) -> dict[str, Scorer]:
    out: dict[str, Scorer] = {
        "random": m.random,
        "prompt length": m.prompt_length,
        "per-subject prior": m.family_prior,
        "TF-IDF + LR": m.tfidf_lr,
        "ours (default: words+chars+dense)": m.product,
        "ours: label strong_only, C=1 (previous default)":
            lambda tr, te: m.product(tr, te, TrainConfig(label="strong_only", C=1.0)),
    }
    if not quick:
        out.update({
            "ours: dense only": m.ablation((), True),
            "ours: words 1-2": m.ablation((0,), False),
            "ours: chars 3-5": m.ablation((1,), False),
            "ours: words+chars": m.ablation((0, 1, 2), False),
            "ours: label weak_wrong": m.ablation((0, 1, 2), True, "weak_wrong"),
            "ours: label skip_both_wrong": m.ablation((0, 1, 2), True, "skip_both_wrong"),
            "ours: gain, C=0.1": lambda tr, te: m.product(tr, te, TrainConfig(C=0.1)),
            "ours: gain, C=1": lambda tr, te: m.product(tr, te, TrainConfig(C=1.0)),
        })
    return out


def folds(n: int, k: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    perm = np.random.default_rng(seed).permutation(n)
    parts = np.array_split(perm, k)
    return [(np.concatenate(parts[:i] + parts[i + 1:]), parts[i]) for i in range(k)]


def summarise(runs: list[dict]) -> dict:
    keys = ("apgr", "cpt20", "cpt50", "cpt80")
    return {k: {"mean": float(np.mean([r[k] for r in runs])), "std": float(np.std([r[k] for r in runs]))}
            for k in keys}


def run_mmlu(ds: LabelledSet, k: int, seed: int, quick: bool, plot: Path | None) -> dict:
    m = Methods(ds, seed)
    print(f"MMLU: {len(ds)} rows, featurised in {m.featurize_s:.1f}s; {k}-fold CV and a 70/30 split", flush=True)
    methods = mmlu_methods(m, quick)
    result: dict = {"n": len(ds), "folds": k, "kfold": {}, "split_70_30": {}}
    for name, fn in methods.items():
        t = time.perf_counter()
        runs = [evaluate(fn(tr, te), ds.weak[te], ds.strong[te]) for tr, te in folds(len(ds), k, seed)]
        s = summarise(runs)
        result["kfold"][name] = s | {"per_fold_apgr": [r["apgr"] for r in runs]}
        print(f"  {name:<36} APGR {s['apgr']['mean']:.4f} ± {s['apgr']['std']:.4f}   "
              f"CPT50 {s['cpt50']['mean']:.3f}   ({time.perf_counter() - t:.0f}s)", flush=True)
    perm = np.random.default_rng(seed).permutation(len(ds))
    cut = int(0.7 * len(ds))
    tr, te = perm[:cut], perm[cut:]
    curves = {}
    for name in ("prompt length", "per-subject prior", "TF-IDF + LR", "ours (default: words+chars+dense)"):
        scores = methods[name](tr, te)
        r = evaluate(scores, ds.weak[te], ds.strong[te])
        result["split_70_30"][name] = {k2: r[k2] for k2 in ("apgr", "cpt20", "cpt50", "cpt80", "n")}
        curves[name] = routing_curve(scores, ds.weak[te], ds.strong[te])
    if plot:
        from router.plot import plot_curves

        plot_curves(plot, curves, ds.weak[te], ds.strong[te], title=f"MMLU, 70/30 split ({te.size} held out)")
    return result


def run_families(ds: LabelledSet, seed: int, repeats: int) -> dict:
    """Per task family, APGR of out-of-fold scores (repeated 5-fold CV): prompt length; ours trained on
    every family's training rows (pooled); ours trained on the family's own rows only."""
    m = Methods(ds, seed)
    fam = np.array(ds.family)
    names = sorted(set(ds.family))
    pooled = {"prompt length": m.prompt_length, "ours, pooled": m.product}
    columns = [*pooled, "ours, own labels"]
    per: dict[str, dict[str, list[float]]] = {n: {f: [] for f in names + ["all"]} for n in columns}

    def apgr(scores: np.ndarray, rows: np.ndarray) -> float | None:
        w, s = ds.weak[rows], ds.strong[rows]
        return evaluate(scores, w, s)["apgr"] if s.mean() - w.mean() > 0 else None

    for r in range(repeats):
        for name, fn in pooled.items():
            scores = np.zeros(len(ds))
            for tr, te in folds(len(ds), 5, seed + r):
                scores[te] = fn(tr, te)
            for f in names + ["all"]:
                rows = np.flatnonzero(fam == f) if f != "all" else np.arange(len(ds))
                if (v := apgr(scores[rows], rows)) is not None:
                    per[name][f].append(v)
        for f in names:
            rows = np.flatnonzero(fam == f)
            scores = np.zeros(rows.size)
            for tr, te in folds(rows.size, 5, seed + r):
                scores[te] = m.product(rows[tr], rows[te])
            if (v := apgr(scores, rows)) is not None:
                per["ours, own labels"][f].append(v)
    out: dict = {"n": len(ds), "repeats": repeats, "families": {}}
    print(f"\nSeed set: {len(ds)} rows, {len(names)} families, {repeats}x repeated 5-fold CV (APGR of out-of-fold "
          f"scores; 'own' = trained on the family's rows only)")
    print(f"  {'family':<15}{'n':>4}{'weak':>6}{'strong':>7}{'length':>8}{'pooled':>8}{'own':>8}")
    fmt = (lambda v: f"{v:.3f}" if v is not None else "n/a")
    for f in names + ["all"]:
        rows = np.flatnonzero(fam == f) if f != "all" else np.arange(len(ds))
        vals = {n: (float(np.mean(per[n][f])) if per[n][f] else None) for n in columns}
        out["families"][f] = {"n": int(rows.size), "weak_accuracy": float(ds.weak[rows].mean()),
                              "strong_accuracy": float(ds.strong[rows].mean()),
                              "apgr_prompt_length": vals["prompt length"], "apgr_ours": vals["ours, pooled"],
                              "apgr_ours_own_labels": vals["ours, own labels"]}
        print(f"  {f:<15}{rows.size:>4}{ds.weak[rows].mean():>6.2f}{ds.strong[rows].mean():>7.2f}"
              + "".join(f"{fmt(vals[n]):>8}" for n in columns), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "routing" / "mmlu_pairs.csv"))
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=5, help="repeats of the seed-set CV")
    ap.add_argument("--quick", action="store_true", help="baselines and the default model only")
    ap.add_argument("--skip-mmlu", action="store_true")
    ap.add_argument("--out", default=None, help="write this JSON file instead of filing the run in "
                                                "bench/results/router_quality/<machine>.json")
    ap.add_argument("--plot", default=None, help="the PNG of the curves (default: beside the results)")
    ap.add_argument("--label", default="", help="a name for this run in the results history")
    args = ap.parse_args()
    if args.plot is None:
        args.plot = str(Path(args.out).with_suffix(".png") if args.out else store.artifact("router_quality", ".png"))
    result: dict = {"benchmark": "router_quality"}
    if not args.skip_mmlu:
        if not Path(args.data).is_file():
            print(f"error: {args.data} not found (pass --data)", file=sys.stderr)
            return 2
        result["mmlu"] = run_mmlu(load_labelled(args.data), args.folds, args.seed, args.quick, Path(args.plot))
    seeds = [load_labelled(p) for p in seed_files()]
    if seeds:
        merged = LabelledSet([r for s in seeds for r in s.requests], np.concatenate([s.weak for s in seeds]),
                             np.concatenate([s.strong for s in seeds]), [f for s in seeds for f in s.family],
                             "router/data")
        result["seed_set"] = run_families(merged, args.seed, args.repeats)
    out = store.save("router_quality", result, label=args.label or ("quick" if args.quick else ""), out=args.out)
    print(f"\nwrote {out}" + (f" and {args.plot}" if not args.skip_mmlu else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
