"""How many draft tokens each decode verifies this step: the choice with the best expected goodput (tokens
emitted per second of step time), from measured step costs and acceptance rates, as SmartSpec does.

With per-token acceptance rate a, verifying k drafts emits E(k) = 1 + a + ... + a^k tokens in expectation.
A step that verifies k_i drafts for decode i costs target(T + sum k_i) + draft steps, where T is what the
step feeds anyway. Draft tokens are added one at a time, best expected gain a_i^j first, and the step keeps
the prefix of additions with the highest (sum E) / cost; zero additions (no speculation) is a candidate, so
speculation is off whenever verifying would cost more than it is expected to save.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

_LOG_BUCKET = math.log(1.125)


def expected_tokens(alpha: float, k: int) -> float:
    """E[tokens emitted] verifying k drafts with per-token acceptance alpha (iid): sum of alpha^j, j = 0..k."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass(slots=True)
class StepCost:
    """Seconds of one forward as a function of the tokens fed: an exponentially weighted mean per bucket of
    token counts (exact up to 16, then about 12% wide), linear between buckets, made non-decreasing, and
    proportional outside the buckets seen. Both extrapolations err towards no speculation, whose cost is then
    measured by the steps it makes: beyond the largest bucket verification is charged in full, and below the
    smallest a plain step looks cheap."""

    weight: float = 0.1  # of a new observation in its bucket's mean
    _buckets: dict[int, list[float]] = field(default_factory=dict)  # bucket -> [mean tokens, mean seconds]
    _xs: list[float] = field(default_factory=list)
    _ys: list[float] = field(default_factory=list)
    _dirty: bool = False

    @property
    def known(self) -> bool:
        return bool(self._buckets)

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < 1 or seconds <= 0:
            return
        key = tokens if tokens <= 16 else 16 + round(math.log(tokens / 16) / _LOG_BUCKET)
        entry = self._buckets.get(key)
        if entry is None:
            self._buckets[key] = [float(tokens), seconds]
        else:
            w = self.weight
            entry[0] += w * (tokens - entry[0])
            entry[1] += w * (seconds - entry[1])
        self._dirty = True

    def __call__(self, tokens: float) -> float:
        if tokens <= 0:
            return 0.0
        if self._dirty:
            self._rebuild()
        xs, ys = self._xs, self._ys
        if not xs:
            return 0.0
        if tokens >= xs[-1]:
            return ys[-1] * tokens / xs[-1]
        i = bisect.bisect_left(xs, tokens)
        if i == 0:
            return ys[0] * tokens / xs[0]
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)

    def _rebuild(self) -> None:
        points = sorted(self._buckets.values())
        self._xs, self._ys = [], []
        top = 0.0
        for x, y in points:
            if self._xs and x <= self._xs[-1]:
                continue
            top = max(top, y)
            self._xs.append(x)
            self._ys.append(top)
        self._dirty = False


@dataclass(slots=True)
class Acceptance:
    """Per-token acceptance rate with exponential forgetting: accepted / examined drafts, where a step that
    accepts a of k examined a + 1 (a < k) or k (a == k), the maximum-likelihood estimate for iid acceptance."""

    decay: float = 0.9
    accepted: float = 0.0
    examined: float = 0.0

    def update(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.accepted = self.accepted * self.decay + accepted
        self.examined = self.examined * self.decay + accepted + (1 if accepted < proposed else 0)

    def rate(self, prior: float, prior_weight: float = 2.0) -> float:
        return (self.accepted + prior * prior_weight) / (self.examined + prior_weight)


@dataclass(slots=True)
class Candidate:
    max_k: int  # drafts available (capped by K, max_tokens and the context)
    alpha: float  # its estimated acceptance rate
    lag: int = 1  # tokens the draft model feeds for it in its first forward (catching up)
    drafted: bool = True  # proposed by the draft model (False: by n-gram lookup, free)


@dataclass(slots=True)
class ScaledCost:
    """A stand-in for a cost not measured yet: another model's measured cost times a ratio (a draft before its
    first forward: the target's cost scaled by the draft's share of the weights), so that an unmeasured draft
    is never taken to be free."""

    base: StepCost
    ratio: float

    def __call__(self, tokens: float) -> float:
        return self.ratio * self.base(tokens)


@dataclass(slots=True)
class Plan:
    ks: list[int]  # drafts per candidate
    emitted: float  # expected tokens this step emits (every decode's, drafts' expected gains included)
    seconds: float  # expected step seconds (target forward, verifying sequences' overhead, draft forwards)


def choose(cands: list[Candidate], base_tokens: int, num_decodes: int, budget: int, target: StepCost,
           draft: StepCost | ScaledCost | None, per_seq: float = 0.0, calibration: float = 1.0) -> list[int]:
    """k per candidate maximising expected goodput (plan_drafts(...).ks)."""
    return plan_drafts(cands, base_tokens, num_decodes, budget, target, draft, per_seq, calibration).ks


def plan_drafts(cands: list[Candidate], base_tokens: int, num_decodes: int, budget: int, target: StepCost,
                draft: StepCost | ScaledCost | None, per_seq: float = 0.0, calibration: float = 1.0) -> Plan:
    """The plan maximising expected goodput. `base_tokens`: what the step feeds without speculation;
    `num_decodes`: tokens it emits without; `budget`: the most tokens a step may feed; `draft`: the draft
    model's cost per forward (None: proposals are free, as n-grams); `per_seq`: seconds a verifying decode
    costs beyond its tokens (it leaves the batched decode path for the per-sequence prefill one);
    `calibration`: realised over expected goodput of past speculating steps (SpecDecoder), which scales every
    plan with drafts: what the cost and acceptance models miss (acceptance that is not iid, time spent
    proposing and verifying outside the forward) is paid for from measurements, not assumed away."""
    ks = [0] * len(cands)
    if not target.known:  # no plain step measured yet: take one first (at batch 32 a blind try costs)
        return Plan(ks, float(num_decodes), 0.0)
    gains = sorted(((c.alpha ** j, i) for i, c in enumerate(cands) for j in range(1, c.max_k + 1)), reverse=True)
    tokens = base_tokens
    emitted = float(num_decodes)
    draft_rows: list[int] = []  # tokens draft forward j feeds: one per sequence proposing more than j (its lag
    draft_seconds = 0.0          # in the first forward)
    extra = 0.0  # verifying sequences' own cost
    plain_seconds = max(target(tokens), 1e-9)
    best = emitted / plain_seconds
    best_n, best_emitted, best_seconds = 0, emitted, plain_seconds
    for n, (gain, i) in enumerate(gains, start=1):
        if tokens + 1 > budget:
            break
        tokens += 1
        emitted += gain
        j = ks[i]
        if j == 0:
            extra += per_seq
        if draft is not None and cands[i].drafted:
            if j == len(draft_rows):
                draft_rows.append(0)
            rows = cands[i].lag if j == 0 else 1
            draft_seconds += draft(draft_rows[j] + rows) - draft(draft_rows[j])
            draft_rows[j] += rows
        ks[i] += 1
        seconds = max(target(tokens) + extra + draft_seconds, 1e-9)
        goodput = calibration * emitted / seconds
        if goodput > best:
            best, best_n, best_emitted, best_seconds = goodput, n, emitted, seconds
    ks = [0] * len(cands)
    for _, i in gains[:best_n]:
        ks[i] += 1
    return Plan(ks, best_emitted, best_seconds)


@dataclass(slots=True)
class BackOff:
    """When to plan at all: after `patience` consecutive plans in which the planner chose no drafts for anyone,
    skip planning (and proposing) for 1 step, then 2, 4, ... up to `max_skip`, so that speculation switched off
    costs next to nothing; each plan after a skip re-tests (with the step costs measured meanwhile). A plan with
    any drafts, or far fewer decodes than when the streak began (a smaller batch favours speculation), ends it.

    Per step: `ready(num_decodes)`; when it says True, plan and then `record(any_drafts, num_decodes)`.
    """

    patience: int = 4
    max_skip: int = 64
    shrink: float = 0.75  # fewer decodes than this fraction of the streak's first plan's: plan again now
    streak: int = 0  # consecutive plans without drafts
    skip: int = 0  # steps the current back-off skips (0: none yet)
    left: int = 0  # steps still to skip
    decodes: int = 0  # decodes at the streak's first plan

    def ready(self, num_decodes: int) -> bool:
        if self.left > 0 and num_decodes >= self.shrink * self.decodes:
            self.left -= 1
            return False
        if self.left > 0:
            self.reset()
        return True

    def record(self, any_drafts: bool, num_decodes: int) -> None:
        if any_drafts:
            self.reset()
            return
        if self.streak == 0:
            self.decodes = num_decodes
        self.streak += 1
        if self.streak >= self.patience:
            self.skip = min(self.max_skip, max(1, 2 * self.skip))
            self.left = self.skip

    def reset(self) -> None:
        self.streak = self.skip = self.left = self.decodes = 0


@dataclass(slots=True)
class _Goodput:
    """Running means of tokens emitted and seconds spent per step (their ratio: realised goodput)."""

    weight: float
    tokens: float = 0.0
    seconds: float = 0.0
    n: int = 0

    def add(self, tokens: float, seconds: float) -> None:
        self.n += 1
        w = max(self.weight, 1.0 / self.n)  # a plain mean until 1 / weight samples, then exponential
        self.tokens += w * (tokens - self.tokens)
        self.seconds += w * (seconds - self.seconds)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(slots=True)
class _Verdict:
    plain: _Goodput
    spec: _Goodput
    hold: int = 0  # the last hold's length (doubles per failed re-test)
    until: int = 0  # held off before this step


@dataclass(slots=True)
class Ledger:
    """Never slower, from measurements alone: per batch-size bucket, the realised goodput (tokens emitted per
    second of the whole step: forward, sampling and proposing) of decode-only steps that verified drafts and of
    those that did not. When speculating steps realise less than plain ones (by more than `margin`, each side
    measured at least `min_samples` times), the bucket is held off for `first_hold` steps, doubling per failed
    re-test up to `max_hold`; after a hold its speculating steps are measured afresh. The planner's cost and
    acceptance models decide how deep to go; this decides whether their choices have paid, so a loss they do not
    predict (a verify path slower than the decode step at some precision, time outside the forward) ends
    speculation instead of recurring. Per step: `allowed(bucket, step)`, then `record(...)` for decode-only steps."""

    weight: float = 0.1
    margin: float = 0.02
    min_samples: int = 4
    first_hold: int = 64
    max_hold: int = 4096
    buckets: dict[int, _Verdict] = field(default_factory=dict)

    def _get(self, bucket: int) -> _Verdict:
        v = self.buckets.get(bucket)
        if v is None:
            v = self.buckets[bucket] = _Verdict(_Goodput(self.weight), _Goodput(self.weight))
        return v

    def allowed(self, bucket: int, step: int) -> bool:
        v = self.buckets.get(bucket)
        return v is None or step >= v.until

    def held_for(self, bucket: int, step: int) -> int:
        """Steps from `step` on that the bucket stays held off (0: allowed)."""
        v = self.buckets.get(bucket)
        return 0 if v is None else max(0, v.until - step)

    def lost(self, bucket: int) -> bool:
        """Speculating has lost here and no re-test has paid since (probes are pointless: re-tests decide)."""
        v = self.buckets.get(bucket)
        return v is not None and v.hold > 0

    def record(self, bucket: int, step: int, speculated: bool, tokens: float, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        v = self._get(bucket)
        (v.spec if speculated else v.plain).add(tokens, seconds)
        if not speculated or v.spec.n < self.min_samples or v.plain.n < self.min_samples:
            return
        if v.spec.rate < (1.0 - self.margin) * v.plain.rate:
            v.hold = min(self.max_hold, max(self.first_hold, 2 * v.hold))
            v.until = step + 1 + v.hold
            v.spec = _Goodput(self.weight)  # the re-test measures afresh
        elif v.spec.rate > v.plain.rate:
            v.hold = 0  # it pays: a later loss starts from a short hold again
