"""What a request cost: API prices from litellm's bundled map (overridable per backend), GPU-amortised
cost for the in-house engine, the API counterfactual, and the worst-case estimate budgets reserve.

One source of truth: every price comes from `litellm.model_cost`, loaded from the copy bundled with
litellm (`LITELLM_LOCAL_MODEL_COST_MAP=True`, set in gateway/__init__.py), never fetched at run time.
"""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from gateway.backends.base import Usage
    from gateway.ledger.record import LedgerRecord
    from gateway.policy import BackendSpec, Policy, RouteSpec

# A GPU that is busy 2% of the time would otherwise charge each request 50× its device time.
UTILISATION_FLOOR = 0.05
# A request without max tokens, on a backend whose output limit is unknown, reserves as if it asked for this
# many per output when the policy sets no `budgets.unpriced_reservation_usd` (gateway/budgets.py).
DEFAULT_MAX_TOKENS_ESTIMATE = 4096
# Budget reservation for engine backends without `reserve_usd_per_mtok`: USD per million tokens
# (prompt + max_tokens). Deliberately above what a busy small model costs on one GPU (well under $1/Mtok
# at a few thousand tokens/s and $2-4/GPU-hour), so reservations rarely undershoot the settled cost.
DEFAULT_ENGINE_RESERVE_USD_PER_MTOK = 10.0
_PER_MTOK = 1e-6


@dataclass(slots=True, frozen=True)
class Prices:
    input_per_token: float
    output_per_token: float
    cached_input_per_token: float


@dataclass(slots=True)
class Cost:
    input_usd: float
    output_usd: float
    total_usd: float
    basis: Literal["api_price", "gpu_amortized"]  # gpu_amortized: any in-house device (GPU or CPU host)
    note: str | None = None  # why the cost is $0 or estimated (the ledger's cost_note); None when plain
    cache_savings_usd: float | None = None  # API rows: cached prompt tokens × (input − cached price)


# The reasons a ledger row's cost may be $0 or approximate (the `cost_note` column).
NOTE_UNPRICED_MODEL = "unpriced_model"  # litellm has no price for the model and the policy sets none
NOTE_NO_DEVICE_PRICE = "no_device_price"  # an engine backend without gpu_hour_usd / cpu_hour_usd
NOTE_NO_DEVICE_SECONDS = "no_device_seconds"  # the engine reported no device time for the request
NOTE_NO_TOKENS = "no_tokens"  # served, but no tokens were processed
NOTE_DEVICE_SECONDS_ESTIMATED = "device_seconds_estimated"  # client left: device time from the learned rate
NOTE_UTILISATION_FLOOR = "utilisation_floor"  # measured busy fraction below UTILISATION_FLOOR; floor used


def device_hour_usd(spec: BackendSpec) -> float:
    """What an engine backend costs per hour, all its devices together (0 for API backends)."""
    if spec.kind != "engine":
        return 0.0
    if spec.cpu_hour_usd is not None:
        return spec.cpu_hour_usd
    return spec.gpus * spec.gpu_hour_usd


def device_count(spec: BackendSpec) -> int:
    """How many devices device_hour_usd pays for: the GPUs, or one CPU host."""
    return 1 if spec.cpu_hour_usd is not None else spec.gpus


def device_kind(spec: BackendSpec) -> str | None:
    """'cpu' for an engine priced per CPU host, 'gpu' for one priced per GPU, None for API backends."""
    if spec.kind != "engine":
        return None
    return "cpu" if spec.cpu_hour_usd is not None else "gpu"


def _model_cost() -> dict:
    import litellm  # imported lazily (seconds); gateway/__init__.py has already set the no-fetch flag

    return litellm.model_cost


def model_info(model: str) -> dict | None:
    """litellm's map entry for `model` (prices, context size, capabilities), tried as written and without
    its provider prefix; None for a model the map does not know."""
    table = _model_cost()
    entry = table.get(model)
    if entry is None and "/" in model:
        provider, bare = model.split("/", 1)
        candidate = table.get(bare)
        # Only strip the prefix when the bare entry belongs to that provider (openai/gpt-4o-mini → gpt-4o-mini).
        if candidate is not None and candidate.get("litellm_provider") == provider:
            entry = candidate
    return entry


@functools.cache
def _lookup(model: str) -> Prices | None:
    """litellm's price for `model`."""
    entry = model_info(model)
    if entry is None:
        return None
    inp = entry.get("input_cost_per_token")
    out = entry.get("output_cost_per_token")
    if inp is None or out is None:
        return None
    cached = entry.get("cache_read_input_token_cost")
    return Prices(float(inp), float(out), float(cached if cached is not None else inp))


@functools.cache
def _resolve(model: str, inp: float | None, out: float | None, cached: float | None) -> Prices | None:
    base = _lookup(model)
    if base is None and (inp is None or out is None):
        return None  # an unknown model needs both input and output overrides
    i = inp * _PER_MTOK if inp is not None else base.input_per_token
    o = out * _PER_MTOK if out is not None else base.output_per_token
    if cached is not None:
        c = cached * _PER_MTOK
    elif inp is not None or base is None:
        c = i  # overriding the input price without a cached price: cached tokens cost the same
    else:
        c = base.cached_input_per_token
    return Prices(i, o, c)


def prices_for(spec: BackendSpec) -> Prices | None:
    """Per-token prices for a litellm backend (overrides win); None for engine backends and unpriced models."""
    if spec.kind != "litellm":
        return None
    return _resolve(spec.model, spec.input_usd_per_mtok, spec.output_usd_per_mtok, spec.cached_input_usd_per_mtok)


@functools.cache
def price_table_version() -> str:
    """litellm's version plus a short hash of the price map in use, e.g. 'litellm-1.110.2+3fa9c2d1'."""
    from importlib.metadata import version

    digest = hashlib.sha256(json.dumps(_model_cost(), sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"litellm-{version('litellm')}+{digest}"


def api_cost(prices: Prices, usage: Usage) -> Cost:
    """Tokens at the API price; cached prompt tokens at the provider's cached rate."""
    cached = min(max(usage.cached_prompt_tokens, 0), usage.prompt_tokens)
    input_usd = (usage.prompt_tokens - cached) * prices.input_per_token + cached * prices.cached_input_per_token
    output_usd = usage.completion_tokens * prices.output_per_token
    total = input_usd + output_usd
    note = NOTE_NO_TOKENS if total == 0 and usage.prompt_tokens + usage.completion_tokens == 0 else None
    savings = cached * (prices.input_per_token - prices.cached_input_per_token)
    return Cost(input_usd, output_usd, total, "api_price", note, savings)


def request_cost(spec: BackendSpec, usage: Usage, device_seconds: float | None = None,
                 utilisation: float | None = None) -> Cost:
    """The cost of one served request.

    litellm backends: tokens at the API price (cached prompt tokens at the cached rate).
    engine backends: `gpu_amortized` = device_seconds × device_hour_usd / 3600 / max(utilisation, floor),
    where device_hour_usd is gpus × gpu_hour_usd, or a CPU host's cpu_hour_usd. Dividing by the engine's
    measured busy fraction spreads the cost of idle device time over the work done, so a half-idle GPU
    charges each request twice its device time. Unknown utilisation counts as 1.0; unknown device_seconds
    as 0 (callers without the engine's figure should pass the request's wall time instead). The reports
    (gateway/reports/) do not rely on this per-row spread: they charge idle time from the engine's measured
    uptime, as its own line. The total is split between input and output in proportion to prompt vs
    completion tokens: a simple, explainable split (prefill is cheaper per token than decode).
    A $0 cost always carries a note saying why.
    """
    if spec.kind == "litellm":
        prices = prices_for(spec)
        if prices is None:
            return Cost(0.0, 0.0, 0.0, "api_price", NOTE_UNPRICED_MODEL)
        return api_cost(prices, usage)
    rate = device_hour_usd(spec)
    seconds = max(device_seconds or 0.0, 0.0)
    note = None
    if utilisation is not None and utilisation < UTILISATION_FLOOR:
        note = NOTE_UTILISATION_FLOOR
    util = 1.0 if utilisation is None else min(max(utilisation, UTILISATION_FLOOR), 1.0)
    total = seconds * rate / 3600.0 / util
    tokens = usage.prompt_tokens + usage.completion_tokens
    if total == 0:
        note = (NOTE_NO_DEVICE_PRICE if rate == 0 else NOTE_NO_DEVICE_SECONDS if device_seconds is None
                else NOTE_NO_TOKENS if tokens == 0 else NOTE_NO_DEVICE_SECONDS)
    input_usd = total * usage.prompt_tokens / tokens if tokens else 0.0
    return Cost(input_usd, total - input_usd, total, "gpu_amortized", note)


def busy_cost(spec: BackendSpec, device_seconds: float | None) -> float | None:
    """An engine request's device-seconds at the list rate (device_hour_usd / 3600), with no share of idle:
    the stable chargeback figure, the same for the same work whatever the engine's utilisation at the time
    (`cost_usd` divides it by the utilisation). None for API backends and when the device time is unknown."""
    if spec.kind != "engine" or device_seconds is None:
        return None
    return max(device_seconds, 0.0) * device_hour_usd(spec) / 3600.0


def charge(record: LedgerRecord, spec: BackendSpec, usage: Usage, device_seconds: float | None,
           utilisation: float | None, policy: Policy, route: RouteSpec, *, estimated: bool = False,
           reported_kind: str | None = None) -> None:
    """Fill a ledger row's token counts and cost columns for a request `spec` served with `usage`.

    `estimated`: device_seconds is the learned per-token rate's estimate, not the engine's figure.
    `reported_kind`: the device kind the engine itself reports (its /metrics); the policy's price field
    (cpu_hour_usd or gpu_hour_usd) only says how it is priced, so it is the fallback."""
    cost = request_cost(spec, usage, device_seconds, utilisation)
    record.prompt_tokens = usage.prompt_tokens
    record.cached_prompt_tokens = usage.cached_prompt_tokens
    record.kv_restored_host_tokens = usage.restored_host_tokens  # engine KV tiers (already in cached)
    record.kv_restored_disk_tokens = usage.restored_disk_tokens
    record.completion_tokens = usage.completion_tokens
    record.input_cost_usd, record.output_cost_usd = cost.input_usd, cost.output_usd
    record.cost_usd, record.cost_basis = cost.total_usd, cost.basis
    record.cost_note = NOTE_DEVICE_SECONDS_ESTIMATED if estimated and cost.total_usd > 0 else cost.note
    record.cache_savings_usd = cost.cache_savings_usd
    if spec.kind == "engine":
        record.gpu_seconds = device_seconds
        record.device_hour_usd, record.device_kind = device_hour_usd(spec), reported_kind or device_kind(spec)
        record.utilisation = utilisation
        record.busy_cost_usd = busy_cost(spec, device_seconds)
    else:
        record.gpu_seconds = None
        record.busy_cost_usd = None
    record.counterfactual_cost_usd = counterfactual_cost(policy, route, usage)
    record.price_table_version = price_table_version()


def counterfactual_cost(policy: Policy, route: RouteSpec, usage: Usage) -> float | None:
    """What the route's API alternative would have charged for the same tokens (None if it has none)."""
    spec = policy.counterfactual_spec(route)
    if spec is None:
        return None
    prices = prices_for(spec)
    return api_cost(prices, usage).total_usd if prices is not None else None


# --------------------------------------------------------------- the worst case budgets reserve


@dataclass(slots=True, frozen=True)
class TokenDemand:
    """The most a request may make a backend process, from its body (gateway/admission.py `token_demand`)."""

    prompt_tokens: int  # every prompt's tokens, each prompt once (what APIs bill)
    choices: int = 1  # outputs generated per prompt: the larger of n and best_of
    prompts: int = 1  # prompts in the request (a completions list of prompts)
    max_tokens: int | None = None  # per output; None: the request sets no bound the upstream must honour
    outputs: bool = True  # False for embeddings (no output tokens)

    @property
    def sequences(self) -> int:
        return self.prompts * self.choices if self.outputs else 0


@dataclass(slots=True, frozen=True)
class WorstCase:
    """What a request may cost over its chain, and why that cannot be known (both empty: it can)."""

    priced_usd: float  # the most any backend that can be priced may charge
    estimate_usd: float  # priced_usd, with the unpriced backends guessed (unpriced API models $0, 4096 tokens)
    unpriced: tuple[str, ...] = ()  # backends the ledger would log at $0 for want of a price
    unbounded: tuple[str, ...] = ()  # no max tokens, and a backend whose output limit is unknown

    @property
    def priceable(self) -> bool:
        return not self.unpriced and not self.unbounded


def output_limit(spec: BackendSpec) -> int | None:
    """The most output tokens one choice may run to on `spec` when the request sets no max: litellm's
    `max_output_tokens` for the model, else the context the policy declares (capabilities.max_context)."""
    declared = spec.capabilities.max_context if spec.capabilities is not None else None
    return _output_limit(spec.kind, spec.model, declared)


@functools.cache
def _output_limit(kind: str, model: str, declared: int | None) -> int | None:
    if kind == "litellm":
        info = model_info(model) or {}
        known = info.get("max_output_tokens") or info.get("max_tokens")
        if isinstance(known, int) and known > 0:
            return known
    return declared


def _backend_worst(spec: BackendSpec, demand: TokenDemand) -> tuple[float, str | None, str | None]:
    """(USD, why it has no price, why its output is unbounded) for one backend; the reasons are None when not so.

    API backends: every prompt token uncached at the input price, plus every output at max tokens at the output
    price. Engine backends: (prompt tokens × choices + outputs × max tokens) × `reserve_usd_per_mtok` (default
    DEFAULT_ENGINE_RESERVE_USD_PER_MTOK; device time is only known afterwards, and each choice may prefill)."""
    bound = demand.max_tokens if demand.max_tokens is not None else output_limit(spec)
    outputs = demand.sequences * (DEFAULT_MAX_TOKENS_ESTIMATE if bound is None else bound)
    unbounded = f"the request sets no max tokens and backend '{spec.name}' has no known output limit" \
        if demand.sequences and bound is None else None
    if spec.kind == "litellm":
        prices = prices_for(spec)
        if prices is None:
            return 0.0, f"backend '{spec.name}' has no price for '{spec.model}'", None
        return demand.prompt_tokens * prices.input_per_token + outputs * prices.output_per_token, None, unbounded
    rate = spec.reserve_usd_per_mtok
    usd = (demand.prompt_tokens * demand.choices + outputs) * \
        (DEFAULT_ENGINE_RESERVE_USD_PER_MTOK if rate is None else rate) * _PER_MTOK
    unpriced = None if device_hour_usd(spec) else f"engine backend '{spec.name}' has no device price"
    return usd, unpriced, unbounded


def worst_case(chain: list[BackendSpec], demand: TokenDemand) -> WorstCase:
    """The worst-case cost over every backend the request may reach, for budget reservation at admission."""
    priced = estimate = 0.0
    unpriced: list[str] = []
    unbounded: list[str] = []
    for spec in chain:
        usd, no_price, no_bound = _backend_worst(spec, demand)
        estimate = max(estimate, usd)
        if no_price is None and no_bound is None:
            priced = max(priced, usd)
        unpriced += [no_price] if no_price else []
        unbounded += [no_bound] if no_bound else []
    return WorstCase(priced, estimate, tuple(unpriced), tuple(unbounded))


def max_cost_estimate(policy: Policy, chain: list[BackendSpec], prompt_tokens: int, max_tokens: int) -> float:
    """The worst case of one prompt, one choice and `max_tokens`, unpriced backends guessed (see worst_case)."""
    return worst_case(chain, TokenDemand(prompt_tokens, max_tokens=max_tokens)).estimate_usd
