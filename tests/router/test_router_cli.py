"""`switchyard router train / eval / calibrate` through the real console script."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli import main

REPO = Path(__file__).resolve().parents[2]
# The installed console script when there is one (the real entry point), else the same module.
_SCRIPT = Path(sys.executable).parent / "switchyard"
SWITCHYARD = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "gateway.cli"]

POLICY = """\
# team policy — comments must survive calibration
backends:
  local:
    kind: engine
    api_base: http://127.0.0.1:8100/v1   # engine elsewhere
    model: demo
  mini:
    kind: litellm
    model: openai/gpt-4o-mini
    api_key_env: OPENAI_API_KEY

routes:
  auto:
    strategy: difficulty   # chosen by the router
    easy: local
    hard: mini
    threshold: 0.5          # old value
  pinned:
    strategy: fixed
    backend: mini
"""


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([*SWITCHYARD, *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=120,
                          check=False)


def test_round_trip_csv_train_eval_calibrate(labelled_csv: Path, tmp_path: Path):
    model = tmp_path / "m.npz"
    r = run_cli("router", "train", "--data", str(labelled_csv), "--out", str(model), "--quiet")
    assert r.returncode == 0, r.stderr
    assert model.is_file() and "wrote" in r.stdout

    plot = tmp_path / "curve.png"
    r = run_cli("router", "eval", "--model", str(model), "--data", str(labelled_csv), "--json", "--plot", str(plot))
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)  # exactly one JSON object on stdout
    for key in ("apgr", "cpt20", "cpt50", "cpt80", "n", "curve", "model_version"):
        assert key in report
    assert report["n"] == 80
    assert report["apgr"] > 0.6  # the hard/easy split is learnable
    assert 0.0 <= report["cpt20"] <= report["cpt50"] <= report["cpt80"] <= 1.0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    r = run_cli("router", "calibrate", "--model", str(model), "--data", str(labelled_csv),
                "--target-strong-share", "0.5", "--write", str(policy), "--route", "auto")
    assert r.returncode == 0, r.stderr
    assert "strategy: difficulty" in r.stdout and "threshold:" in r.stdout
    text = policy.read_text()
    assert "# team policy — comments must survive calibration" in text
    assert "# chosen by the router" in text and "# engine elsewhere" in text
    assert "0.5          # old value" not in text
    from gateway.policy import parse_policy

    route = parse_policy(text, "policy.yaml").route("auto")
    assert route.model_path == str(model)
    import numpy as np

    from router.dataset import load_labelled
    from router.model import DifficultyModel

    scores = DifficultyModel.load(model).score_many(load_labelled(labelled_csv).requests)
    assert np.mean(scores >= route.threshold) == pytest.approx(0.5, abs=0.05)


def test_label_rule_and_C_reach_the_model(labelled_csv: Path, tmp_path: Path):
    from router.model import DifficultyModel

    default, single = tmp_path / "gain.npz", tmp_path / "single.npz"
    assert main(["router", "train", "--data", str(labelled_csv), "--out", str(default), "--quiet"]) == 0
    assert main(["router", "train", "--data", str(labelled_csv), "--out", str(single), "--quiet",
                 "--label-rule", "strong_only", "--C", "2"]) == 0
    g, s = DifficultyModel.load(default), DifficultyModel.load(single)
    assert (g.meta["label_rule"], g.meta["C"], g.has_weak_head) == ("gain", 0.3, True)
    assert (s.meta["label_rule"], s.meta["C"], s.has_weak_head) == ("strong_only", 2.0, False)


def test_jsonl_with_messages_and_budget_calibration(labelled_jsonl: Path, tmp_path: Path, capsys):
    model = tmp_path / "m.npz"
    r = run_cli("router", "train", "--data", str(labelled_jsonl), "--out", str(model), "--quiet")
    assert r.returncode == 0, r.stderr
    # In-process from here on: the same entry point, without another interpreter start.
    assert main(["router", "eval", "--model", str(model), "--data", str(labelled_jsonl)]) == 0
    out = capsys.readouterr().out
    assert "APGR" in out and "CPT(50%)" in out
    # strong costs 0.01/request, weak is free, budget 4 USD per 1k → at most 40% strong
    assert main(["router", "calibrate", "--model", str(model), "--data", str(labelled_jsonl),
                 "--max-usd-per-1k-requests", "4", "--strong-usd-per-request", "0.01"]) == 0
    out = capsys.readouterr().out
    share = float(out.split("rows: ")[1].split("%")[0]) / 100
    assert share <= 0.40 + 1e-9
    assert "model_path:" in out


def _error(capsys) -> str:
    return capsys.readouterr().err


def test_missing_column_is_a_clear_error(tmp_path: Path, capsys):
    data = tmp_path / "d.csv"
    data.write_text("text,weak_correct,strong_correct\nhello,True,True\n")
    out = tmp_path / "m.npz"
    assert main(["router", "train", "--data", str(data), "--out", str(out), "--quiet"]) == 2
    err = _error(capsys)
    assert "no column 'prompt'" in err and "text" in err
    assert not out.exists()


def test_non_boolean_label_names_the_row(tmp_path: Path, capsys):
    data = tmp_path / "d.csv"
    data.write_text("prompt,weak_correct,strong_correct\nhi,True,True\nprove it,maybe,True\n")
    out = tmp_path / "m.npz"
    assert main(["router", "train", "--data", str(data), "--out", str(out), "--quiet"]) == 2
    err = _error(capsys)
    assert "d.csv:3" in err and "weak_correct" in err and "'maybe'" in err
    assert not out.exists()


@pytest.mark.parametrize("content", ["", "prompt,weak_correct,strong_correct\n"])
def test_empty_file(tmp_path: Path, capsys, content: str):
    data = tmp_path / "d.csv"
    data.write_text(content)
    out = tmp_path / "m.npz"
    assert main(["router", "train", "--data", str(data), "--out", str(out), "--quiet"]) == 2
    assert "no data rows" in _error(capsys)
    assert not out.exists()


def test_bad_jsonl_line(tmp_path: Path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "hi", "weak_correct": true, "strong_correct": true}\n{"prompt": "x", \n')
    assert main(["router", "train", "--data", str(data), "--out", str(tmp_path / "m.npz"), "--quiet"]) == 2
    assert "d.jsonl:2" in _error(capsys)


def test_single_class_is_refused(tmp_path: Path, capsys):
    data = tmp_path / "d.csv"
    data.write_text("prompt,weak_correct,strong_correct\nhi,True,True\nho,True,True\n")
    out = tmp_path / "m.npz"
    assert main(["router", "train", "--data", str(data), "--out", str(out), "--quiet"]) == 2
    assert "single class" in _error(capsys)
    assert not out.exists()


def test_corrupt_or_foreign_model_file(tmp_path: Path, labelled_csv: Path, capsys):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"definitely not a zip")
    assert main(["router", "eval", "--model", str(bad), "--data", str(labelled_csv)]) == 2
    assert "not a Switchyard difficulty model" in _error(capsys)
    import numpy as np

    foreign = tmp_path / "foreign.npz"
    np.savez(foreign, x=np.arange(3))
    assert main(["router", "eval", "--model", str(foreign), "--data", str(labelled_csv)]) == 2
    assert "metadata" in _error(capsys)
    assert main(["router", "eval", "--model", str(tmp_path / "nope.npz"), "--data", str(labelled_csv)]) == 2
    assert "not found" in _error(capsys)


def test_calibrate_refuses_bad_targets_and_leaves_policy_alone(tmp_path: Path, labelled_csv: Path, capsys):
    model = tmp_path / "m.npz"
    assert main(["router", "train", "--data", str(labelled_csv), "--out", str(model), "--quiet"]) == 0
    capsys.readouterr()
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY)
    common = ["router", "calibrate", "--model", str(model), "--data", str(labelled_csv)]
    assert main([*common, "--target-strong-share", "0.3", "--write", str(policy), "--route", "pinned"]) == 2
    assert "not `strategy: difficulty`" in _error(capsys)
    assert main([*common, "--target-strong-share", "0.3", "--write", str(policy), "--route", "nope"]) == 2
    assert "no route 'nope'" in _error(capsys)
    assert main([*common, "--target-strong-share", "1.5"]) == 2
    assert "between 0 and 1" in _error(capsys)
    assert main([*common, "--max-usd-per-1k-requests", "1"]) == 2
    assert "--strong-usd-per-request" in _error(capsys)
    assert main([*common, "--max-usd-per-1k-requests", "1", "--weak-usd-per-request", "0.002",
                 "--strong-usd-per-request", "0.01"]) == 2
    assert "below the cost" in _error(capsys)
    assert policy.read_text() == POLICY


def test_calibrate_inserts_missing_keys_and_stores_threshold(tmp_path: Path, labelled_csv: Path, capsys):
    model = tmp_path / "m.npz"
    assert main(["router", "train", "--data", str(labelled_csv), "--out", str(model), "--quiet"]) == 0
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY.replace("    threshold: 0.5          # old value\n", ""))
    assert main(["router", "calibrate", "--model", str(model), "--data", str(labelled_csv),
                 "--target-strong-share", "0.25", "--write", str(policy), "--route", "auto", "--store-in-model"]) == 0
    import yaml

    from router.model import DifficultyModel

    doc = yaml.safe_load(policy.read_text())
    assert set(doc["routes"]["auto"]) >= {"threshold", "model_path", "easy", "hard"}
    assert doc["routes"]["pinned"] == {"strategy": "fixed", "backend": "mini"}
    assert DifficultyModel.load(model).default_threshold == pytest.approx(doc["routes"]["auto"]["threshold"], abs=1e-6)
