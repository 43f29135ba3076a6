"""Turns a route and a request into an ordered chain of backends to try, with the reason.

`decide()` runs on the request path, so everything slow happens elsewhere: difficulty models are loaded
(the default one trained if missing) when a policy is applied, in a thread, and reloaded by a watcher when
their file changes; engine load is scraped in the background (gateway/engine_load.py). Per request this
costs one `DifficultyModel.score()` and a few comparisons (thresholds and chains: a RoutePlan per policy and model).

Reasons written to the ledger's `route_reason` (see docs/router.md, "Routing in the gateway"):
  fixed            a fixed route's backend
  difficulty_easy  score < threshold → easy
  difficulty_hard  score ≥ threshold → hard
  idle_relaxed     easy only because the idle engine relaxed the threshold
  spillover        easy by score, but the easy engine is saturated → hard
  no_score         no model loaded (yet) or nothing to score (completions token ids) → the route's `backend`
                   (default: hard)
  capability       the first choice cannot serve the request (tools, structured output, images, embeddings,
                   context, a completions parameter a chat-only backend cannot carry)
                   → the first backend of the chain that can, on fixed routes (their fallbacks) and difficulty
                   routes alike (gateway/capabilities.py); and every embeddings request on a difficulty
                   route (never scored: the route's backends that serve embeddings, its `backend` first)
  budget           the key cannot afford hard → easy (`budget_downgrade`, when the proxy's reservation is refused)
  fallback         served by a backend other than the chain's first (`Decision.reason_served_by`)
  shadow, shadow_judge  (gateway/shadow/runner.py) mirrored and judge calls of shadow evaluation
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gateway import admission, capabilities, errors, pricing
from gateway.backends.translate import refusal_message, untranslatable
from gateway.engine_load import UNKNOWN, EngineLoad, EngineLoadMonitor
from gateway.policy import IdleSpec, Policy, RouteSpec, SpilloverSpec
from gateway.tasks import cancel_and_wait, poll_forever
from gateway.uptime import DevicePrice

if TYPE_CHECKING:
    from gateway.backend_pool import BackendPool
    from router.model import DifficultyModel

log = logging.getLogger("switchyard.routing")

FALLBACK_THRESHOLD = 0.5  # when neither the route nor the model gives one


@dataclass(slots=True)
class Decision:
    chain: list[str]  # backend names, first choice first
    reason: str  # see the module docstring
    difficulty: float | None = None
    threshold: float | None = None  # the threshold actually applied (after idle relaxation)
    model_version: str | None = None

    def reason_served_by(self, backend: str) -> str:
        """The reason a row served by `backend` records: `fallback` when it is not the chain's first choice."""
        return "fallback" if self.chain and backend != self.chain[0] else self.reason


# ---------------------------------------------------------------- the decision, as pure functions


def saturated(load: EngineLoad, spillover: SpilloverSpec | None) -> bool:
    """Is any spillover limit exceeded? Unknown load is never saturated (the fallback chain covers a dead engine)."""
    if spillover is None or not load.known:
        return False
    return ((spillover.max_waiting is not None and load.waiting is not None and load.waiting > spillover.max_waiting)
            or (spillover.max_kv_usage is not None and load.kv_usage is not None
                and load.kv_usage > spillover.max_kv_usage)
            or (spillover.max_ttft_ms is not None and load.ttft_p95_ms is not None
                and load.ttft_p95_ms > spillover.max_ttft_ms))


def relaxed_threshold(threshold: float, load: EngineLoad, idle: IdleSpec | None) -> float:
    """Below `below_utilisation`, rise linearly from `threshold` (at that utilisation) to `max_threshold` (at 0)."""
    if idle is None or not load.known or load.busy is None or load.busy >= idle.below_utilisation:
        return threshold
    if idle.max_threshold <= threshold:
        return threshold
    slack = 1.0 - max(0.0, load.busy) / idle.below_utilisation
    return threshold + (idle.max_threshold - threshold) * slack


def choose(score: float, threshold: float, load: EngineLoad, spillover: SpilloverSpec | None,
           idle: IdleSpec | None) -> tuple[bool, float, str]:
    """(hard?, threshold applied, reason) for one scored request."""
    if saturated(load, spillover):
        return True, threshold, ("spillover" if score < threshold else "difficulty_hard")
    effective = relaxed_threshold(threshold, load, idle)
    if score >= effective:
        return True, effective, "difficulty_hard"
    return False, effective, ("idle_relaxed" if score >= threshold else "difficulty_easy")


def difficulty_chain(route: RouteSpec, hard: bool | None) -> list[str]:
    """First choice, then the route's fallbacks, then the other of easy/hard; no name twice.
    hard=None (no score): the route's `backend` first (default: hard)."""
    if hard is None:
        first, other = route.backend, (route.easy if route.backend == route.hard else route.hard)
    else:
        first, other = (route.hard, route.easy) if hard else (route.easy, route.hard)
    chain: list[str] = []
    for name in (first, *route.fallbacks, other, route.easy):
        if name is not None and name not in chain:
            chain.append(name)
    return chain


def scoring_input(body: dict) -> list | str | None:
    """What the router scores: the chat messages (router/conversation.py reads their text), or the completions
    prompt as text (None for token ids, and for embeddings bodies, which have no prompt)."""
    messages = body.get("messages")
    if messages is not None:
        return messages
    return admission.completions_prompt_text(body.get("prompt"))


def budget_downgrade(route: RouteSpec, decision: Decision) -> Decision | None:
    """For a key that cannot afford `decision`'s chain: `easy` alone (reason `budget`) where the route allows
    it (`budget_downgrade`) and the chain is more than that; else None (the refusal stands)."""
    if not (route.budget_downgrade and route.easy and decision.chain != [route.easy]):
        return None
    return dataclasses.replace(decision, chain=[route.easy], reason="budget")


def decide(route: RouteSpec, body: dict, models: DifficultyModels, load: EngineLoadMonitor,
           policy: Policy | None = None, endpoint: str | None = None, prompt_chars: int | None = None) -> Decision:
    """Fixed routes go to their backend, then their fallbacks; difficulty routes are scored. With `policy`,
    backends that cannot serve the request are then taken out of the chain (`fit_capabilities`). `endpoint`:
    "embeddings" for a /v1/embeddings body (never scored: the route's `backend`); otherwise the body is a
    chat or completions one (a /v1/responses body is routed in its chat form). `prompt_chars`: the length of
    the body's prompt text, when the caller has it (otherwise worked out if a context check needs it)."""
    decision = _decide(route, body, models, load)
    if endpoint == "embeddings" and route.strategy == "difficulty":
        decision.reason = "capability"  # never scored: the backends that serve embeddings, the route's `backend` first
    if policy is not None:
        fit_capabilities(route, decision, policy, body, endpoint, prompt_chars)
    return decision


_PARAM_OF = {"tools": "tools", "json_mode": "response_format", "structured_output": "response_format",
             "images": "messages", "context": "messages", "embeddings": "model"}


def fit_capabilities(route: RouteSpec, decision: Decision, policy: Policy, body: dict,
                     endpoint: str | None = None, prompt_chars: int | None = None) -> None:
    """Keep only the chain's backends that can serve `body`. A route whose first choice cannot goes to the
    first backend of its chain that can (reason `capability`): a difficulty route escalates, a fixed route skips
    to a fallback. Where none can, it is the client's 400, naming what is missing."""
    endpoint = endpoint or ("chat" if "messages" in body else "completions")
    wanted = capabilities.needs(body, endpoint)
    caps = {name: capabilities.of(policy.backends[name]) for name in decision.chain}
    tokens = None
    if any(c.max_context is not None for c in caps.values()):
        # about 4 characters a token: the context check must not turn away what would fit
        if prompt_chars is None:
            prompt_chars = len(admission.prompt_text(body, endpoint))
        tokens = prompt_chars // 4
    if not wanted and tokens is None:
        return
    missing = {name: c.missing(wanted, tokens) for name, c in caps.items()}
    first = decision.chain[0]
    capable = [name for name in decision.chain if not missing[name]]
    if not missing[first]:
        decision.chain = capable
        return
    if not capable:
        lacking = missing[first]
        if lacking == [capabilities.NATIVE_COMPLETIONS]:
            param = untranslatable(body) or "prompt"
            raise errors.invalid_request(f"Route '{route.name}': {refusal_message(param)} No backend of the route "
                                         "serves /v1/completions itself.", param=param, code="unsupported_parameter")
        what = "does not serve embeddings" if lacking == ["embeddings"] else \
            f"does not support {', '.join(lacking)} (this request needs it)"
        raise errors.invalid_request(f"Route '{route.name}' is served by '{first}', which {what}; no backend of "
                                     "the route does.", param=_PARAM_OF[lacking[0]], code="unsupported_capability")
    decision.chain = capable
    decision.reason = "capability"


def _decide(route: RouteSpec, body: dict, models: DifficultyModels, load: EngineLoadMonitor) -> Decision:
    if route.strategy != "difficulty":
        return Decision(chain=route.chain(), reason="fixed")
    plan = models.plan(route)
    request = scoring_input(body)
    if plan.model is None or request is None:
        return Decision(chain=list(plan.chains[None]), reason="no_score")
    score = plan.model.score(request)
    easy_load = load.get(route.easy) if plan.watch_load else UNKNOWN
    hard, applied, reason = choose(score, plan.threshold, easy_load, route.spillover, route.idle)
    return Decision(chain=list(plan.chains[hard]), reason=reason, difficulty=score, threshold=applied,
                    model_version=plan.model.version)


@dataclass(frozen=True, slots=True)
class RoutePlan:
    """What deciding a difficulty route needs that depends only on the policy version and the loaded model,
    worked out once (DifficultyModels.plan) instead of per request."""
    route: RouteSpec
    model: DifficultyModel | None
    threshold: float  # the route's, else the model's default, else FALLBACK_THRESHOLD
    chains: dict[bool | None, tuple[str, ...]]  # hard? → chain (None: no score)
    watch_load: bool  # spillover or idle relaxation read the easy engine's load

    @classmethod
    def of(cls, route: RouteSpec, model: DifficultyModel | None) -> RoutePlan:
        threshold = route.threshold
        if threshold is None:
            threshold = model.default_threshold if model is not None and model.default_threshold is not None \
                else FALLBACK_THRESHOLD
        return cls(route, model, threshold, {h: tuple(difficulty_chain(route, h)) for h in (True, False, None)},
                   bool(route.spillover or route.idle))


# ---------------------------------------------------------------- models, loaded off the request path


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size)


class DifficultyModels:
    """The difficulty models the live policy names, by `model_path` ("" = the project's default model).

    Loaded in a thread when a policy is applied; a watcher reloads a model whose file changed (a
    `router retrain` activation replaces it atomically). A file that fails to load keeps the previous model
    if there was one; a route without any model routes with reason `no_score`.
    """

    def __init__(self, poll_interval_s: float = 1.0) -> None:
        self.poll_interval_s = poll_interval_s
        self._models: dict[str, DifficultyModel] = {}  # read on the request path
        self._files: dict[str, tuple[Path, tuple[int, int] | None]] = {}  # the file each model came from
        self._task: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        self._plans: dict[int, RoutePlan] = {}  # by id(route); each plan holds its route, so the id stays its

    def get(self, route: RouteSpec) -> DifficultyModel | None:
        return self._models.get(route.model_path or "")

    def plan(self, route: RouteSpec) -> RoutePlan:
        """The route's plan for the model loaded now: made on the first request after a policy or model change."""
        model = self._models.get(route.model_path or "")
        plan = self._plans.get(id(route))
        if plan is None or plan.route is not route or plan.model is not model:
            plan = RoutePlan.of(route, model)
            plans = self._plans if len(self._plans) < 256 else {}  # routes of past policies are let go
            plans[id(route)] = plan
            self._plans = plans
        return plan

    @staticmethod
    def _load(key: str) -> tuple[DifficultyModel, Path, tuple[int, int] | None]:
        from router.model import DifficultyModel
        from router.train import default_model_path, load_default_model

        if key:
            path = Path(key)
            stamp = _stamp(path)
            return DifficultyModel.load(path), path, stamp
        model = load_default_model()  # trains from router/data/ on first use (about a second)
        path = default_model_path()
        return model, path, _stamp(path)

    async def _load_into(self, key: str) -> None:
        from router.model import ModelFileError

        try:
            model, path, stamp = await asyncio.to_thread(self._load, key)
        except (ModelFileError, OSError) as exc:
            kept = "keeping the loaded model" if key in self._models else "its routes use `backend` (no_score)"
            log.error("difficulty model %s could not be loaded (%s); %s", key or "(default)", exc, kept)
            if key and key not in self._files:  # watch for the file to appear (or be fixed)
                self._files[key] = (Path(key), None)
            return
        models = dict(self._models)
        models[key] = model
        self._models = models  # one reference swap: a request sees the old or the new model
        self._files[key] = (path, stamp)
        log.info("difficulty model %s loaded from %s (version %s)", key or "(default)", path, model.version)

    async def sync(self, policy: Policy) -> None:
        keys = {r.model_path or "" for r in policy.routes.values() if r.strategy == "difficulty"}
        async with self._lock:
            for key in keys:
                path = Path(key) if key else None
                known = self._files.get(key)
                if key not in self._models or known is None or (path is not None and _stamp(path) != known[1]):
                    await self._load_into(key)
            self._models = {k: m for k, m in self._models.items() if k in keys}
            self._files = {k: f for k, f in self._files.items() if k in keys}
        if keys and self._task is None:
            self._task = asyncio.create_task(self._watch(), name="difficulty-model-watch")

    async def check_now(self) -> None:
        """Reload every model whose file changed since it was loaded."""
        async with self._lock:
            for key, (path, stamp) in list(self._files.items()):
                current = _stamp(path)
                if current is not None and current != stamp:
                    await self._load_into(key)

    async def _watch(self) -> None:
        await poll_forever(self.check_now, self.poll_interval_s, "difficulty model watcher")

    async def aclose(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)


class RoutingRuntime:
    """The routing state the gateway keeps between requests: the difficulty models and the engine load."""

    def __init__(self, models: DifficultyModels | None = None, load: EngineLoadMonitor | None = None) -> None:
        self.models = models or DifficultyModels()
        self.load = load or EngineLoadMonitor()

    async def apply(self, policy: Policy, pool: BackendPool) -> None:
        """Called when a policy goes live (after the pool synced, so embedded engines have their URLs)."""
        targets, prices, types, busy = {}, {}, {}, {}
        for name, spec in policy.backends.items():
            backend = pool.get(name)
            api_base = getattr(backend, "api_base", None) or spec.api_base
            if spec.kind == "engine" and api_base:
                targets[name] = api_base
                prices[name] = DevicePrice(pricing.device_hour_usd(spec), pricing.device_count(spec),
                                           pricing.device_kind(spec) or "gpu")
                types[name] = spec.engine_type
                if callable(getattr(backend, "busy_seconds", None)):  # a foreign engine's busy time, counted here
                    busy[name] = backend.busy_seconds
        self.load.configure(targets, prices, types, busy)
        await self.models.sync(policy)

    async def aclose(self) -> None:
        await self.models.aclose()
        await self.load.aclose()
