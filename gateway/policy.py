"""The routing policy: a YAML file validated into typed models, with errors that name file, field and fix.

The policy is the only routing configuration. `load_policy` reads a file; `parse_policy` validates text;
`cli_check` backs `switchyard policy check FILE`. Validation happens in two passes: pydantic checks shapes,
types and unknown keys; `_check_references` then checks what pydantic cannot see (backend names that must
exist, fields that only make sense for one kind). Every problem is reported with the YAML line it came from.
"""
from __future__ import annotations

import difflib
import hashlib
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

DEFAULT_ENGINE_MODEL_PATH = "hosted/models/demo"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(slots=True)
class PolicyIssue:
    """One problem in a policy file: where it is, what is wrong, how to fix it."""

    source: str
    path: str  # e.g. "routes.gpt-4o-mini.fallbacks[0]"; "" for the whole document
    problem: str
    fix: str
    line: int | None = None
    col: int | None = None

    def __str__(self) -> str:
        where = self.source
        if self.line is not None:
            where += f":{self.line}" + (f":{self.col}" if self.col is not None else "")
        field = f" {self.path}:" if self.path else ""
        return f"{where}:{field} {self.problem}; fix: {self.fix}"


class PolicyError(Exception):
    """A policy file that cannot be used. `str()` lists every problem, one per line."""

    def __init__(self, issues: list[PolicyIssue]):
        self.issues = issues
        head = f"invalid policy ({len(issues)} problem{'s' if len(issues) != 1 else ''}):\n" if len(issues) > 1 else ""
        super().__init__(head + "\n".join(str(i) for i in issues))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BackendSpec(_Strict):
    """Where requests can be sent: the in-house engine or any litellm-supported API."""

    name: str
    kind: Literal["engine", "litellm"]
    model: str = Field(min_length=1)
    api_base: str | None = None
    api_key_env: str | None = None
    # engine only
    launch: Literal["embedded"] | None = None
    engine_model_path: str | None = None
    engine_port: int | None = Field(default=None, ge=1, le=65535)
    engine_args: dict[str, str | int | float] = Field(default_factory=dict)
    gpu_hour_usd: float = Field(default=0.0, ge=0)
    gpus: int = Field(default=1, ge=1)
    # Budget reservation rate for engine backends (USD per million tokens); see gateway/pricing.py.
    reserve_usd_per_mtok: float | None = Field(default=None, ge=0)
    # litellm only: price overrides (USD per million tokens); litellm's bundled map otherwise
    input_usd_per_mtok: float | None = Field(default=None, ge=0)
    output_usd_per_mtok: float | None = Field(default=None, ge=0)
    cached_input_usd_per_mtok: float | None = Field(default=None, ge=0)
    # resilience
    timeout_s: float = Field(default=60.0, gt=0)
    connect_timeout_s: float = Field(default=5.0, gt=0)
    max_retries: int = Field(default=2, ge=0, le=10)
    retry_backoff_s: float = Field(default=0.2, ge=0)
    cooldown_s: float = Field(default=30.0, ge=0)
    failure_threshold: int = Field(default=3, ge=1)
    max_connections: int = Field(default=256, ge=1)


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
    """Read and validate a policy file. Raises PolicyError naming the file, field and fix."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise PolicyError([PolicyIssue(str(p), "", f"cannot read file ({e.strerror or e})",
                                       "check the path given with --policy")]) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PolicyError([PolicyIssue(str(p), "", f"not UTF-8 text ({e.reason} at byte {e.start})",
                                       "save the file as UTF-8")]) from None
    return parse_policy(text, str(p))


def parse_policy(text: str, source: str) -> Policy:
    """Validate policy YAML text; `source` names it in errors (usually the file path)."""
    version = hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
    doc, marks = _read_yaml(text, source)
    issues: list[PolicyIssue] = []
    if doc is None:
        raise PolicyError([PolicyIssue(source, "", "the policy is empty",
                                       "add a `backends:` and a `routes:` section (see policies/default.yaml)")])
    if not isinstance(doc, dict):
        raise PolicyError([_at(source, (), marks, f"the top level must be a mapping, got {_typename(doc)}",
                               "start the file with `backends:` and `routes:` sections")])
    for reserved in ("version", "source"):
        if reserved in doc:
            issues.append(_at(source, (reserved,), marks, f"'{reserved}' is computed, not written",
                              f"remove the `{reserved}:` key"))
    if issues:
        raise PolicyError(issues)
    # Top-level `x-…` keys hold shared YAML anchors (as in docker compose); they are not settings.
    doc = _with_names({k: v for k, v in doc.items() if not (isinstance(k, str) and k.startswith("x-"))})
    try:
        policy = Policy.model_validate({**doc, "version": version, "source": source})
    except ValidationError as e:
        raise PolicyError([_from_pydantic(err, source, marks) for err in e.errors()]) from None
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


# ---------------------------------------------------------------- YAML with line numbers


class _Loader(yaml.SafeLoader):
    pass


def _read_yaml(text: str, source: str) -> tuple[Any, dict[tuple, tuple[int, int]]]:
    """Parse YAML and remember where every key and item starts (1-based line, column)."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, {}
        marks: dict[tuple, tuple[int, int]] = {}
        dupes: list[PolicyIssue] = []
        _index(node, (), marks, dupes, source)
        if dupes:
            raise PolicyError(dupes)
        return loader.construct_document(node), marks
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        problem = ": ".join(x for x in (e.context, e.problem) if x) or "invalid YAML"
        raise PolicyError([PolicyIssue(source, "", f"YAML syntax error: {problem}",
                                       "fix the indentation/quoting at this position",
                                       mark.line + 1 if mark else None,
                                       mark.column + 1 if mark else None)]) from None
    except yaml.YAMLError as e:
        raise PolicyError([PolicyIssue(source, "", f"YAML error: {e}", "fix the YAML syntax")]) from None
    finally:
        loader.dispose()


def _index(node: yaml.Node, path: tuple, marks: dict, dupes: list[PolicyIssue], source: str,
           active: frozenset = frozenset()) -> None:
    marks.setdefault(path, (node.start_mark.line + 1, node.start_mark.column + 1))
    if id(node) in active:  # a recursive alias (&a [*a]); pydantic will reject the value itself
        return
    active = active | {id(node)}
    if isinstance(node, yaml.MappingNode):
        seen: set = set()
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            kpath = path + (key,)
            if key in seen:
                dupes.append(PolicyIssue(source, _fmt_path(kpath), f"duplicate key '{key}'",
                                         "keep only one entry with this name",
                                         key_node.start_mark.line + 1, key_node.start_mark.column + 1))
            seen.add(key)
            marks[kpath] = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
            _index(value_node, kpath, marks, dupes, source, active)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _index(item, path + (i,), marks, dupes, source, active)


# ---------------------------------------------------------------- error reporting


def _fmt_path(path: Iterable) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _at(source: str, path: tuple, marks: dict, problem: str, fix: str) -> PolicyIssue:
    line = col = None
    for n in range(len(path), -1, -1):  # the deepest part of the path that exists in the file
        if path[:n] in marks:
            line, col = marks[path[:n]]
            break
    return PolicyIssue(source, _fmt_path(path), problem, fix, line, col)


def _suggest(word: str, options: Iterable[str]) -> str | None:
    match = difflib.get_close_matches(str(word), list(options), n=1, cutoff=0.6)
    return match[0] if match else None


_SECTION_MODELS: dict[str, type[BaseModel]] = {"backends": BackendSpec, "routes": RouteSpec}


_ROUTE_SETTINGS: dict[str, type[BaseModel]] = {"spillover": SpilloverSpec, "idle": IdleSpec, "shadow": ShadowSpec}


def _model_at(loc: tuple) -> type[BaseModel]:
    """Which model a pydantic error location points into (for listing allowed fields)."""
    if len(loc) >= 4 and loc[0] == "routes" and loc[2] in _ROUTE_SETTINGS:
        return _ROUTE_SETTINGS[loc[2]]
    if len(loc) >= 3 and loc[0] in _SECTION_MODELS:
        return _SECTION_MODELS[loc[0]]
    return Policy


def _allowed_fields(model: type[BaseModel]) -> list[str]:
    hidden = {"name", "version", "source"}
    return [f for f in model.model_fields if f not in hidden]


def _from_pydantic(err: dict, source: str, marks: dict) -> PolicyIssue:
    loc = tuple(err["loc"])
    kind = err["type"]
    value = err.get("input")
    if kind == "extra_forbidden":
        allowed = _allowed_fields(_model_at(loc))
        guess = _suggest(loc[-1], allowed)
        fix = f"did you mean '{guess}'?" if guess else f"remove it; allowed fields: {', '.join(allowed)}"
        return _at(source, loc, marks, f"unknown field '{loc[-1]}'", fix)
    if kind == "missing":
        what = {"backends": "a `backends:` section", "routes": "a `routes:` section"}.get(loc[-1], f"`{loc[-1]}:`")
        return _at(source, loc, marks, f"missing required field '{loc[-1]}'", f"add {what}")
    if kind == "literal_error":
        expected = re.findall(r"'([^']*)'", err.get("ctx", {}).get("expected", ""))
        guess = _suggest(str(value), expected)
        fix = f"use one of: {', '.join(expected)}" + (f" (did you mean '{guess}'?)" if guess else "")
        return _at(source, loc, marks, f"invalid value {value!r}", fix)
    if kind in ("dict_type", "model_type") and value is None:
        return _at(source, loc, marks, "the section is empty", "add entries under it, or remove the key")
    if kind in ("dict_type", "model_type"):
        return _at(source, loc, marks, f"expected a mapping of `key: value` lines, got {_typename(value)}",
                   "indent the fields under this key")
    if kind == "list_type":
        return _at(source, loc, marks, f"expected a list, got {_typename(value)}",
                   f"write it as a list, e.g. [{value}]" if isinstance(value, str) else "write it as [a, b]")
    msg = err["msg"].removeprefix("Value error, ")
    return _at(source, loc, marks, f"{msg} (got {value!r})", "change the value to one that fits")


def _typename(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", int: "a number", float: "a number",
            bool: "true/false", type(None): "nothing"}.get(type(value), type(value).__name__)


# ---------------------------------------------------------------- cross-field checks


def _check_references(policy: Policy, source: str, marks: dict) -> list[PolicyIssue]:
    issues: list[PolicyIssue] = []
    known = list(policy.backends)

    def add(path: tuple, problem: str, fix: str) -> None:
        issues.append(_at(source, path, marks, problem, fix))

    def check_ref(path: tuple, name: str | None) -> bool:
        if name is None or name in policy.backends:
            return True
        guess = _suggest(name, known)
        fix = (f"did you mean '{guess}'? " if guess else "") + (
            f"known backends: {', '.join(known)}" if known else "define it under `backends:`")
        add(path, f"unknown backend '{name}'", fix)
        return False

    if not policy.backends:
        add(("backends",), "no backends defined", "add at least one backend under `backends:`")
    if not policy.routes:
        add(("routes",), "no routes defined", "add at least one route under `routes:` (the model clients send)")

    for name, b in policy.backends.items():
        p = ("backends", name)
        if b.api_key_env is not None and not _ENV_NAME.match(b.api_key_env):
            add(p + ("api_key_env",), f"'{b.api_key_env}' is not an environment variable name",
                "give the variable's name (e.g. OPENAI_API_KEY), never the key itself")
        if b.api_base is not None and not re.match(r"^https?://", b.api_base):
            add(p + ("api_base",), f"'{b.api_base}' is not an http(s) URL", "write e.g. http://127.0.0.1:8100/v1")
        if b.kind == "engine":
            if b.launch == "embedded" and b.api_base is not None:
                add(p + ("api_base",), "an embedded engine is started by the gateway and has no api_base",
                    "remove `api_base:` (or remove `launch: embedded` to use an engine running elsewhere)")
            if b.launch is None and b.api_base is None:
                add(p, "an engine backend needs either `launch: embedded` or an `api_base`",
                    "add `launch: embedded` or `api_base: http://HOST:PORT/v1`")
            for f in ("input_usd_per_mtok", "output_usd_per_mtok", "cached_input_usd_per_mtok"):
                if getattr(b, f) is not None:
                    add(p + (f,), "per-token prices apply to litellm backends; engine cost is GPU-amortised",
                        "remove it and set `gpu_hour_usd`/`gpus` (or `reserve_usd_per_mtok` for budgets)")
        else:
            engine_only = ("launch", "engine_model_path", "engine_port", "reserve_usd_per_mtok")
            for f in engine_only:
                if getattr(b, f) is not None:
                    add(p + (f,), f"'{f}' applies only to engine backends", "remove it, or set `kind: engine`")
            if b.engine_args:
                add(p + ("engine_args",), "'engine_args' applies only to engine backends", "remove it")
            if b.gpu_hour_usd:
                add(p + ("gpu_hour_usd",), "'gpu_hour_usd' applies only to engine backends",
                    "remove it; API prices come from litellm (override with input_usd_per_mtok/output_usd_per_mtok)")
        if b.kind == "engine" and b.engine_model_path is not None and b.launch != "embedded":
            add(p + ("engine_model_path",), "'engine_model_path' is only used with `launch: embedded`",
                "remove it, or add `launch: embedded`")

    for name, r in policy.routes.items():
        p = ("routes", name)
        if r.strategy == "fixed":
            if r.backend is None:
                add(p, "missing required field 'backend'", "add `backend: NAME` (one of the backends)")
            for f in ("easy", "hard", "threshold", "model_path", "spillover", "idle", "shadow"):
                if getattr(r, f) is not None:
                    add(p + (f,), f"'{f}' applies only to `strategy: difficulty`",
                        "remove it, or set `strategy: difficulty`")
            if r.budget_downgrade:
                add(p + ("budget_downgrade",), "'budget_downgrade' applies only to `strategy: difficulty`",
                    "remove it, or set `strategy: difficulty`")
        else:
            for f in ("easy", "hard"):
                if getattr(r, f) is None:
                    add(p, f"a difficulty route needs '{f}'", f"add `{f}: BACKEND`")
                else:
                    check_ref(p + (f,), getattr(r, f))
            _check_difficulty_settings(policy, r, p, add)
        check_ref(p + ("backend",), r.backend)
        for i, f in enumerate(r.fallbacks):
            check_ref(p + ("fallbacks", i), f)
            if f == r.backend:
                add(p + ("fallbacks", i), f"'{f}' is the route's own backend", "remove it from fallbacks")
        cf = r.counterfactual
        if cf is not None and check_ref(p + ("counterfactual",), cf) and policy.backends[cf].kind != "litellm":
            add(p + ("counterfactual",), f"'{r.counterfactual}' is an engine backend; the counterfactual "
                    "is what an API would have charged", "name a `kind: litellm` backend")
    return issues


def _check_difficulty_settings(policy: Policy, r: RouteSpec, p: tuple, add) -> None:
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
        guess = _suggest(r.shadow.judge, list(policy.backends))
        add(p + ("shadow", "judge"), f"unknown judge '{r.shadow.judge}'",
            "use `exact` (compare with the reference the client sends in metadata.reference) or a backend "
            "name" + (f" (did you mean '{guess}'?)" if guess else f": {', '.join(policy.backends)}"))


# ---------------------------------------------------------------- CLI


def cli_check(args: Any) -> int:
    """`switchyard policy check FILE`: print a summary and exit 0, or print every problem and exit 1."""
    try:
        policy = load_policy(args.file)
    except PolicyError as e:
        print(f"ERROR: {e}", file=sys.stderr)
        return 1
    print(f"OK: {len(policy.routes)} routes, {len(policy.backends)} backends, version {policy.version}")
    for warning in policy_warnings(policy):
        print(f"warning: {warning}")
    return 0


def policy_warnings(policy: Policy) -> list[str]:
    """Things that are valid but probably not intended (unpriced API models, unset key variables)."""
    import os

    from gateway.pricing import prices_for

    out = []
    for name, b in policy.backends.items():
        if b.kind == "litellm" and prices_for(b) is None:
            out.append(f"{policy.source}: backends.{name}: litellm has no price for '{b.model}'; its requests "
                       "would be logged at $0 — set input_usd_per_mtok and output_usd_per_mtok")
        if b.api_key_env and b.api_key_env not in os.environ:
            out.append(f"{policy.source}: backends.{name}: environment variable {b.api_key_env} is not set "
                       "(requests to this backend will fail until it is)")
    for name, r in policy.routes.items():
        if r.model_path is not None and not Path(r.model_path).is_file():
            out.append(f"{policy.source}: routes.{name}: model_path {r.model_path} is not a file (relative paths "
                       f"are read from {Path.cwd()}); the route sends every request to '{r.backend}' until it is")
    return out
