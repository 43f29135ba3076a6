"""In-place policy edits behind `switchyard router calibrate --write`: layout kept, validated, atomic."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gateway.policy_edit import write_route
from router.calibrate import CalibrationError

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
