"""The difficulty model: fast scoring path, files, default model, odd requests."""
from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import numpy as np
import pytest

from router.conversation import parse
from router.features import FeatureConfig, dense_features
from router.model import DifficultyModel, ModelFileError
from router.train import TrainConfig, default_model_path, featurize, fit, hashed_matrix, load_default_model
from tests.router.conftest import make_rows

ODD_REQUESTS = [
    "", [], [{"role": "user", "content": None}], [{"foo": 1}], ["not a dict"],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}],
    [{"role": "user", "content": [{"type": "text", "text": "what is in this picture?"},
                                  {"type": "image_url", "image_url": {"url": "data:,"}}]}],
    [{"role": "assistant", "content": "only an assistant turn"}],
    "é" * 50_000, "\x00\x01 binary-ish \udcff", "x" * 200_000,
]


@pytest.fixture(scope="module")
def small_model() -> DifficultyModel:
    rows = make_rows(120, seed=5)
    return fit([r["prompt"] for r in rows], np.array([r["weak_correct"] for r in rows]),
               np.array([r["strong_correct"] for r in rows]), TrainConfig(C=3.0))


@pytest.mark.parametrize("label", ["gain", "strong_only"])
def test_fast_score_matches_the_training_matrix(small_model: DifficultyModel, label: str):
    """The per-request path (scratch counts, no sort) computes what training computed (np.unique),
    for each head of the model."""
    model = small_model
    if label != "gain":
        rows = make_rows(120, seed=5)
        model = fit([r["prompt"] for r in rows], np.array([r["weak_correct"] for r in rows]),
                    np.array([r["strong_correct"] for r in rows]), TrainConfig(label=label, C=3.0))
    cfg = model.config
    requests = [r["prompt"] for r in make_rows(30, seed=9)] + [
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "prove it, prove it again"}]]
    f = featurize(requests, cfg)
    x = hashed_matrix(f.blocks, cfg.n_bits, model.idf)
    heads = [(model.coef, model.dense_coef, model.intercept)]
    if label == "gain":
        assert model.has_weak_head
        heads.append((model.weak_coef, model.weak_dense_coef, model.weak_intercept))
    got = np.array([model.logits(r) for r in requests])
    assert got.shape == (len(requests), len(heads))
    for h, (coef, dense_coef, intercept) in enumerate(heads):
        expected = x @ coef + f.dense @ dense_coef + intercept
        np.testing.assert_allclose(got[:, h], expected, rtol=1e-9, atol=1e-9)
        assert np.ptp(got[:, h]) > 0.1  # the comparison is not between constants


def test_gain_score_ranks_by_expected_gain(small_model: DifficultyModel):
    """A gain model's score is monotone in P(strong right) - P(weak right), stays in [0, 1], and
    keeps requests with a negative expected gain apart instead of tying them at 0."""
    def sig(z):
        return 1 / (1 + np.exp(-z))

    requests = [r["prompt"] for r in make_rows(40, seed=11)] + ["hi", "prove it"]
    z = np.array([small_model.logits(r) for r in requests])
    gain = sig(z[:, 0]) - sig(z[:, 1])
    scores = small_model.score_many(requests)
    assert ((scores >= 0) & (scores <= 1)).all()
    order = np.argsort(gain)
    assert (np.diff(scores[order]) >= 0).all() and np.ptp(gain) > 0.3
    from router.model import _combine

    assert 0 < _combine(np.array([-3.0, 3.0])) < _combine(np.array([-2.0, 3.0])) < 0.01  # both negative gains
    assert _combine(np.array([4.0, -4.0])) == pytest.approx(sig(4) - sig(-4), abs=1e-6)


def test_length_scale_lets_a_small_set_learn_length():
    """Where longer prompts are the hard ones, the lightly penalised length feature carries more
    weight with length_scale=10 than without, and the model then ranks by length."""
    from router.features import DENSE_NAMES

    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]
    prompts = [" ".join(rng.choice(words, size=int(n))) for n in rng.integers(2, 60, size=60)]
    hard = np.array([len(p) > 150 for p in prompts])
    weak = ~hard ^ (rng.random(60) < 0.1)  # a little label noise
    col = DENSE_NAMES.index("log_query_chars")
    plain = fit(prompts, weak, np.ones(60, bool), TrainConfig(length_scale=1.0))
    scaled = fit(prompts, weak, np.ones(60, bool), TrainConfig())
    assert scaled.meta["length_scale"] == 10.0
    # weak head: longer → less likely right; the scaled fit leans on length harder
    assert scaled.weak_dense_coef[col] < plain.weak_dense_coef[col] < 0
    short, long_ = " ".join(words[:3]), " ".join(words * 6)
    assert scaled.score(long_) > scaled.score(short)


def test_version_1_files_without_a_weak_head_still_load(tmp_path: Path):
    rows = make_rows(80, seed=3)
    one_head = fit([r["prompt"] for r in rows], np.array([r["weak_correct"] for r in rows]),
                   np.array([r["strong_correct"] for r in rows]), TrainConfig(label="strong_only"))
    assert not one_head.has_weak_head
    import io
    import json

    with np.load(io.BytesIO(one_head.to_bytes()), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(arrays["meta"].tobytes())
    meta["format_version"] = 1
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    old = DifficultyModel.from_bytes(buf.getvalue())
    assert old.score("prove the theorem") == pytest.approx(one_head.score("prove the theorem"), abs=1e-5)


def test_save_load_round_trip(small_model: DifficultyModel, tmp_path: Path):
    small_model.default_threshold = 0.42
    path = tmp_path / "sub" / "m.npz"
    version = small_model.save(path)
    assert version == hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    assert not [p for p in path.parent.iterdir() if p.name != "m.npz"]  # no temp file left behind
    loaded = DifficultyModel.load(path)
    assert loaded.version == version and loaded.default_threshold == 0.42
    assert loaded.has_weak_head and loaded.meta["label_rule"] == "gain"
    for r in ["hello there", "prove the theorem on convergence of the integral step by step"]:
        assert loaded.score(r) == pytest.approx(small_model.score(r), abs=1e-5)  # coefficients stored as float32
        np.testing.assert_allclose(loaded.logits(r), small_model.logits(r), atol=1e-4)


def test_wrong_format_version_is_refused(small_model: DifficultyModel, tmp_path: Path):
    import io
    import json

    with np.load(io.BytesIO(small_model.to_bytes())) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(arrays["meta"].tobytes())
    meta["format_version"] = 99
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    path = tmp_path / "future.npz"
    np.savez(path, **arrays)
    with pytest.raises(ModelFileError, match="version 99"):
        DifficultyModel.load(path)
    with pytest.raises(ModelFileError, match="directory"):
        DifficultyModel.load(tmp_path)


@pytest.mark.parametrize("request_", ODD_REQUESTS, ids=range(len(ODD_REQUESTS)))
def test_odd_requests_score_without_error(small_model: DifficultyModel, request_):
    s = small_model.score(request_)
    assert 0.0 <= s <= 1.0


def test_conversation_parsing():
    conv = parse([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "first answer"},
        {"role": "user", "content": [{"type": "text", "text": "second"}, {"type": "image_url", "image_url": {}}]},
        {"role": "assistant", "content": None, "tool_calls": []},
    ])
    assert conv.query == "second"
    assert conv.context == "Be brief.\nfirst question\nfirst answer"
    assert (conv.n_messages, conv.n_user, conv.n_assistant, conv.system_chars, conv.n_non_text_parts) == (5, 2, 2, 9, 1)
    d = dense_features(conv)
    assert d.shape == (25,) and np.isfinite(d).all()


def test_scoring_is_thread_safe(small_model: DifficultyModel):
    requests = [r["prompt"] for r in make_rows(40, seed=11)]
    serial = [small_model.score(r) for r in requests]
    results: dict[int, list[float]] = {}

    def work(i: int) -> None:
        results[i] = [small_model.score(r) for r in requests]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(results[i] == serial for i in range(4))


def test_default_model_trains_from_seed_set_and_ranks_sensibly(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("SWITCHYARD_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("SWITCHYARD_ROUTER_MODEL", raising=False)
    path = default_model_path()
    assert path.parent == tmp_path / "router" and not path.exists()
    model = load_default_model()
    assert path.is_file() and model.version == hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    assert model.meta["trained_from"] == "router/data seed set" and model.default_threshold == 0.5
    greeting = model.score([{"role": "user", "content": "hi there!"}])
    maths = model.score("Let p be a prime. Prove that the multiplicative group of integers modulo p is cyclic, "
                        "and find the number of generators.")
    code = model.score("Implement a concurrent hash map in Rust with lock striping and resizing, and prove that "
                       "lookups never observe a torn entry.")
    assert maths > greeting and code > greeting
    mtime = path.stat().st_mtime_ns
    assert load_default_model().version == model.version and path.stat().st_mtime_ns == mtime  # cached


def test_default_model_env_override(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("SWITCHYARD_ROUTER_MODEL", str(tmp_path / "missing.npz"))
    assert default_model_path() == tmp_path / "missing.npz"
    with pytest.raises(ModelFileError, match="SWITCHYARD_ROUTER_MODEL"):
        load_default_model()


def test_feature_config_round_trips():
    cfg = FeatureConfig(n_bits=16, char_ngrams=(2, 4), dense=False)
    assert FeatureConfig.from_dict(cfg.to_dict()) == cfg
