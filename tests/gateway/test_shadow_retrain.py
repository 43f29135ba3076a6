"""`switchyard router retrain --from-ledger` on a real, migrated shadow_evals table (SQLite and PostgreSQL).

The labelled rows follow a simple, learnable rule (proof and algorithm questions need the strong model,
look-up questions do not). Whether the new model wins is decided by the data, not by the test:
- a current model trained when the traffic looked the other way round is beaten, and replaced;
- a current model that already ranks today's traffic perfectly (trained on plenty of it) cannot be beaten,
  only matched, by a model trained on the shadow rows: a tie is not better, and nothing is written.
"""
from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
import sqlalchemy as sa

from gateway import db
from gateway.cli import main
from gateway.ledger.models import ShadowEvalRow
from router.model import DifficultyModel
from router.train import fit

HARD_TEMPLATES = ["Prove that every {a} graph with {n} vertices has a {b} cycle.",
                  "Derive a closed form for the recurrence T(n) = {n} T(n/2) + n log n and prove it by induction.",
                  "Design a lock-free {b} queue and prove it is linearizable under {a} contention.",
                  "Prove rigorously that the {a} series converges for exponent {n}."]
EASY_TEMPLATES = ["What is the capital of {c}?", "Translate '{w}' into French.",
                  "How many days are there in {m}?", "Spell the word {w} backwards."]
FILL = {"a": ["planar", "bipartite", "dense", "sparse", "harmonic", "random"],
        "b": ["hamiltonian", "concurrent", "bounded", "simple", "odd"],
        "n": ["3", "7", "12", "40", "100"], "c": ["France", "Peru", "Kenya", "Japan", "Chile", "Norway"],
        "w": ["apple", "river", "window", "garden", "stone"], "m": ["March", "April", "a leap year", "June"]}


def labelled_rows(n: int, seed: int, noise: float = 0.0, inverted: bool = False) -> list[tuple[str, bool, bool]]:
    """(prompt, weak_correct, strong_correct): hard prompts → weak wrong, strong right; easy → both right.
    `noise` flips that share of labels; `inverted` swaps which family is hard."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        hard = i % 3 == 0
        template = rng.choice(HARD_TEMPLATES if hard else EASY_TEMPLATES)
        prompt = template.format(**{k: rng.choice(v) for k, v in FILL.items()})
        needs_strong = hard != inverted
        if rng.random() < noise:
            needs_strong = not needs_strong
        rows.append((prompt, not needs_strong, True))
    return rows


def seed_shadow_evals(url: str, rows: list[tuple[str, bool, bool]], route: str = "assistant") -> None:
    db.upgrade(url)
    engine = sa.create_engine(db.sync_url(url))
    t0 = datetime(2025, 3, 1, tzinfo=UTC)
    with engine.begin() as conn:
        conn.execute(ShadowEvalRow.__table__.insert(), [
            {"request_id": f"req_{route}_{i}", "created_at": t0 + timedelta(seconds=i), "route": route,
             "endpoint": "chat.completions", "prompt_text": prompt,
             "messages_json": json.dumps([{"role": "user", "content": prompt}]),
             "easy_backend": "local", "hard_backend": "mini", "served_backend": "local",
             "weak_answer": "w", "strong_answer": "s", "weak_correct": weak, "strong_correct": strong,
             "judge": "exact", "difficulty": 0.5, "threshold": 0.5, "model_version": "m0"}
            for i, (prompt, weak, strong) in enumerate(rows)])
    engine.dispose()


def train_model(rows: list[tuple[str, bool, bool]], path: Path) -> DifficultyModel:
    model = fit([r[0] for r in rows], np.array([r[1] for r in rows]), np.array([r[2] for r in rows]))
    model.default_threshold = 0.5
    model.save(path)
    return DifficultyModel.load(path)


def retrain(url: str, *extra: str) -> int:
    return main(["router", "retrain", "--from-ledger", "--database-url", url, "--route", "assistant", *extra])


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path) -> str:
    return request.getfixturevalue("pg_url") if request.param == "postgresql" else f"sqlite:///{tmp_path}/l.db"


def test_activates_a_better_model_atomically(url, tmp_path, capsys) -> None:
    current_path = tmp_path / "current.npz"
    train_model(labelled_rows(120, seed=1, inverted=True), current_path)  # last quarter's traffic
    seed_shadow_evals(url, labelled_rows(90, seed=2))
    seed_shadow_evals(url, labelled_rows(30, seed=3, inverted=True), route="other")  # not this route's rows
    before = current_path.read_bytes()

    assert retrain(url, "--model", str(current_path)) == 0
    out = capsys.readouterr().out
    assert "90 labelled rows; trained on 63, compared on 27 held out" in out
    current_apgr, new_apgr = (float(line.split()[2]) for line in out.splitlines()
                              if line.startswith(("current ", "new ")))
    assert new_apgr > current_apgr and new_apgr > 0.8 and current_apgr < 0.5  # the oracle here: 0.8333
    assert "activated" in out
    assert current_path.read_bytes() != before
    new = DifficultyModel.load(current_path)
    assert new.meta["retrained_rows"] == 63 and new.default_threshold is not None
    assert new.score("Prove that every planar graph with 7 vertices has a odd cycle.") > \
        new.score("What is the capital of Peru?")
    assert not list(tmp_path.glob(".current.npz*"))  # no temp file left behind


def test_refuses_when_the_new_model_is_not_better(url, tmp_path, capsys) -> None:
    current_path = tmp_path / "current.npz"
    train_model(labelled_rows(400, seed=4), current_path)  # already knows today's traffic well
    seed_shadow_evals(url, labelled_rows(60, seed=5))
    before = current_path.stat().st_mtime_ns, current_path.read_bytes()
    out_path = tmp_path / "candidate.npz"

    assert retrain(url, "--model", str(current_path), "--out", str(out_path), "--min-rows", "40") == 0
    out = capsys.readouterr().out
    current_apgr, new_apgr = (float(line.split()[2]) for line in out.splitlines()
                              if line.startswith(("current ", "new ")))
    assert new_apgr == current_apgr > 0.8  # both rank the held-out rows like the oracle (0.8333)
    assert "kept the current model" in out and "nothing was written" in out
    assert (current_path.stat().st_mtime_ns, current_path.read_bytes()) == before
    assert not out_path.exists()


def test_too_few_rows_is_a_clear_error_and_writes_nothing(tmp_path, capsys) -> None:
    url = f"sqlite:///{tmp_path}/l.db"
    current_path = tmp_path / "current.npz"
    train_model(labelled_rows(60, seed=6), current_path)
    seed_shadow_evals(url, labelled_rows(20, seed=7))
    before = current_path.read_bytes()
    assert retrain(url, "--model", str(current_path)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: shadow_evals (route assistant): 20 labelled rows, fewer than --min-rows 50")
    assert current_path.read_bytes() == before


def test_unmigrated_database_is_a_clear_error(tmp_path, capsys) -> None:
    url = f"sqlite:///{tmp_path}/empty.db"
    sa.create_engine(db.sync_url(url)).connect().close()
    assert retrain(url, "--model", str(tmp_path / "m.npz")) == 2
    assert "no shadow_evals table; run `switchyard db upgrade`" in capsys.readouterr().err
