"""The fast scoring path equals the path it replaced (tests/router/reference_scoring.py, the code as it
was), on every request shape: random texts and conversations, the latency benchmark's workloads,
unicode, empty and huge requests; and its score cache never answers for a different request."""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router import model as model_module
from router.conversation import parse
from router.features import FeatureConfig, dense_features, hashed_indices
from router.model import DifficultyModel
from router.train import TrainConfig, fit, load_default_model
from tests.router import reference_scoring as ref
from tests.router.conftest import make_rows
from tests.router.test_router_model import ODD_REQUESTS

ROOT = Path(__file__).resolve().parents[2]
from bench.router_latency import workloads  # the benchmark's request shapes

TOL = 1e-9
# Words, digits, punctuation, markdown and code, 2-, 3- and 4-byte UTF-8, whitespace of every kind.
ALPHABET = st.sampled_from(list("abcXYZ019_ ?.,;:!()[]{}=+-*/^\\$#`'\"\t\n\r\x0b\x0c") +
                           ["é", "ß", "€", "中", "\u222b", "\U0001F600", "\x00", "\u2022", "\u00a0"])
TEXTS = st.text(alphabet=ALPHABET, max_size=2500)
MESSAGES = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
    "content": st.one_of(TEXTS, st.none(), st.lists(st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": TEXTS}),
        st.just({"type": "image_url", "image_url": {"url": "data:,"}})), max_size=3)),
}), max_size=6)


def _rows_model(label: str) -> DifficultyModel:
    rows = make_rows(120, seed=5)
    return fit([r["prompt"] for r in rows], np.array([r["weak_correct"] for r in rows]),
               np.array([r["strong_correct"] for r in rows]), TrainConfig(label=label, C=3.0))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, DifficultyModel]:
    """The shipped default (two heads, trained from router/data/), a small gain model and a one-head model."""
    data = tmp_path_factory.mktemp("data")
    mp = pytest.MonkeyPatch()
    mp.setenv("SWITCHYARD_DATA_DIR", str(data))
    mp.delenv("SWITCHYARD_ROUTER_MODEL", raising=False)
    try:
        default = load_default_model()
    finally:
        mp.undo()
    return {"default": default, "gain": _rows_model("gain"), "one head": _rows_model("strong_only")}


def assert_equal_to_reference(model: DifficultyModel, request) -> None:
    got, want = model.logits(request), ref.reference_logits(model, request)
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL)
    assert abs(model.score(request) - ref.reference_score(model, request)) <= TOL


SHAPES = {**workloads(), **{f"odd {i}": r for i, r in enumerate(ODD_REQUESTS)},
          "empty": "", "no messages": [], "huge": "Summarise: " + "lorem ipsum dolor 42 " * 20_000,
          "huge unicode": "中文 é € \U0001F600 " * 30_000, "lone surrogate": "a\udcff b\ud800c prove it",
          "system prompt only": [{"role": "system", "content": "You are terse. " * 50}],
          "digits": "1234567890 3.14159 2**64 0x1F", "one char": "?", "whitespace": " \t\n " * 100}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("which", ["default", "gain", "one head"])
def test_every_shape_scores_as_before(models, which: str, shape: str):
    assert_equal_to_reference(models[which], SHAPES[shape])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=st.one_of(TEXTS, MESSAGES))
def test_random_requests_score_as_before(models, request):
    for m in models.values():
        assert_equal_to_reference(m, request)


CONFIGS = [FeatureConfig(), FeatureConfig(word_ngrams=1, char_ngrams=(5, 2), context_words=False),
           FeatureConfig(word_ngrams=0, char_ngrams=(), fold_digits=False),
           FeatureConfig(word_ngrams=2, char_ngrams=(1, 8, 3), n_bits=10, head_chars=50, tail_chars=7),
           FeatureConfig(word_ngrams=0, char_ngrams=(4,), context_words=True, use_idf=False)]


@settings(max_examples=100, deadline=None)
@given(request=st.one_of(TEXTS, MESSAGES), cfg=st.sampled_from(CONFIGS))
def test_features_are_the_very_same(request, cfg: FeatureConfig):
    """The one-prefix-sum hashing gives the same buckets, in the same order, as the per-block rolling hash
    (training reads these too), and the bytes-level dense counts are bit-for-bit the numpy ones."""
    conv = parse(request)
    got, want = hashed_indices(conv, cfg), ref.hashed_indices(conv, cfg)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == np.int64 and np.array_equal(g, w)
    np.testing.assert_array_equal(dense_features(conv), ref.dense_features(conv))


def test_a_model_without_dense_features_or_idf_scores_as_before():
    rows = make_rows(80, seed=3)
    prompts = [r["prompt"] for r in rows]
    weak, strong = np.array([r["weak_correct"] for r in rows]), np.array([r["strong_correct"] for r in rows])
    for cfg in (FeatureConfig(dense=False), FeatureConfig(use_idf=False), CONFIGS[3]):
        m = fit(prompts, weak, strong, TrainConfig(features=cfg, C=3.0))
        for r in prompts[:20] + ["", "prove it " * 300, [{"role": "system", "content": "terse"}]]:
            assert_equal_to_reference(m, r)


def test_a_block_with_zero_idf_adds_nothing_as_before(models):
    """A model file whose idf is 0 on a block's buckets: the old path skipped such a block (norm 0)."""
    m = models["gain"]
    idf = m.idf.copy()
    conv = parse("hello there friend")
    idf[hashed_indices(conv, m.config)[0]] = 0.0  # every query word and bigram bucket
    zeroed = DifficultyModel(m.config, m.coef, idf, m.dense_coef, m.intercept, m.default_threshold, m.meta,
                             weak_head=(m.weak_coef, m.weak_dense_coef, m.weak_intercept))
    for r in ("hello there friend", "hello", "hello there friend, prove it", "", "zzz"):
        assert_equal_to_reference(zeroed, r)
        assert np.isfinite(zeroed.logits(r)).all()


def test_the_cache_answers_only_for_the_same_request(models):
    m = _rows_model("gain")
    q = "prove the theorem on convergence of the integral step by step"
    variants = [[{"role": "user", "content": q}],
                [{"role": "system", "content": "Be brief."}, {"role": "user", "content": q}],
                [{"role": "system", "content": "Be very brief."}, {"role": "user", "content": q}],
                [{"role": "user", "content": q}, {"role": "assistant", "content": "ok"}],
                [{"role": "user", "content": [{"type": "text", "text": q}, {"type": "image_url",
                                                                           "image_url": {"url": "data:,"}}]}]]
    first = [m.score(v) for v in variants]
    info = m._cached_score.cache_info()
    assert (info.hits, info.misses) == (0, len(variants))  # every variant is its own request
    assert len(set(first[:4])) == 4  # (an image changes nothing this model learned: no image in its rows)
    again = [m.score(v) for v in reversed(variants)][::-1]
    assert again == first
    np.testing.assert_allclose(first, [ref.reference_score(m, v) for v in variants], rtol=0, atol=TOL)
    assert m._cached_score.cache_info().hits == len(variants)
    assert m.score(q) == first[0]  # a bare prompt is the one-user-message conversation: the same request
    assert m._cached_score.cache_info().hits == len(variants) + 1


def test_a_repeated_context_is_worked_out_once():
    """A system prompt shared by many requests: its block's logits come from the context cache, and the
    scores are still the previous path's; a context longer than CACHE_MAX_CHARS is worked out each time."""
    m = _rows_model("gain")
    system = {"role": "system", "content": "You are terse and prove every claim step by step. " * 30}
    requests = [[system, {"role": "user", "content": f"question {i}: say hi"}] for i in range(10)]
    for r in requests:
        assert_equal_to_reference(m, r)
    info = m._context_logits.cache_info()
    assert info.misses == 1 and info.hits >= 9
    other = [{"role": "system", "content": "Be brief."}, requests[0][1]]
    assert_equal_to_reference(m, other)  # another context: its own entry, its own score
    assert m._context_logits.cache_info().misses == 2
    huge = [{"role": "system", "content": "rules " * (model_module.CACHE_MAX_CHARS // 6 + 1)}, requests[0][1]]
    assert_equal_to_reference(m, huge)
    assert m._context_logits.cache_info().currsize == 2


def test_long_requests_are_not_kept_in_the_cache():
    m = _rows_model("gain")
    long = "x " * (model_module.CACHE_MAX_CHARS // 2 + 1)
    assert m.score(long) == m.score(long)
    assert abs(m.score(long) - ref.reference_score(m, long)) <= TOL
    assert m._cached_score.cache_info().currsize == 0


def test_the_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(model_module, "CACHE_SIZE", 8)
    m = _rows_model("gain")
    for i in range(50):
        m.score(f"request number {i}")
    assert m._cached_score.cache_info().currsize == 8


def test_threads_score_as_one_thread(models):
    """Each thread counts n-grams in its own scratch; a shared one would mix two requests' counts."""
    m = models["default"]
    requests = [f"request {i}: " + "explain the proof " * (i % 40) for i in range(200)]
    want = [ref.reference_score(m, r) for r in requests]
    got: dict[int, list[float]] = {}

    def work(k: int) -> None:
        got[k] = [m._score_conversation(parse(r)) for r in requests]  # uncached: every call does the work

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in range(4):
        np.testing.assert_allclose(got[k], want, rtol=0, atol=TOL)


def test_texts_past_the_power_tables_grow_them():
    """A config with wide windows reads more bytes than the tables start with (16,384): they grow, the
    buckets stay the same."""
    cfg = FeatureConfig(head_chars=40_000, tail_chars=0)
    conv = parse([{"role": "system", "content": "\U0001F600 ctx " * 4_000},
                  {"role": "user", "content": "\u4e2d\u6587 \U0001F600 x" * 5_000}])
    for got, want in zip(hashed_indices(conv, cfg), ref.hashed_indices(conv, cfg), strict=True):
        assert np.array_equal(got, want)
