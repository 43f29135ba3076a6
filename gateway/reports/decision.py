"""Buy or host: the monthly cost of all-API, all-hosted and the current mix, and the break-even points.

`DecisionInputs.from_ledger` gathers the measured inputs (traffic, prices, throughput, utilisation);
`decide` computes the outputs. The workbook's Decision sheet writes the same arithmetic as live Excel
formulas over the same inputs (gateway/reports/workbook.py), and its test checks LibreOffice's answers
against `decide`, so the two can never drift apart silently.

The model, per month (730 hours; the window's traffic and the engines' paid time both scaled by 730 h / the
window's hours, one window for both). Prices come from the policy that served each row (its stored version;
`--policy` replaces them as a labelled what-if):
- all-API: every token at the reference API's prices (uncached, cached and output per Mtok).
- all-hosted: the device-hours that many tokens need at the measured throughput, divided by the
  utilisation (idle hours are paid too), times the hourly price of a busy engine-hour (with several
  engines: their prices weighted by each one's busy hours).
- current mix: API-served tokens at their own backends' prices, plus each engine's measured up-hours
  at its own hourly price.
- break-even utilisation: the utilisation at which all-hosted equals all-API; hosting wins above it.
- break-even daily tokens: the tokens a day at which the API would cost what running the current
  engines around the clock costs (more traffic than that and hosting is cheaper, up to the engines'
  capacity).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from gateway.reports.figures import HOURS_PER_MONTH, EngineRow, Ledger, Summary, Window


@dataclass(frozen=True, slots=True)
class ApiPrice:
    backend: str
    model: str
    input_per_mtok: float
    cached_per_mtok: float
    output_per_mtok: float


@dataclass(frozen=True, slots=True)
class ApiTraffic:
    """One API backend's tokens in the window, with its prices (None when unpriced). When the policy versions
    in the window price the backend differently, one entry per version, labelled 'backend @ version'."""

    backend: str
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    spend_usd: float
    price: ApiPrice | None
    label: str | None = None
    policy_versions: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.label or self.backend


@dataclass(slots=True)
class DecisionInputs:
    window_hours: float
    prompt_tokens: int  # all traffic in the window (served by anyone)
    cached_prompt_tokens: int
    completion_tokens: int
    reference: ApiPrice | None  # the API that all-API is priced at
    api: list[ApiTraffic]
    device_hour_usd: float  # all engines together
    devices: int
    tokens_per_s: float | None  # engines' measured throughput (tokens per busy second)
    up_hours: float  # engines' measured up time in the window
    busy_hours: float
    utilisation: float | None  # measured busy / up; None without uptime rows
    notes: list[str] = field(default_factory=list)
    pricing: list[str] = field(default_factory=list)  # which policy priced the rows (ServedPolicies.lines)
    # With several engines, an up-hour or a busy-hour costs the engines' prices weighted by each one's up or
    # busy time (not their sum: that would price every hour as if all engines ran it). None: device_hour_usd.
    up_hour_usd: float | None = None
    busy_hour_usd: float | None = None

    @property
    def up_price(self) -> float:
        return self.device_hour_usd if self.up_hour_usd is None else self.up_hour_usd

    @property
    def busy_price(self) -> float:
        return self.device_hour_usd if self.busy_hour_usd is None else self.busy_hour_usd
    window_note: str | None = None  # the short-window label, when the window is under a day

    @property
    def monthly_scale(self) -> float:
        return HOURS_PER_MONTH / self.window_hours if self.window_hours > 0 else 0.0

    @classmethod
    def from_ledger(cls, ledger: Ledger, window: Window, policy) -> DecisionInputs:
        """`policy`: a Policy (every row priced with it) or a served_policy.ServedPolicies."""
        summary = ledger.summary(window)
        engines = ledger.engines(window)
        return cls.from_figures(summary, engines, ledger.api_backends_by_version(window), policy)

    @classmethod
    def from_figures(cls, summary: Summary, engines: list[EngineRow], api_rows, policy) -> DecisionInputs:
        """`api_rows`: figures.ApiBackendRow, per backend or per backend and policy version; `policy`: a Policy
        (every row priced with it) or a served_policy.ServedPolicies (each row by its own version)."""
        from gateway.reports.figures import window_caveat
        from gateway.reports.served_policy import ServedPolicies

        served = policy if isinstance(policy, ServedPolicies) else ServedPolicies.single(policy)
        policy = served.latest
        prices = api_prices(policy)
        notes: list[str] = []
        reference = reference_price(policy, prices)
        if reference is None:
            notes.append("no priced API backend in the policy: all-API and break-even cannot be computed")
        elif served.spans_several and not served.what_if:
            notes.append(f"all-API is priced at {reference.backend!r} of the newest policy version in the window "
                         f"({policy.version})")
        api = api_traffic(api_rows, served)
        for a in api:
            if a.price is None:
                notes.append(f"API backend {a.name!r} has no price in the policy that served it: its tokens count "
                             "at $0 in the current mix")
        up = sum(e.up_seconds for e in engines)
        busy = sum(e.busy_seconds for e in engines)
        seconds = sum(e.throughput_seconds for e in engines)
        tokens = sum(e.tokens for e in engines)
        hourly = sum(e.device_hour_usd or 0.0 for e in engines)
        if not engines:
            notes.append("no in-house engine traffic or uptime in the window: all-hosted uses the policy's "
                         "engine price but has no measured throughput")
            hourly = sum(_engine_hour_usd(b) for b in policy.backends.values() if b.kind == "engine")
        elif not any(e.has_uptime for e in engines):
            notes.append("no engine_uptime rows: paid hours and utilisation are unknown (the gateway records "
                         "them while it scrapes its engines)")
        caveat = window_caveat(summary)
        if caveat:  # every report that lists these notes (the dashboard too) says the window is short
            notes.insert(0, caveat)
        return cls(
            window_hours=summary.days * 24.0,
            prompt_tokens=summary.prompt_tokens, cached_prompt_tokens=summary.cached_prompt_tokens,
            completion_tokens=summary.completion_tokens, reference=reference, api=api,
            device_hour_usd=hourly, devices=sum(e.devices for e in engines) or 1,
            tokens_per_s=tokens / seconds if seconds > 0 and tokens > 0 else None,
            up_hours=up / 3600.0, busy_hours=busy / 3600.0, utilisation=busy / up if up > 0 else None,
            notes=notes, pricing=served.lines(), window_note=caveat,
            up_hour_usd=_weighted_price(engines, lambda e: e.up_seconds),
            busy_hour_usd=_weighted_price(engines, busy_weight(engines)))


@dataclass(frozen=True, slots=True)
class DecisionResult:
    monthly_prompt_tokens: float
    monthly_cached_tokens: float
    monthly_completion_tokens: float
    all_api_usd: float | None
    all_hosted_usd: float | None
    current_mix_usd: float
    idle_usd: float  # the engines' idle hours this month, at their price
    break_even_utilisation: float | None
    break_even_daily_tokens: float | None
    capacity_daily_tokens: float | None  # the engines' tokens a day at 100% busy
    cheaper: str  # "API", "hosting" or "unknown"


def _per_mtok(tokens: float, price: float) -> float:
    return tokens * price / 1e6


def decide(x: DecisionInputs, utilisation: float | None = None) -> DecisionResult:
    """The outputs at `utilisation` (default: the measured one)."""
    u = x.utilisation if utilisation is None else utilisation
    m = x.monthly_scale
    p, c, o = x.prompt_tokens * m, x.cached_prompt_tokens * m, x.completion_tokens * m
    tokens = p + o
    all_api = None
    if x.reference is not None:
        r = x.reference
        all_api = _per_mtok(p - c, r.input_per_mtok) + _per_mtok(c, r.cached_per_mtok) + _per_mtok(o, r.output_per_mtok)
    busy_hours_needed = tokens / (x.tokens_per_s * 3600.0) if x.tokens_per_s else None
    all_hosted = (busy_hours_needed / u * x.busy_price
                  if busy_hours_needed is not None and u is not None and u > 0 else None)
    api_part = 0.0
    for a in x.api:
        if a.price is not None:
            api_part += m * (_per_mtok(a.prompt_tokens - a.cached_prompt_tokens, a.price.input_per_mtok)
                             + _per_mtok(a.cached_prompt_tokens, a.price.cached_per_mtok)
                             + _per_mtok(a.completion_tokens, a.price.output_per_mtok))
    current = api_part + x.up_hours * m * x.up_price
    idle = (x.up_hours * x.up_price - x.busy_hours * x.busy_price) * m
    be_util = (busy_hours_needed * x.busy_price / all_api
               if busy_hours_needed is not None and all_api else None)
    be_tokens = (x.device_hour_usd * 24.0 / (all_api / tokens)
                 if all_api and tokens > 0 and x.device_hour_usd > 0 else None)
    capacity = x.tokens_per_s * 86400.0 if x.tokens_per_s else None
    cheaper = "unknown"
    if all_api is not None and all_hosted is not None:
        cheaper = "hosting" if all_hosted < all_api else "API"
    return DecisionResult(p, c, o, all_api, all_hosted, current, idle, be_util, be_tokens, capacity, cheaper)


def _engine_hour_usd(spec) -> float:
    from gateway.pricing import device_hour_usd

    return device_hour_usd(spec)


class PriceError(ValueError):
    """The policy cannot price an engine (unreadable, no such backend, no engine backend)."""


@dataclass(frozen=True, slots=True)
class EnginePrice:
    """One engine backend's hourly price (all its devices) and how it was worked out, for assumptions."""

    backend: str
    usd_per_hour: float
    basis: str
    policy: str


def engine_price(policy_path=None, backend: str | None = None) -> EnginePrice:
    """The named engine backend's price (`cpu_hour_usd`, else `gpu_hour_usd × gpus`), or the first engine's."""
    from pathlib import Path

    from gateway.policy import PolicyError, load_policy
    from gateway.settings import DEFAULT_POLICY

    path = Path(policy_path) if policy_path else DEFAULT_POLICY
    try:
        policy = load_policy(path)
    except PolicyError as e:
        raise PriceError(f"cannot load the policy: {e}") from None
    if backend:
        spec = policy.backends.get(backend)
        if spec is None:
            raise PriceError(f"no backend {backend!r} in {path} (have: {', '.join(policy.backends)})")
        if spec.kind != "engine":
            raise PriceError(f"backend {backend!r} in {path} is kind {spec.kind}, not an engine")
    else:
        spec = next((b for b in policy.backends.values() if b.kind == "engine"), None)
        if spec is None:
            raise PriceError(f"{path} has no engine backend to price a device with (pass --backend)")
    if spec.cpu_hour_usd is not None:
        return EnginePrice(spec.name, float(spec.cpu_hour_usd), f"cpu_hour_usd of backend {spec.name!r}", str(path))
    return EnginePrice(spec.name, _engine_hour_usd(spec),
                       f"gpu_hour_usd {spec.gpu_hour_usd:g} × gpus {spec.gpus} of backend {spec.name!r}", str(path))


def api_prices(policy) -> dict[str, ApiPrice]:
    """Per-Mtok prices of every priced litellm backend in the policy."""
    from gateway.pricing import prices_for

    out = {}
    for name, spec in policy.backends.items():
        prices = prices_for(spec)
        if prices is not None:
            out[name] = ApiPrice(name, spec.model, prices.input_per_token * 1e6, prices.cached_input_per_token * 1e6,
                                 prices.output_per_token * 1e6)
    return out


def busy_weight(engines: list[EngineRow]):
    """What a busy engine-hour is weighted by: measured busy seconds when any engine has uptime rows, else the
    rows' device seconds (the same measure the throughput divides by)."""
    if any(e.has_uptime for e in engines):
        return lambda e: e.busy_seconds
    return lambda e: e.throughput_seconds


def _weighted_price(engines: list[EngineRow], weight) -> float | None:
    total = sum(weight(e) for e in engines)
    if len(engines) < 2 or total <= 0:
        return None
    return sum(weight(e) * (e.device_hour_usd or 0.0) for e in engines) / total


def api_traffic(api_rows, served) -> list[ApiTraffic]:
    """Each API backend's traffic priced by the policy version that served it. A backend that every version
    prices alike is one entry; one priced differently by different versions is one entry per version."""
    by_policy: dict[int, dict[str, ApiPrice]] = {}
    groups: dict[str, list[tuple[object, ApiPrice | None]]] = {}
    for r in api_rows:
        pol = served.for_version(getattr(r, "policy_version", None))
        prices = by_policy.setdefault(id(pol), api_prices(pol))
        groups.setdefault(r.backend, []).append((r, prices.get(r.backend)))
    out = []
    for backend, rows in groups.items():
        distinct = {p for _, p in rows}
        parts = [rows] if len(distinct) == 1 else [[x] for x in rows]
        for part in parts:
            versions = tuple(sorted({getattr(r, "policy_version", None) or "" for r, _ in part} - {""}))
            label = None if len(parts) == 1 else f"{backend} @ {versions[0] if versions else 'no version'}"
            out.append(ApiTraffic(backend, sum(r.prompt_tokens for r, _ in part),
                                  sum(r.cached_prompt_tokens for r, _ in part),
                                  sum(r.completion_tokens for r, _ in part), sum(r.spend_usd for r, _ in part),
                                  part[0][1], label, versions))
    return out


def reference_price(policy, prices: dict[str, ApiPrice]) -> ApiPrice | None:
    """The API the all-API scenario is priced at: the first route's counterfactual with a price, else the
    first priced API backend."""
    for route in policy.routes.values():
        spec = policy.counterfactual_spec(route)
        if spec is not None and spec.name in prices:
            return prices[spec.name]
    return next(iter(prices.values()), None)


def standing(result: DecisionResult, utilisation: float | None) -> str:
    """Where this deployment stands, in one sentence: the reports' headline."""
    be = result.break_even_utilisation
    if be is None:
        return "not enough measurements to compare hosting with the API"
    if be > 1.0:
        return (f"hosting cannot beat the API at the measured throughput even fully busy (break-even would be "
                f"{be:.0%}: it needs {be:.1f}x the tokens per device-dollar)")
    if utilisation is None:
        return f"hosting wins above {be:.1%} utilisation (utilisation not measured yet)"
    side = "hosting is cheaper" if utilisation >= be else "the API is cheaper"
    return f"{side}: utilisation {utilisation:.1%} against a break-even of {be:.1%}"
