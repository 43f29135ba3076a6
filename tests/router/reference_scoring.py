"""The scoring path as it was before the fast path (commit 7cac859), frozen as the reference the
fast path must equal: the per-block rolling hash, the numpy dense features and the per-block
scratch-count dot product, reading the model's own arrays. Test code only."""
from __future__ import annotations

import math
import re
import threading

import numpy as np

from router.conversation import Conversation, parse
from router.features import FeatureConfig
from router.model import DifficultyModel, _combine

_P = 0x100000001B3  # odd multiplier (the 64-bit FNV prime)
_M64 = (1 << 64) - 1
_Q = pow(_P, -1, 1 << 64)
_U = np.uint64

_WORD_BYTES = np.zeros(256, dtype=bool)
for _c in b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_":
    _WORD_BYTES[_c] = True
_WORD_BYTES[128:] = True
_DIGITS_TO_ZERO = str.maketrans("123456789", "000000000")

# Seeds per feature kind (arbitrary distinct 64-bit constants).
_SEED_WORD = _U(0x9E3779B97F4A7C15)
_SEED_BIGRAM = _U(0xC2B2AE3D27D4EB4F)
_SEED_CTX_WORD = _U(0x165667B19E3779F9)
_SEED_CHAR = {n: _U((0x27D4EB2F165667C5 * (n + 1)) & _M64) for n in range(1, 9)}


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: spreads every input bit over the output (uint64 arithmetic wraps)."""
    x = x ^ (x >> _U(30))
    x = x * _U(0xBF58476D1CE4E5B9)
    x = x ^ (x >> _U(27))
    x = x * _U(0x94D049BB133111EB)
    return x ^ (x >> _U(31))


class _Powers:
    """P**i and P**-i mod 2**64 for i < size, grown on demand."""

    def __init__(self) -> None:
        self.pow = np.ones(1, dtype=np.uint64)
        self.inv = np.ones(1, dtype=np.uint64)

    def ensure(self, size: int) -> None:
        if self.pow.size >= size:
            return
        size = max(size, 2 * self.pow.size)
        p = np.full(size, _P, dtype=np.uint64)
        p[0] = 1
        q = np.full(size, _Q, dtype=np.uint64)
        q[0] = 1
        self.pow = np.cumprod(p, dtype=np.uint64)
        self.inv = np.cumprod(q, dtype=np.uint64)


_POWERS = _Powers()
_POWERS.ensure(8192)


def _window(text: str, head: int, tail: int) -> str:
    if len(text) <= head + tail:
        return text
    return text[:head] + " " + text[-tail:]


def _normalise(text: str, cfg: FeatureConfig) -> np.ndarray:
    t = " ".join(_window(text, cfg.head_chars, cfg.tail_chars).lower().split())
    if cfg.fold_digits:
        t = t.translate(_DIGITS_TO_ZERO)
    return np.frombuffer(t.encode("utf-8", "ignore"), dtype=np.uint8)


def _word_hashes(b: np.ndarray) -> np.ndarray:
    if b.size == 0:
        return np.zeros(0, dtype=np.uint64)
    is_w = _WORD_BYTES[b]
    edges = np.diff(np.concatenate(([False], is_w, [False])).astype(np.int8))
    starts = np.flatnonzero(edges == 1)
    ends = np.flatnonzero(edges == -1)
    if starts.size == 0:
        return np.zeros(0, dtype=np.uint64)
    _POWERS.ensure(b.size + 1)
    prefix = np.zeros(b.size + 1, dtype=np.uint64)
    np.cumsum(b.astype(np.uint64) * _POWERS.inv[: b.size], out=prefix[1:])
    return _POWERS.pow[ends - 1] * (prefix[ends] - prefix[starts])


def hashed_indices(conv: Conversation, cfg: FeatureConfig) -> list[np.ndarray]:
    """Bucket index of every n-gram occurrence, one array per block (query words, query chars,
    context words); duplicates are kept (they are the counts)."""
    mask = _U((1 << cfg.n_bits) - 1)
    blocks: list[np.ndarray] = []
    b = _normalise(conv.query, cfg)
    if cfg.word_ngrams:
        w = _word_hashes(b)
        parts = [_mix(w ^ _SEED_WORD)]
        if cfg.word_ngrams >= 2 and w.size > 1:
            parts.append(_mix((w[:-1] * _U(_P) + w[1:]) ^ _SEED_BIGRAM))
        blocks.append(np.concatenate(parts) & mask)
    if cfg.char_ngrams:
        parts = []
        h = b.astype(np.uint64)
        for n in range(1, max(cfg.char_ngrams) + 1):
            if n > 1:
                h = h[:-1] * _U(_P) + b[n - 1:].astype(np.uint64)
            if n in cfg.char_ngrams and h.size:
                parts.append(_mix(h ^ _SEED_CHAR[n]))
        blocks.append((np.concatenate(parts) if parts else np.zeros(0, np.uint64)) & mask)
    if cfg.context_words:
        c = _word_hashes(_normalise(conv.context, cfg)) if conv.context else np.zeros(0, np.uint64)
        blocks.append(_mix(c ^ _SEED_CTX_WORD) & mask)
    return [blk.astype(np.int64) for blk in blocks]


# ---- dense structure features -------------------------------------------------------------

DENSE_NAMES = (
    "log_query_chars", "log_query_lines", "log_total_chars", "log_words", "mean_word_len", "log_longest_word",
    "digit_ratio", "upper_ratio", "non_ascii_ratio", "punct_ratio", "math_symbol_ratio", "log_numbers",
    "log_question_marks", "log_list_items", "log_choice_options", "log_code_fences", "log_code_markers",
    "log_math_markers", "log_messages", "log_assistant_turns", "log_system_chars", "log_context_chars",
    "log_non_text_parts", "ends_with_question", "imperative_start",
)
N_DENSE = len(DENSE_NAMES)

_LIST_RE = re.compile(r"(?m)^[ \t]*(?:[-*\u2022]|\d{1,2}[.)])[ \t]+\S")
_CHOICE_RE = re.compile(r"(?m)^[ \t]*\(?[A-Ha-h][.)][ \t]+\S")
_CODE_MARKERS = ("def ", "return", "import ", "class ", "function", "=>", "{", ";\n", "()", "==", "#include")
_MATH_MARKERS = ("\\", "^", "$", "sqrt", " = ", "\u222b", "\u2211", "\u03c0", "\u221a")
_IMPERATIVES = ("write", "implement", "prove", "derive", "design", "explain", "compute", "calculate",
                "solve", "refactor", "debug", "optimize", "optimise", "analyze", "analyse", "translate")
_PUNCT = ",.;:!?()[]{}<>\"'`"
_MATH_SYMBOLS = "=+-*/^<>%|\\"
# One class per byte, counted in a single bincount: 0 other, 1 digit, 2 upper, 3 punct, 4 math, 5 non-ASCII.
_BYTE_CLASS = np.zeros(256, dtype=np.int64)
_BYTE_CLASS[ord("0"): ord("9") + 1] = 1
_BYTE_CLASS[ord("A"): ord("Z") + 1] = 2
for _c in _PUNCT:
    _BYTE_CLASS[ord(_c)] = 3
for _c in _MATH_SYMBOLS:
    _BYTE_CLASS[ord(_c)] = 4
_BYTE_CLASS[128:] = 5


def dense_features(conv: Conversation, max_chars: int = 1000) -> np.ndarray:
    """Structure counts of the query (ratios from its first max_chars) and of the conversation."""
    q = conv.query
    t = q[:max_chars]
    raw = np.frombuffer(t.encode("utf-8", "ignore"), dtype=np.uint8)
    n = max(raw.size, 1)
    cls = _BYTE_CLASS[raw]
    counts = np.bincount(cls, minlength=6)
    is_digit = np.concatenate(([False], cls == 1))
    numbers = int(np.count_nonzero(is_digit[1:] & ~is_digit[:-1]))
    is_w = np.concatenate(([False], _WORD_BYTES[raw], [False])).astype(np.int8)
    edges = np.diff(is_w)
    wlen = np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)
    words = max(wlen.size, 1)
    f = (
        math.log1p(len(q)), math.log1p(q.count("\n") + 1), math.log1p(len(q) + len(conv.context)),
        math.log1p(wlen.size * len(q) / max(len(t), 1)), float(wlen.sum()) / words,
        math.log1p(int(wlen.max()) if wlen.size else 0),
        counts[1] / n, counts[2] / n, counts[5] / n, counts[3] / n, counts[4] / n, math.log1p(numbers),
        math.log1p(t.count("?")), math.log1p(len(_LIST_RE.findall(t))), math.log1p(len(_CHOICE_RE.findall(t))),
        math.log1p(t.count("```")), math.log1p(sum(t.count(m) for m in _CODE_MARKERS)),
        math.log1p(sum(t.count(m) for m in _MATH_MARKERS)),
        math.log1p(conv.n_messages), math.log1p(conv.n_assistant), math.log1p(conv.system_chars),
        math.log1p(len(conv.context)), math.log1p(conv.n_non_text_parts),
        float(q.rstrip().endswith("?")), float(t[:40].lstrip().lower().startswith(_IMPERATIVES)),
    )
    return np.asarray(f, dtype=np.float64)


def reference_logits(model: DifficultyModel, messages: list[dict] | str) -> np.ndarray:
    """Each head's w·x + b: [strong-needed] for a one-head model, [strong right, weak right]
    for a gain model."""
    conv = parse(messages)
    heads = model._coefs.shape[1]
    z = np.zeros(heads)
    scratch = _scratch(model.coef.size)
    for idx in hashed_indices(conv, model.config):
        if idx.size == 0:
            continue
        # Per occurrence: c = count of its bucket. Summing f(c)/c over occurrences equals
        # summing f(c) over distinct buckets, which is what training computed with np.unique.
        np.add.at(scratch, idx, 1.0)
        c = scratch[idx]
        scratch[idx] = 0.0
        tf = 1.0 + np.log(c)
        if model.idf is None:
            norm2 = float(np.sum(tf * tf / c))
        else:
            t = tf * model.idf[idx]
            norm2 = float(np.sum(t * t / c))
        if norm2 > 0.0:
            z += ((tf / c) @ model._coefs[idx]) / math.sqrt(norm2)
    z[0] += model.intercept
    if heads == 2:
        z[1] += model.weak_intercept
    if model.config.dense:
        d = dense_features(conv)
        z[0] += float(model.dense_coef @ d)
        if heads == 2:
            z[1] += float(model.weak_dense_coef @ d)
    return z



_local = threading.local()


def _scratch(size: int) -> np.ndarray:
    s = getattr(_local, "scratch", None)
    if s is None or s.size != size:
        s = _local.scratch = np.zeros(size, dtype=np.float64)
    return s


def reference_score(model: DifficultyModel, messages: list[dict] | str) -> float:
    return _combine(reference_logits(model, messages))
