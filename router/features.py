"""Request features for the difficulty model: hashed n-grams plus a few dense structure counts.

The n-gram hashing is done in numpy over the UTF-8 bytes of the text, so one request costs a
few dozen vectorised array operations instead of a Python loop per token, and training and
serving run the very same code (no vocabulary to ship, no sklearn call per request):

* char n-grams (n = 3, 4, 5) and words (runs of letters, digits, `_` and non-ASCII bytes):
  polynomial hash mod 2**64 of the bytes, all taken from one prefix sum using P**-1 mod 2**64
  (P is odd, so it is invertible); bigrams combine two neighbouring word hashes;
* each kind of feature is xor-ed with its own seed and passed through the splitmix64
  finaliser before taking the low bits as the bucket.

Long texts are cut to a head and a tail window first, which bounds the cost per request.
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

import numpy as np

from router.conversation import Conversation

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


@dataclass(frozen=True, slots=True)
class FeatureConfig:
    n_bits: int = 18                  # 2**n_bits hashed buckets
    word_ngrams: int = 2              # 0 = none, 1 = unigrams, 2 = + bigrams
    char_ngrams: tuple[int, ...] = (3, 4, 5)
    context_words: bool = True        # word unigrams of earlier turns / system prompt, own namespace
    fold_digits: bool = True          # every digit becomes 0: numbers' shape matters, not their value
    head_chars: int = 1200            # n-grams see at most the first head_chars …
    tail_chars: int = 300             # … and the last tail_chars of the query
    dense: bool = True                # structure counts (see DENSE_NAMES)
    use_idf: bool = True

    def to_dict(self) -> dict:
        d = asdict(self)
        d["char_ngrams"] = list(self.char_ngrams)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> FeatureConfig:
        d = dict(d)
        d["char_ngrams"] = tuple(d.get("char_ngrams", ()))
        return cls(**d)


class _Powers:
    """P**i and P**-i mod 2**64 for i < size, grown on demand. Both tables are swapped in as one
    tuple, so a thread never sees a grown table beside a short one."""

    def __init__(self) -> None:
        self.tables = (np.ones(1, dtype=np.uint64), np.ones(1, dtype=np.uint64))

    def get(self, size: int) -> tuple[np.ndarray, np.ndarray]:
        tables = self.tables
        if tables[0].size >= size:
            return tables
        size = max(size, 2 * tables[0].size)
        p = np.full(size, _P, dtype=np.uint64)
        p[0] = 1
        q = np.full(size, _Q, dtype=np.uint64)
        q[0] = 1
        self.tables = tables = (np.cumprod(p, dtype=np.uint64), np.cumprod(q, dtype=np.uint64))
        return tables


_POWERS = _Powers()
_POWERS.get(16384)  # the default windows' worst case: (1,200 + 300 characters) x 4 bytes, query and context


def _window(text: str, head: int, tail: int) -> str:
    if len(text) <= head + tail:
        return text
    return text[:head] + " " + text[-tail:]


def _normalised_bytes(text: str, cfg: FeatureConfig) -> bytes:
    t = " ".join(_window(text, cfg.head_chars, cfg.tail_chars).lower().split())
    if cfg.fold_digits:
        t = t.translate(_DIGITS_TO_ZERO)
    return t.encode("utf-8", "ignore")


_S30, _S27, _S31 = _U(30), _U(27), _U(31)
_MIX1, _MIX2 = _U(0xBF58476D1CE4E5B9), _U(0x94D049BB133111EB)
_UP = _U(_P)
_MASKS = {bits: _U((1 << bits) - 1) for bits in range(65)}


def _mix_inplace(x: np.ndarray) -> None:
    """splitmix64 finaliser, in place: spreads every input bit over the output (uint64 arithmetic wraps)."""
    x ^= x >> _S30
    x *= _MIX1
    x ^= x >> _S27
    x *= _MIX2
    x ^= x >> _S31


def hashed_buckets(conv: Conversation, cfg: FeatureConfig) -> tuple[np.ndarray, tuple[int, ...]]:
    """Bucket index of every n-gram occurrence of every block in ONE int64 array, and each block's
    length (query words, query chars, context words: the blocks the config enables, in that order).

    One prefix sum over " query context " serves every hash: the hash of bytes [s, e) is
    P**(e-1) * (prefix[e] - prefix[s]) mod 2**64, the value the rolling hash gives (so the
    buckets are position-independent and equal to the per-block rolling version). The spaces
    around the query keep words from running across the seam; char n-grams are contiguous
    slices, so they need no index arrays; every kind is mixed in one pass."""
    q = _normalised_bytes(conv.query, cfg)
    c = _normalised_bytes(conv.context, cfg) if cfg.context_words and conv.context else b""
    buf = np.frombuffer(b" " + q + b" " + c + b" ", dtype=np.uint8)
    lq, size = len(q), buf.size
    pw, inv = _POWERS.get(size + 1)
    # (array methods rather than np.* functions below: the functions' dispatch costs more than the work)
    prefix = np.empty(size + 1, dtype=np.uint64)
    prefix[0] = 0
    (buf * inv[:size]).cumsum(out=prefix[1:])
    parts: list[np.ndarray] = []
    sizes: list[int] = []
    if cfg.word_ngrams or cfg.context_words:
        is_w = _WORD_BYTES[buf]
        edges = (is_w[1:] != is_w[:-1]).nonzero()[0] + 1  # buf starts and ends with a space: pairs
        starts, ends = edges[0::2], edges[1::2]
        w = pw[ends - 1] * (prefix[ends] - prefix[starts])
        nq = int(starts.searchsorted(lq + 1))  # the query is buf[1 : lq + 1]
        if cfg.word_ngrams:
            wq = w[:nq]
            parts.append(wq ^ _SEED_WORD)
            n_word = nq
            if cfg.word_ngrams >= 2 and nq > 1:
                bigram = wq[:-1] * _UP + wq[1:]
                bigram ^= _SEED_BIGRAM
                parts.append(bigram)
                n_word += nq - 1
            sizes.append(n_word)
    if cfg.char_ngrams:
        n_char = 0
        for n in sorted(k for k in set(cfg.char_ngrams) if k >= 1):
            if n > lq:
                break
            # n-grams starting at buf[1 .. lq - n + 1], ending (exclusive) at buf[n + 1 .. lq + 1]
            h = pw[n:lq + 1] * (prefix[n + 1:lq + 2] - prefix[1:lq - n + 2])
            h ^= _SEED_CHAR[n]
            parts.append(h)
            n_char += h.size
        sizes.append(n_char)
    if cfg.context_words:
        if w.size > nq:
            parts.append(w[nq:] ^ _SEED_CTX_WORD)
        sizes.append(w.size - nq)
    if not parts:
        return np.zeros(0, dtype=np.int64), tuple(sizes)
    x = np.concatenate(parts) if len(parts) > 1 else parts[0]
    _mix_inplace(x)
    x &= _MASKS[cfg.n_bits]
    return x.view(np.int64), tuple(sizes)


def hashed_indices(conv: Conversation, cfg: FeatureConfig) -> list[np.ndarray]:
    """Bucket index of every n-gram occurrence, one array per block (query words, query chars,
    context words); duplicates are kept (they are the counts)."""
    idx, sizes = hashed_buckets(conv, cfg)
    return np.split(idx, np.cumsum(sizes[:-1])) if sizes else []


def weighted_block(idx: np.ndarray, idf: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Unique buckets of one block with sublinear tf (1 + log count), times idf, L2-normalised."""
    if idx.size == 0:
        return idx, np.zeros(0)
    u, counts = np.unique(idx, return_counts=True)
    v = 1.0 + np.log(counts)
    if idf is not None:
        v = v * idf[u]
    norm = np.sqrt(v @ v)
    return u, (v / norm if norm > 0 else v)


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


# The same byte classes as translate tables, so counting them is a handful of C calls on bytes.
_CLASS_TABLE = bytes(_BYTE_CLASS.tolist())
_DIGITS_ONLY = bytes(ord("1") if 0x30 <= i <= 0x39 else 0x20 for i in range(256))  # digit runs → split()
_WORDS_ONLY = bytes(ord("w") if _WORD_BYTES[i] else 0x20 for i in range(256))  # word runs → split()


def dense_features(conv: Conversation, max_chars: int = 1000) -> np.ndarray:
    """Structure counts of the query (ratios from its first max_chars) and of the conversation."""
    q = conv.query
    t = q[:max_chars]
    raw = t.encode("utf-8", "ignore")
    n = max(len(raw), 1)
    cls = raw.translate(_CLASS_TABLE)
    numbers = len(raw.translate(_DIGITS_ONLY).split())
    word_runs = raw.translate(_WORDS_ONLY)
    runs = word_runs.split()
    n_words = len(runs)
    word_bytes = word_runs.count(b"w")
    longest = max(map(len, runs), default=0)
    words = max(n_words, 1)
    f = (
        math.log1p(len(q)), math.log1p(q.count("\n") + 1), math.log1p(len(q) + len(conv.context)),
        math.log1p(n_words * len(q) / max(len(t), 1)), float(word_bytes) / words,
        math.log1p(longest),
        cls.count(1) / n, cls.count(2) / n, cls.count(5) / n, cls.count(3) / n, cls.count(4) / n, math.log1p(numbers),
        math.log1p(t.count("?")), math.log1p(len(_LIST_RE.findall(t))), math.log1p(len(_CHOICE_RE.findall(t))),
        math.log1p(t.count("```")), math.log1p(sum(map(t.count, _CODE_MARKERS))),
        math.log1p(sum(map(t.count, _MATH_MARKERS))),
        math.log1p(conv.n_messages), math.log1p(conv.n_assistant), math.log1p(conv.system_chars),
        math.log1p(len(conv.context)), math.log1p(conv.n_non_text_parts),
        float(q.rstrip().endswith("?")), float(t[:40].lstrip().lower().startswith(_IMPERATIVES)),
    )
    return np.asarray(f, dtype=np.float64)
