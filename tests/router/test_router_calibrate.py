"""Threshold selection (writing it into a policy is tests/gateway/test_policy_edit.py)."""
from __future__ import annotations

import numpy as np
import pytest

from router.calibrate import CalibrationError, for_budget, for_strong_share

SCORES = np.array([0.9, 0.8, 0.8, 0.6, 0.4, 0.3, 0.2, 0.1, 0.05, 0.01])


def test_share_target_picks_the_nearest_achievable_split():
    c = for_strong_share(SCORES, 0.3)
    assert c.strong_share == pytest.approx(0.3) and c.threshold == pytest.approx(0.7)
    c = for_strong_share(SCORES, 0.2)  # 0.8 is tied: 10% or 30% are achievable, never 20%
    assert c.strong_share in (0.1, 0.3)
    assert np.mean(SCORES >= c.threshold) == pytest.approx(c.strong_share)
    assert for_strong_share(SCORES, 0.0).strong_share == 0.0
    assert for_strong_share(SCORES, 1.0).threshold == 0.0


def test_budget_never_exceeds_the_cap():
    # weak free, strong 0.01 USD: 2.5 USD per 1k → at most 25% strong → 10% (the tie blocks 30%)
    c = for_budget(SCORES, 2.5, 0.0, 0.01)
    assert c.strong_share == pytest.approx(0.1)
    c = for_budget(SCORES, 100.0, 0.0, 0.01)
    assert c.strong_share == 1.0
    with pytest.raises(CalibrationError, match="cost more"):
        for_budget(SCORES, 5.0, 0.01, 0.01)
