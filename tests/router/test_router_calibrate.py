"""Threshold selection and in-place policy edits."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from router.calibrate import CalibrationError, for_budget, for_strong_share, write_route

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


BLOCK_POLICY = """\
backends:
  local: {kind: engine, api_base: "http://127.0.0.1:8100/v1", model: demo}
  mini: {kind: litellm, model: openai/gpt-4o-mini, api_key_env: OPENAI_API_KEY}
routes:
  auto:
    strategy: difficulty
    easy: local
    hard: mini
    fallbacks:
      - mini
      - local
  other:
    strategy: fixed
    backend: mini
"""


def test_insert_after_a_block_sequence_stays_inside_the_route(tmp_path: Path):
    p = tmp_path / "p.yaml"
    p.write_text(BLOCK_POLICY)
    write_route(p, "auto", 0.25, "m.npz")
    doc = yaml.safe_load(p.read_text())
    assert doc["routes"]["auto"]["threshold"] == 0.25 and doc["routes"]["auto"]["model_path"] == "m.npz"
    assert doc["routes"]["auto"]["fallbacks"] == ["mini", "local"]
    assert doc["routes"]["other"] == {"strategy": "fixed", "backend": "mini"}


def test_an_edit_that_would_not_validate_changes_nothing(tmp_path: Path):
    p = tmp_path / "p.yaml"
    broken = BLOCK_POLICY.replace("easy: local", "easy: nowhere")  # unknown backend: the policy is invalid
    p.write_text(broken)
    with pytest.raises(CalibrationError, match="would not validate"):
        write_route(p, "auto", 0.25, "m.npz")
    assert p.read_text() == broken
    assert [f.name for f in tmp_path.iterdir()] == ["p.yaml"]


def test_flow_style_route_and_bad_yaml_are_refused(tmp_path: Path):
    p = tmp_path / "p.yaml"
    p.write_text("routes:\n  auto: {strategy: difficulty, easy: a, hard: b}\n")
    with pytest.raises(CalibrationError, match="block mapping"):
        write_route(p, "auto", 0.25, "m.npz")
    p.write_text("routes: [unclosed\n")
    with pytest.raises(CalibrationError, match="not valid YAML"):
        write_route(p, "auto", 0.25, "m.npz")
