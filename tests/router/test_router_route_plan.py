"""gateway/routing.py works out a difficulty route's threshold and chains once per policy and model
(RoutePlan), not per request; a new policy or a reloaded model gets a new plan, and every decision still
gets a chain of its own."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from gateway.engine_load import EngineLoadMonitor
from gateway.policy import parse_policy
from gateway.routing import FALLBACK_THRESHOLD, DifficultyModels, RoutePlan, decide
from router.model import DifficultyModel
from router.train import fit

POLICY = """
backends:
  local: {kind: engine, model: tiny, api_base: "http://127.0.0.1:9/v1"}
  mini: {kind: litellm, model: openai/gpt-4o-mini, input_usd_per_mtok: 1, output_usd_per_mtok: 2}
routes:
  assistant:
    strategy: difficulty
    easy: local
    hard: mini
    model_path: MODEL
THRESHOLD"""
HARD = {"messages": [{"role": "user", "content": "prove the statement number 3"}]}
EASY = {"messages": [{"role": "user", "content": "say hi 3"}]}


def save_model(path: Path, default_threshold: float | None) -> None:
    prompts = [f"prove the statement number {i}" for i in range(20)] + [f"say hi {i}" for i in range(40)]
    model = fit(prompts, np.array([False] * 20 + [True] * 40), np.ones(60, dtype=bool))
    model.default_threshold = default_threshold
    model.save(path)


def policy_text(path: Path, threshold: str = "") -> str:
    return POLICY.replace("MODEL", str(path)).replace("THRESHOLD", threshold)


async def test_one_plan_per_policy_and_model(tmp_path: Path) -> None:
    path = tmp_path / "m.npz"
    save_model(path, default_threshold=0.9)
    policy = parse_policy(policy_text(path), "p.yaml")
    route = policy.routes["assistant"]
    models, load = DifficultyModels(), EngineLoadMonitor()
    try:
        assert models.plan(route).model is None  # before the model is loaded: no_score from the plan
        assert decide(route, HARD, models, load).reason == "no_score"
        await models.sync(policy)
        plan = models.plan(route)
        assert isinstance(plan, RoutePlan) and plan.model is models.get(route)
        assert plan.threshold == 0.9  # no route threshold: the model's default
        hard = decide(route, HARD, models, load)
        assert models.plan(route) is plan  # requests reuse it
        assert (hard.reason, hard.chain, hard.threshold) == ("difficulty_hard", ["mini", "local"], 0.9)
        hard.chain.append("mutated by the proxy")  # a decision's chain is its own, not the plan's
        assert decide(route, HARD, models, load).chain == ["mini", "local"]
        assert decide(route, EASY, models, load).chain == ["local", "mini"]

        # The file is replaced by a model without a default threshold: a new model, so a new plan.
        save_model(path, default_threshold=None)
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
        await models.check_now()
        assert models.plan(route) is not plan
        assert models.plan(route).threshold == FALLBACK_THRESHOLD
        assert decide(route, HARD, models, load).threshold == FALLBACK_THRESHOLD

        # A new policy version (new route objects) with its own threshold: a new plan.
        policy2 = parse_policy(policy_text(path, "    threshold: 0.3\n"), "p.yaml")
        await models.sync(policy2)
        route2 = policy2.routes["assistant"]
        assert models.plan(route2).threshold == 0.3
        assert decide(route2, HARD, models, load).threshold == 0.3
    finally:
        await models.aclose()


def test_plans_of_past_policies_are_let_go(tmp_path: Path) -> None:
    models = DifficultyModels()
    routes = [parse_policy(policy_text(tmp_path / "absent.npz"), "p.yaml").routes["assistant"] for _ in range(600)]
    for route in routes:
        models.plan(route)
    assert len(models._plans) <= 256
    assert all(models.plan(r).route is r for r in routes[-10:])


def test_loaded_model_gives_the_same_decision_as_scoring_by_hand(tmp_path: Path) -> None:
    path = tmp_path / "m.npz"
    save_model(path, default_threshold=None)
    model = DifficultyModel.load(path)
    route = parse_policy(policy_text(path, "    threshold: 0.5\n"), "p.yaml").routes["assistant"]
    models = DifficultyModels()
    models._models = {str(path): model}
    for body in (HARD, EASY, {"prompt": "say hi 7"}):
        d = decide(route, body, models, EngineLoadMonitor())
        want = model.score(body.get("messages") or body["prompt"])
        assert d.difficulty == want and d.model_version == model.version
        assert d.reason == ("difficulty_hard" if want >= 0.5 else "difficulty_easy")
