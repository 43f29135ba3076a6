"""The difficulty model as the gateway uses it: load a file, score a request, fast.

Training (router/train.py) fits a scikit-learn logistic regression on the features of
router/features.py; the file keeps only what scoring needs — the feature settings, the idf
vector, the coefficients with the dense-feature standardisation folded in, and the intercept —
as a NumPy .npz archive plus JSON metadata. A "gain" model (the default label rule) has a second
head, P(weak model right), over the same features; both heads share one pass over the n-grams. Loading never unpickles (allow_pickle=False), so
a model file cannot run code. Scoring redoes the hashing and the sparse dot product in numpy:
no sklearn call per request. What depends only on the model (the heads' weights side by side,
idf squared, the dense weights as one matrix) is laid out once when it is loaded, every block's
n-grams are counted and weighted in one pass, and small LRU caches answer a request seen
again (a retry, a repeated prompt) and a context seen again (a repeated system prompt) without
working them out twice.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import os
import threading
import zipfile
from functools import lru_cache
from pathlib import Path

import numpy as np

from router.conversation import Conversation, parse
from router.features import N_DENSE, FeatureConfig, dense_features, hashed_buckets

MODEL_FORMAT = "switchyard-difficulty-model"
MODEL_FORMAT_VERSION = 2
READABLE_FORMAT_VERSIONS = (1, 2)  # 2 added the optional weak head
CACHE_SIZE = 512  # requests remembered per loaded model (score cache)
CACHE_MAX_CHARS = 8192  # longer requests are not cached: at most 512 x 8192 characters (4 MB of ASCII)
CONTEXT_CACHE_SIZE = 256  # contexts (system prompts, earlier turns) remembered, each <= CACHE_MAX_CHARS


class ModelFileError(ValueError):
    """A model file that is missing, corrupt, or not a Switchyard difficulty model."""


class DifficultyModel:
    """Scores a request with P(strong backend needed) in [0, 1]. Route strong iff score >= threshold."""

    __slots__ = (
        "_cached_score",
        "_coefs",
        "_context_logits",
        "_dense",
        "_idf2",
        "_intercepts",
        "_local",
        "coef",
        "coef_idf",
        "config",
        "default_threshold",
        "dense_coef",
        "idf",
        "intercept",
        "meta",
        "version",
        "weak_coef",
        "weak_dense_coef",
        "weak_intercept",
    )

    def __init__(self, config: FeatureConfig, coef: np.ndarray, idf: np.ndarray | None, dense_coef: np.ndarray,
                 intercept: float, default_threshold: float | None = None, meta: dict | None = None,
                 version: str = "unsaved",
                 weak_head: tuple[np.ndarray, np.ndarray, float] | None = None) -> None:
        n = 1 << config.n_bits
        if coef.shape != (n,):
            raise ModelFileError(f"coefficient vector has shape {coef.shape}, expected ({n},)")
        if idf is not None and idf.shape != (n,):
            raise ModelFileError(f"idf vector has shape {idf.shape}, expected ({n},)")
        expected_dense = N_DENSE if config.dense else 0
        if dense_coef.shape != (expected_dense,):
            raise ModelFileError(f"dense coefficients have shape {dense_coef.shape}, expected ({expected_dense},)")
        self.config = config
        self.coef = np.ascontiguousarray(coef, dtype=np.float64)
        self.idf = None if idf is None else np.ascontiguousarray(idf, dtype=np.float64)
        self.coef_idf = self.coef if self.idf is None else self.coef * self.idf
        self.dense_coef = np.ascontiguousarray(dense_coef, dtype=np.float64)
        self.intercept = float(intercept)
        self.weak_coef = self.weak_dense_coef = self.weak_intercept = None
        self._coefs = self.coef_idf[:, None]
        if weak_head is not None:
            wc, wd, wi = weak_head
            if np.shape(wc) != (n,) or np.shape(wd) != (expected_dense,):
                raise ModelFileError(f"weak head has shapes {np.shape(wc)}, {np.shape(wd)}; "
                                     f"expected ({n},), ({expected_dense},)")
            self.weak_coef = np.ascontiguousarray(wc, dtype=np.float64)
            self.weak_dense_coef = np.ascontiguousarray(wd, dtype=np.float64)
            self.weak_intercept = float(wi)
            # One gather per n-gram serves both heads: columns = (strong-side, weak) weights × idf.
            w_idf = self.weak_coef if self.idf is None else self.weak_coef * self.idf
            self._coefs = np.ascontiguousarray(np.stack([self.coef_idf, w_idf], axis=1))
        self.default_threshold = None if default_threshold is None else float(default_threshold)
        self.meta = dict(meta or {})
        self.version = version
        # Laid out once per load for the per-request path: one row of weights per head.
        self._idf2 = None if self.idf is None else self.idf * self.idf
        heads = [(self.intercept, self.dense_coef)]
        if weak_head is not None:
            heads.append((self.weak_intercept, self.weak_dense_coef))
        self._intercepts = np.array([b for b, _ in heads], dtype=np.float64)
        self._dense = np.ascontiguousarray(np.stack([d for _, d in heads], axis=1))  # (N_DENSE or 0, heads)
        self._local = threading.local()  # per-thread scratch for counting n-grams without sorting
        self._cached_score = lru_cache(maxsize=CACHE_SIZE)(self._score_conversation)
        self._context_logits = lru_cache(maxsize=CONTEXT_CACHE_SIZE)(self._context_block)

    # ---- scoring -------------------------------------------------------------------------

    def _scratch(self, blocks: int) -> np.ndarray:
        """Per-thread counts, one 2**n_bits span per block, all zero between calls."""
        s = getattr(self._local, "scratch", None)
        if s is None or s.size < blocks * self.coef.size:
            s = self._local.scratch = np.zeros(max(blocks, 1) * self.coef.size, dtype=np.int32)
        return s

    @property
    def has_weak_head(self) -> bool:
        return self.weak_coef is not None

    def logits(self, messages: list[dict] | str) -> np.ndarray:
        """Each head's w·x + b: [strong-needed] for a one-head model, [strong right, weak right]
        for a gain model."""
        return self._logits(parse(messages))

    def _logits(self, conv: Conversation) -> np.ndarray:
        # The context block (system prompt, earlier turns) is normalised on its own, so its part of the
        # logits depends on its text alone: a repeated system prompt is scored once (_context_logits).
        cached_context = self.config.context_words and 0 < len(conv.context) <= CACHE_MAX_CHARS
        idx, sizes = hashed_buckets(_query_only(conv) if cached_context else conv, self.config)
        z = self._intercepts + self._ngram_logits(idx, sizes) if idx.size else self._intercepts.copy()
        if cached_context:
            z += self._context_logits(conv.context)
        if self.config.dense:
            z += dense_features(conv) @ self._dense
        return z

    def _ngram_logits(self, idx: np.ndarray, sizes: tuple[int, ...]) -> np.ndarray:
        """Sum over blocks of (block's tf-idf vector, L2-normalised) · weights, all blocks at once.
        Per occurrence: c = count of its bucket in its block. Summing f(c)/c over occurrences equals
        summing f(c) over distinct buckets, which is what training computed with np.unique."""
        n = self.coef.size
        key = idx.copy()
        starts, lengths = [], []
        at = 0
        for block, size in enumerate(sizes):
            if size:
                if block:
                    key[at:at + size] += block * n  # each block counts in its own span of the scratch
                starts.append(at)
                lengths.append(size)
            at += size
        scratch = self._scratch(len(sizes))
        np.add.at(scratch, key, _ONE)  # a typed 1: a Python int sends ufunc.at down its slow path
        c = scratch[key]
        scratch[key] = 0
        tf = np.log(c)
        tf += 1.0
        t2 = tf * tf
        if self._idf2 is not None:
            t2 *= self._idf2[idx]
        t2 /= c
        norm = np.sqrt(np.add.reduceat(t2, starts))
        if not norm.all():  # a block whose weights are all 0 (idf 0) adds nothing
            norm[norm == 0.0] = np.inf
        tf /= c
        tf /= norm.repeat(lengths) if len(lengths) > 1 else norm[0]
        return tf @ self._coefs.take(idx, axis=0)  # take: fancy indexing of rows is ~10x slower

    def _context_block(self, context: str) -> np.ndarray:
        idx, sizes = hashed_buckets(_context_only(context), self.config)
        z = self._ngram_logits(idx, sizes) if idx.size else np.zeros_like(self._intercepts)
        z.flags.writeable = False  # shared by every request with this context
        return z

    def _score_conversation(self, conv: Conversation) -> float:
        return _combine(self._logits(conv))

    def score(self, messages: list[dict] | str) -> float:
        """P(strong backend needed), 0..1 (a gain model: see _combine)."""
        conv = parse(messages)
        if len(conv.query) + len(conv.context) <= CACHE_MAX_CHARS:
            return self._cached_score(conv)
        return self._score_conversation(conv)

    def decision(self, messages: list[dict] | str) -> float:
        """The logit of score()."""
        z = self.logits(messages)
        if z.size == 1:
            return float(z[0])
        p = _combine(z)
        return math.log(p) - math.log1p(-p) if 0.0 < p < 1.0 else math.copysign(math.inf, p - 0.5)

    def score_many(self, requests: list) -> np.ndarray:
        return np.fromiter((self.score(r) for r in requests), dtype=np.float64, count=len(requests))

    # ---- files ---------------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        meta = dict(self.meta)
        meta.update(format=MODEL_FORMAT, format_version=MODEL_FORMAT_VERSION, features=self.config.to_dict(),
                    intercept=self.intercept, default_threshold=self.default_threshold)
        if self.has_weak_head:
            meta["weak_intercept"] = self.weak_intercept
        arrays = {"coef": self.coef.astype(np.float32), "dense_coef": self.dense_coef,
                  "meta": np.frombuffer(json.dumps(meta, sort_keys=True).encode(), dtype=np.uint8)}
        if self.idf is not None:
            arrays["idf"] = self.idf.astype(np.float32)
        if self.has_weak_head:
            arrays["weak_coef"] = self.weak_coef.astype(np.float32)
            arrays["weak_dense_coef"] = self.weak_dense_coef
        buf = io.BytesIO()
        np.savez_compressed(buf, **arrays)
        return buf.getvalue()

    def save(self, path: str | Path) -> str:
        """Write atomically (temp file + rename); returns the new version."""
        path = Path(path)
        data = self.to_bytes()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        self.version = _content_version(data)
        return self.version

    @classmethod
    def from_bytes(cls, data: bytes, source: str = "<bytes>") -> DifficultyModel:
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
        except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError) as e:
            raise ModelFileError(f"{source}: not a Switchyard difficulty model file ({e}); "
                                 f"train one with `switchyard router train`") from e
        try:
            meta = json.loads(arrays["meta"].tobytes().decode())
        except (KeyError, ValueError, UnicodeDecodeError) as e:
            raise ModelFileError(f"{source}: model file has no readable metadata; retrain it") from e
        if meta.get("format") != MODEL_FORMAT:
            raise ModelFileError(f"{source}: not a Switchyard difficulty model (format {meta.get('format')!r})")
        if meta.get("format_version") not in READABLE_FORMAT_VERSIONS:
            raise ModelFileError(f"{source}: model format version {meta.get('format_version')} is not supported "
                                 f"(this build reads {', '.join(map(str, READABLE_FORMAT_VERSIONS))}); retrain with this version")
        try:
            config = FeatureConfig.from_dict(meta["features"])
            weak_head = None
            if "weak_coef" in arrays:
                weak_head = (arrays["weak_coef"].astype(np.float64), arrays["weak_dense_coef"],
                             meta["weak_intercept"])
            model = cls(config, arrays["coef"].astype(np.float64),
                        arrays["idf"].astype(np.float64) if "idf" in arrays else None,
                        arrays["dense_coef"], meta["intercept"], meta.get("default_threshold"), meta,
                        version=_content_version(data), weak_head=weak_head)
        except (KeyError, TypeError) as e:
            raise ModelFileError(f"{source}: model file is incomplete ({e}); retrain it") from e
        if not (np.isfinite(model._coefs).all() and np.isfinite(model.dense_coef).all()
                and math.isfinite(model.intercept)
                and (not model.has_weak_head or (np.isfinite(model.weak_dense_coef).all()
                                                 and math.isfinite(model.weak_intercept)))):
            raise ModelFileError(f"{source}: model coefficients contain NaN or infinity; retrain it")
        return model

    @classmethod
    def load(cls, path: str | Path) -> DifficultyModel:
        path = Path(path)
        try:
            data = path.read_bytes()
        except FileNotFoundError as e:
            raise ModelFileError(f"{path}: model file not found; train one with `switchyard router train`") from e
        except IsADirectoryError as e:
            raise ModelFileError(f"{path}: is a directory, expected a model file") from e
        return cls.from_bytes(data, source=str(path))


def _query_only(conv: Conversation) -> Conversation:
    return Conversation(conv.query, "", conv.n_messages, conv.n_user, conv.n_assistant, conv.system_chars,
                        conv.n_non_text_parts)


def _context_only(context: str) -> Conversation:
    return Conversation("", context, 0, 0, 0, 0, 0)


_FLOOR_SHARPNESS = 20.0
_ONE = np.int32(1)


def _combine(z: np.ndarray) -> float:
    """Head logits → score. A gain model scores the expected gain d = P(strong right) - P(weak
    right) (ranking by d is what maximises quality at any share of strong calls), which equals
    P(strong needed) when the strong model is right wherever the weak one is. d < 0 is floored
    smoothly (softplus) rather than clipped, so requests with a negative gain still keep their order."""
    if z.size == 1:
        return _sigmoid(float(z[0]))
    d = _sigmoid(float(z[0])) - _sigmoid(float(z[1]))
    k = _FLOOR_SHARPNESS
    return min(1.0, max(k * d, 0.0) / k + math.log1p(math.exp(-abs(k * d))) / k)


def _sigmoid(z: float) -> float:
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


def _content_version(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]

