"""Fit the difficulty model: features (router/features.py) → scikit-learn logistic regression.

Label rules (what "strong needed" means for a training row; see docs/router.md for the
measurements behind the default):
  gain             two heads, P(strong right) and P(weak right), each a logistic regression on all
                   rows; the score ranks by the expected gain P(strong) - P(weak), which is what
                   the quality-vs-cost curve rewards. Uses every label, including the rows the
                   weak model got right and the strong one wrong.
  strong_only      strong right and weak wrong → 1, everything else → 0
  weak_wrong       weak wrong → 1 (whether or not the strong model got it right)
  skip_both_wrong  like strong_only, but rows both models got wrong are left out of training:
                   they look hard yet routing them gains nothing, so they blur the signal
"""
from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from router.conversation import parse
from router.defaults import DEFAULT_C, DEFAULT_LABEL_RULE, LABEL_RULES
from router.features import DENSE_NAMES, FeatureConfig, dense_features, hashed_indices, weighted_block
from router.model import DifficultyModel, ModelFileError


@dataclass(frozen=True, slots=True)
class TrainConfig:
    features: FeatureConfig = field(default_factory=FeatureConfig)
    label: str = DEFAULT_LABEL_RULE
    C: float = DEFAULT_C            # inverse L2 strength of the logistic regression
    balanced: bool = False          # class_weight="balanced"
    # Log-length features enter the fit scaled by this factor (their L2 penalty is factor² weaker):
    # length predicts difficulty in most task families, and a few hundred rows cannot otherwise
    # learn it past the n-gram noise. On MMLU (9.8k rows) it changes nothing; see docs/router.md.
    length_scale: float = 10.0


def labels(weak: np.ndarray, strong: np.ndarray, rule: str) -> tuple[np.ndarray, np.ndarray]:
    """(y, keep): the 0/1 target and which rows train."""
    weak = np.asarray(weak, dtype=bool)
    strong = np.asarray(strong, dtype=bool)
    if rule in ("strong_only", "gain"):  # gain: the "strong needed" view, for checks and reports
        return strong & ~weak, np.ones(weak.size, dtype=bool)
    if rule == "weak_wrong":
        return ~weak, np.ones(weak.size, dtype=bool)
    if rule == "skip_both_wrong":
        return strong & ~weak, weak | strong
    raise ValueError(f"unknown label rule {rule!r}; choose one of {', '.join(LABEL_RULES)}")


@dataclass(slots=True)
class Featurized:
    blocks: list[list[np.ndarray]]   # per row: bucket occurrences per block
    dense: np.ndarray                # (n, N_DENSE) or (n, 0)


def featurize(requests: list, cfg: FeatureConfig, progress: bool = False) -> Featurized:
    it = requests
    if progress:
        from tqdm import tqdm

        it = tqdm(requests, desc="features", unit="row", leave=False)
    blocks = []
    dense = []
    for r in it:
        conv = parse(r)
        blocks.append(hashed_indices(conv, cfg))
        if cfg.dense:
            dense.append(dense_features(conv))
    d = np.vstack(dense) if dense else np.zeros((len(requests), 0))
    return Featurized(blocks, d)


def inverse_document_frequency(blocks: list[list[np.ndarray]], n_bits: int) -> np.ndarray:
    """Smoothed idf per bucket, as sklearn's TfidfTransformer: ln((1 + n) / (1 + df)) + 1."""
    n = len(blocks)
    uniq = [np.unique(np.concatenate(b)) if b else np.zeros(0, np.int64) for b in blocks]
    df = np.bincount(np.concatenate(uniq) if uniq else np.zeros(0, np.int64), minlength=1 << n_bits)
    return np.log((1.0 + n) / (1.0 + df)) + 1.0


def hashed_matrix(blocks: list[list[np.ndarray]], n_bits: int, idf: np.ndarray | None) -> sp.csr_matrix:
    indptr = [0]
    indices: list[np.ndarray] = []
    data: list[np.ndarray] = []
    for row in blocks:
        nnz = 0
        for blk in row:
            u, v = weighted_block(blk, idf)
            indices.append(u)
            data.append(v)
            nnz += u.size
        indptr.append(indptr[-1] + nnz)
    m = sp.csr_matrix((np.concatenate(data) if data else np.zeros(0),
                       np.concatenate(indices) if indices else np.zeros(0, np.int64), np.array(indptr)),
                      shape=(len(blocks), 1 << n_bits))
    m.sum_duplicates()
    return m


LENGTH_COLUMNS = (DENSE_NAMES.index("log_query_chars"), DENSE_NAMES.index("log_total_chars"))


@dataclass(slots=True)
class DenseScaler:
    mean: np.ndarray
    std: np.ndarray

    @classmethod
    def fit(cls, d: np.ndarray, length_scale: float = 1.0) -> DenseScaler:
        """Standardise; the log-length columns are then multiplied by length_scale (folded into std)."""
        if d.shape[1] == 0:
            return cls(np.zeros(0), np.ones(0))
        std = d.std(axis=0)
        std = np.where(std > 1e-9, std, 1.0)
        std[list(LENGTH_COLUMNS)] /= length_scale
        return cls(d.mean(axis=0), std)

    def transform(self, d: np.ndarray) -> np.ndarray:
        return (d - self.mean) / self.std


def design_matrix(f: Featurized, cfg: FeatureConfig, idf: np.ndarray | None, scaler: DenseScaler) -> sp.csr_matrix:
    h = hashed_matrix(f.blocks, cfg.n_bits, idf)
    if f.dense.shape[1] == 0:
        return h
    return sp.hstack([h, sp.csr_matrix(scaler.transform(f.dense))], format="csr")


def fit_logistic(x: sp.csr_matrix, y: np.ndarray, C: float = 1.0, balanced: bool = False) -> tuple[np.ndarray, float]:
    """L2 logistic regression (liblinear) → (weights over all columns, intercept)."""
    from sklearn.linear_model import LogisticRegression

    # Fit only the columns some training row uses (a few percent of the buckets on small sets):
    # the solver's cost grows with the column count; unused buckets get weight 0 either way.
    used = np.unique(x.indices)
    clf = LogisticRegression(C=C, solver="liblinear", class_weight="balanced" if balanced else None, max_iter=1000)
    clf.fit(x[:, used], y)
    w = np.zeros(x.shape[1])
    w[used] = clf.coef_.ravel()
    return w, float(clf.intercept_[0])


def _fit_head(x: sp.csr_matrix, y: np.ndarray, C: float, balanced: bool) -> tuple[np.ndarray, float]:
    """One logistic head; a head whose label never varies (say, the strong model is always right)
    is the constant log-odds of its smoothed rate, so the other head alone ranks the requests."""
    k, n = int(y.sum()), y.size
    if k in (0, n):
        return np.zeros(x.shape[1]), float(np.log((k + 0.5) / (n - k + 0.5)))
    return fit_logistic(x, y, C, balanced)


def _unfold_dense(w: np.ndarray, b: float, cfg: FeatureConfig, scaler: DenseScaler) -> tuple:
    """(hashed weights, dense weights on raw features, intercept): the standardisation folded in."""
    n_hash = 1 << cfg.n_bits
    w_dense = w[n_hash:] / scaler.std if cfg.dense else np.zeros(0)
    intercept = b - (float(w_dense @ scaler.mean) if cfg.dense else 0.0)
    return w[:n_hash].copy(), w_dense, intercept


def fit_featurized(f: Featurized, weak: np.ndarray, strong: np.ndarray, tc: TrainConfig,
                   meta: dict | None = None) -> DifficultyModel:
    cfg = tc.features
    y, keep = labels(weak, strong, tc.label)
    rows = np.flatnonzero(keep)
    if rows.size == 0 or y[rows].all() or not y[rows].any():
        raise ValueError(f"label rule {tc.label!r} gives a single class on this data "
                         f"({int(y[rows].sum())} of {rows.size} rows need the strong model); "
                         f"the model needs examples of both")
    sub = Featurized([f.blocks[i] for i in rows], f.dense[rows])
    idf = inverse_document_frequency(sub.blocks, cfg.n_bits) if cfg.use_idf else None
    scaler = DenseScaler.fit(sub.dense, tc.length_scale)
    x = design_matrix(sub, cfg, idf, scaler)
    weak_head = None
    if tc.label == "gain":
        coef, w_dense, intercept = _unfold_dense(*_fit_head(x, np.asarray(strong, bool)[rows], tc.C, tc.balanced),
                                                 cfg, scaler)
        weak_head = _unfold_dense(*_fit_head(x, np.asarray(weak, bool)[rows], tc.C, tc.balanced), cfg, scaler)
    else:
        coef, w_dense, intercept = _unfold_dense(*fit_logistic(x, y[rows], tc.C, tc.balanced), cfg, scaler)
    info = {"label_rule": tc.label, "C": tc.C, "balanced": tc.balanced, "length_scale": tc.length_scale,
            "train_rows": int(y.size),
            "train_rows_used": int(rows.size), "train_positive_share": float(y[rows].mean())}
    info.update(meta or {})
    return DifficultyModel(cfg, coef, idf, w_dense, intercept, meta=info, weak_head=weak_head)


def fit(requests: list, weak: np.ndarray, strong: np.ndarray, tc: TrainConfig | None = None,
        progress: bool = False, meta: dict | None = None) -> DifficultyModel:
    tc = tc or TrainConfig()
    return fit_featurized(featurize(requests, tc.features, progress), weak, strong, tc, meta)


def train_default_model(path: str | Path) -> DifficultyModel:
    """Train the default model from the project's seed set (router/data/*.jsonl) and save it."""
    from router.dataset import LabelledSet, load_labelled

    files = seed_files()
    if not files:
        raise FileNotFoundError("router/data/ has no *.jsonl seed files; the default model cannot be trained")
    parts: list[LabelledSet] = [load_labelled(p) for p in files]
    requests = [r for p in parts for r in p.requests]
    weak = np.concatenate([p.weak for p in parts])
    strong = np.concatenate([p.strong for p in parts])
    model = fit(requests, weak, strong, meta={"trained_from": "router/data seed set"})
    # "More likely than not" for a probability; calibrate on your own traffic for a cost target.
    model.default_threshold = 0.5
    model.save(path)
    return model


# ---- the default model ---------------------------------------------------------------------

SEED_DIR = Path(__file__).resolve().parent / "data"
_default_lock = threading.Lock()


def seed_files() -> list[Path]:
    return sorted(SEED_DIR.glob("*.jsonl"))


def _seed_fingerprint() -> str:
    """Changes whenever the seed set or the training code changes, so a stale cache is retrained."""
    h = hashlib.sha256()
    for p in seed_files():
        h.update(p.name.encode())
        h.update(p.read_bytes())
    here = Path(__file__).resolve().parent
    for name in ("features.py", "train.py", "conversation.py", "model.py", "defaults.py"):
        h.update((here / name).read_bytes())
    return h.hexdigest()[:12]


def default_model_path() -> Path:
    """Where the default model lives: $SWITCHYARD_ROUTER_MODEL if set, else a cache under the data
    directory keyed by the seed set's fingerprint (trained on first use by load_default_model)."""
    env = os.environ.get("SWITCHYARD_ROUTER_MODEL")
    if env:
        return Path(env)
    base = Path(os.environ.get("SWITCHYARD_DATA_DIR", "data"))
    return base / "router" / f"default-{_seed_fingerprint()}.npz"


def load_default_model() -> DifficultyModel:
    """Load the default model, training it from router/data/ first if the cache is missing."""
    path = default_model_path()
    with _default_lock:
        if not path.exists():
            if os.environ.get("SWITCHYARD_ROUTER_MODEL"):
                raise ModelFileError(f"{path}: SWITCHYARD_ROUTER_MODEL points to a missing file")
            train_default_model(path)
        return DifficultyModel.load(path)
