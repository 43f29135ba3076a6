"""APGR / CPT on tiny cases computed by hand."""
from __future__ import annotations

import numpy as np
import pytest

from router.metrics import MetricError, apgr, cpt, evaluate, routing_curve

WEAK = [0, 0, 1, 1]
STRONG = [1, 1, 1, 1]  # always-weak quality 0.5, always-strong 1.0


def test_perfect_ranking():
    # PGR at shares 0, .25, .5, .75, 1 is 0, .5, 1, 1, 1 → area .0625 + .1875 + .25 + .25
    c = routing_curve([0.9, 0.8, 0.2, 0.1], WEAK, STRONG)
    assert apgr(c) == pytest.approx(0.75)
    assert cpt(c, 0.5) == pytest.approx(0.25)
    assert cpt(c, 0.8) == pytest.approx(0.25 + 0.3 / 0.5 * 0.25)


def test_reversed_ranking_is_low():
    c = routing_curve([0.1, 0.2, 0.8, 0.9], WEAK, STRONG)
    assert apgr(c) == pytest.approx(0.25)
    assert cpt(c, 0.5) == pytest.approx(0.75)


def test_constant_scores_are_exactly_random():
    c = routing_curve([0.3] * 4, WEAK, STRONG)
    assert list(c.share) == [0.0, 1.0]
    assert apgr(c) == pytest.approx(0.5)
    assert cpt(c, 0.5) == pytest.approx(0.5)


def test_ties_are_interpolated_and_order_free():
    # groups {0}, {1, 2}, {3}: PGR 0, .5, 1, 1 at shares 0, .25, .75, 1 → .0625 + .375 + .25
    scores = np.array([0.9, 0.5, 0.5, 0.1])
    c = routing_curve(scores, WEAK, STRONG)
    assert apgr(c) == pytest.approx(0.6875)
    # swapping the tied rows' labels must not change anything
    c2 = routing_curve(scores[[0, 2, 1, 3]], np.array(WEAK)[[0, 2, 1, 3]], np.array(STRONG)[[0, 2, 1, 3]])
    assert apgr(c2) == pytest.approx(0.6875)
    # the threshold of each point reproduces its share with the rule score >= threshold
    for share, thr in zip(c.share, c.threshold, strict=True):
        assert np.mean(scores >= thr) == pytest.approx(share)


def test_oracle_can_exceed_one_when_weak_is_sometimes_better():
    weak, strong = [1, 0, 0, 1], [0, 1, 1, 1]  # gains -1, +1, +1, 0; weak .5, strong .75
    report = evaluate(np.array(strong) - np.array(weak), weak, strong)
    # PGR 0, 2, 2, 1 at shares 0, .5, .75, 1 → .5 + .5 + .375
    assert report["apgr"] == pytest.approx(1.375)
    assert report["oracle_apgr"] == pytest.approx(1.375)
    assert report["oracle_strong_share"] == pytest.approx(0.5)


def test_random_router_is_about_half():
    rng = np.random.default_rng(7)
    n = 4000
    weak = rng.random(n) < 0.6
    strong = weak | (rng.random(n) < 0.5)
    values = [apgr(routing_curve(rng.random(n), weak, strong)) for _ in range(5)]
    assert abs(np.mean(values) - 0.5) < 0.03


def test_informative_router_beats_random_and_oracle_bounds_it():
    rng = np.random.default_rng(3)
    n = 3000
    weak = rng.random(n) < 0.6
    strong = weak | (rng.random(n) < 0.6)
    gain = strong.astype(int) - weak.astype(int)
    noisy = gain + rng.normal(0, 1.0, n)
    r = evaluate(noisy, weak, strong)
    assert 0.55 < r["apgr"] < r["oracle_apgr"]
    assert r["cpt20"] < r["cpt50"] < r["cpt80"]
    assert r["curve"][0]["quality"] == pytest.approx(weak.mean())
    assert r["curve"][-1]["quality"] == pytest.approx(strong.mean())


@pytest.mark.parametrize("scores,weak,strong,msg", [
    ([], [], [], "no rows"),
    ([0.1, float("nan")], [0, 0], [1, 1], "NaN"),
    ([0.1, 0.2], [0, 0], [1], "length mismatch"),
    ([0.1, 0.2], [1, 1], [1, 0], "not better"),
    ([0.1, 0.2], [0, 2], [1, 1], "booleans"),
])
def test_bad_inputs(scores, weak, strong, msg):
    with pytest.raises(MetricError, match=msg):
        evaluate(scores, weak, strong)
