"""Small labelled data sets for the router's CLI tests, generated with a fixed seed."""
from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import pytest

EASY = ["hello there", "thanks a lot", "what time is it in Paris", "tell me a joke", "good morning",
        "translate cat to French", "what is 2 plus 2", "recommend a movie"]
HARD = ["prove the theorem on convergence of the integral", "implement a lock-free concurrent queue in C++",
        "derive the posterior of the hierarchical model", "optimise this distributed consensus protocol",
        "find all integer solutions of the diophantine equation", "refactor the compiler's register allocator"]


def make_rows(n: int = 80, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        if i % 2 == 0:
            prompt, weak, strong = rng.choice(EASY) + f" please {rng.randint(1, 9)}", True, True
        else:
            prompt = rng.choice(HARD) + " step by step, with a full justification " * rng.randint(1, 3)
            weak, strong = rng.random() < 0.15, rng.random() < 0.9
        rows.append({"prompt": prompt, "weak_correct": weak, "strong_correct": strong})
    return rows


@pytest.fixture
def labelled_csv(tmp_path: Path) -> Path:
    path = tmp_path / "labels.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["prompt", "weak_correct", "strong_correct"])
        w.writeheader()
        for r in make_rows():
            w.writerow({**r, "weak_correct": str(r["weak_correct"]), "strong_correct": str(r["strong_correct"])})
    return path


@pytest.fixture
def labelled_jsonl(tmp_path: Path) -> Path:
    """Same kind of rows as JSONL, half as OpenAI messages lists, with JSON booleans."""
    path = tmp_path / "labels.jsonl"
    with open(path, "w") as f:
        for i, r in enumerate(make_rows(seed=1)):
            if i % 2:
                r = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": r["prompt"]}],
                     "weak_correct": r["weak_correct"], "strong_correct": r["strong_correct"]}
            f.write(json.dumps(r) + "\n")
    return path
