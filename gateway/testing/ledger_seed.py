"""A deterministic synthetic ledger for tests and benchmarks: `seed(url, rows=…, days=…)`.

What it writes (the same `seed` value always writes the same rows):

- `requests` rows over `days` UTC days from `start` (default 2025-03-01), with a weekly shape (weekends
  quieter) and a diurnal one (busiest mid-afternoon UTC), for six teams and five routes:
  `auto` (difficulty route: route_reason difficulty / spillover / fallback), `local` (fixed, falls back to
  the API), `cpu-small`, `gpt-4o-mini` and `claude` (fixed), plus a trickle through `experimental`.
- two engine backends, `local-gpu` (2 GPUs at $2.50 each: $5.00/h, device_kind gpu) and `local-cpu` (a
  $0.40/h CPU host, device_kind cpu): cost_basis gpu_amortized, gpu_seconds, device_hour_usd, device_kind,
  utilisation (the minute's measured busy fraction), cost_usd = gpu_seconds × $/h / 3600 / max(u, 0.05),
  busy_cost_usd = gpu_seconds × $/h / 3600 (the list rate), and the route's API counterfactual.
- `policy_versions`: the texts of the two policy versions the rows record (POLICY_TEXTS), so the reports
  price the seeded rows by the policy that "served" them.
- two priced API backends, `openai-mini` and `claude-sonnet` (prices in POLICY_YAML): cost_basis api_price,
  cached prompt tokens at the cached rate with cache_savings_usd, price_table_version; and an unpriced
  one, `experimental`, whose rows cost $0 with cost_note 'unpriced_model'.
- a few error, client_closed (engine rows: cost_note 'device_seconds_estimated') and rejected rows, a few
  served rows with no tokens ($0, cost_note 'no_tokens') and utilisation_floor rows: no served row costs $0
  without a cost_note.
- `engine_uptime`: one row per engine per minute over the whole span; busy_seconds ≤ seconds and busy ≥
  the minute's attributed gpu_seconds (the engine also does work no request is charged for).

Fast: numpy draws, chunked executemany (SQLite, one transaction per chunk) or COPY (PostgreSQL).
"""
from __future__ import annotations

import hashlib
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import numpy as np
import sqlalchemy as sa

from gateway.ledger.models import EngineUptimeRow, PolicyVersionRow, RequestRow

DEFAULT_START = datetime(2025, 3, 1, tzinfo=UTC)
TEAMS = ("labs", "search", "support", "growth", "finance", "ops")
TEAM_WEIGHTS = (0.28, 0.24, 0.18, 0.14, 0.10, 0.06)

# Backends: engines (hourly price of all devices, devices, kind) and APIs (USD per Mtok: input, cached, output).
ENGINES = {"local-gpu": (5.00, 2, "gpu"), "local-cpu": (0.40, 1, "cpu")}
APIS = {"openai-mini": ("openai/gpt-4o-mini", 0.15, 0.075, 0.60),
        "claude-sonnet": ("anthropic/claude-sonnet-4", 3.00, 0.30, 15.00)}
UNPRICED = "experimental"
UNPRICED_MODEL = "acme/experimental-1"
# Engine device seconds per token (prefill of uncached prompt tokens, decode), batched.
ENGINE_SECONDS_PER_TOKEN = {"local-gpu": (1 / 4000, 1 / 120), "local-cpu": (1 / 600, 1 / 25)}
UTILISATION_FLOOR = 0.05  # gateway/pricing.py's floor
THRESHOLD = 0.6
PRICE_TABLE_VERSIONS = ("litellm-1.74.0+3fa9c2d1", "litellm-1.75.2+8b1e44a0")  # the map changed mid-span

# The policy the seeded ledger was "served" under (prices for decision.py; never served for real).
POLICY_YAML = """\
backends:
  local-gpu:
    kind: engine
    model: local
    api_base: http://127.0.0.1:9
    gpu_hour_usd: 2.50
    gpus: 2
  local-cpu:
    kind: engine
    model: small
    api_base: http://127.0.0.1:9
    cpu_hour_usd: 0.40
  openai-mini:
    kind: litellm
    model: openai/gpt-4o-mini
    input_usd_per_mtok: 0.15
    cached_input_usd_per_mtok: 0.075
    output_usd_per_mtok: 0.60
  claude-sonnet:
    kind: litellm
    model: anthropic/claude-sonnet-4
    input_usd_per_mtok: 3.00
    cached_input_usd_per_mtok: 0.30
    output_usd_per_mtok: 15.00
  experimental:
    kind: litellm
    model: acme/experimental-1
routes:
  auto:
    strategy: difficulty
    easy: local-gpu
    hard: claude-sonnet
    threshold: 0.6
    fallbacks: [openai-mini]
    counterfactual: claude-sonnet
  local:
    strategy: fixed
    backend: local-gpu
    fallbacks: [openai-mini]
    counterfactual: openai-mini
  cpu-small:
    strategy: fixed
    backend: local-cpu
    counterfactual: openai-mini
  gpt-4o-mini:
    strategy: fixed
    backend: openai-mini
  claude:
    strategy: fixed
    backend: claude-sonnet
  experimental:
    strategy: fixed
    backend: experimental
"""

# The ledger spans two policy versions (the first with a comment line more, the same prices), stored in
# `policy_versions` as the gateway stores each version it loads: the reports price each row by its own.
POLICY_TEXTS = ("# the seeded ledger's first policy version\n" + POLICY_YAML, POLICY_YAML)
POLICY_VERSIONS = tuple(hashlib.sha256(t.encode("utf-8")).hexdigest()[:16] for t in POLICY_TEXTS)

# Routes: name, share of traffic, requested model, counterfactual API backend (or None).
ROUTES = (("auto", 0.34, "auto", "claude-sonnet"), ("local", 0.20, "local", "openai-mini"),
          ("cpu-small", 0.08, "small", "openai-mini"), ("gpt-4o-mini", 0.24, "gpt-4o-mini", None),
          ("claude", 0.138, "claude", None), ("experimental", 0.002, "experimental-1", None))
BACKENDS = ("local-gpu", "local-cpu", "openai-mini", "claude-sonnet", UNPRICED)
SERVED_MODEL = {"local-gpu": "local", "local-cpu": "small", "openai-mini": "gpt-4o-mini",
                "claude-sonnet": "claude-sonnet-4", UNPRICED: "experimental-1"}

_REQUEST_COLUMNS = (
    "request_id", "created_at", "api_key_id", "team", "endpoint", "requested_model", "route", "backend",
    "served_model", "stream", "prompt_tokens", "cached_prompt_tokens", "completion_tokens", "input_cost_usd",
    "output_cost_usd", "cost_usd", "cost_basis", "gpu_seconds", "counterfactual_cost_usd", "ttft_ms",
    "latency_ms", "status", "error_type", "http_status", "attempts", "policy_version", "price_table_version",
    "difficulty", "threshold", "route_reason", "device_hour_usd", "device_kind", "utilisation", "cost_note",
    "cache_savings_usd", "busy_cost_usd",
)
_UPTIME_COLUMNS = ("interval_id", "created_at", "backend", "seconds", "busy_seconds", "device_hour_usd", "devices",
                   "device_kind")


@dataclass(slots=True)
class SeedStats:
    dialect: str
    rows: int
    uptime_rows: int
    first: datetime | None
    last: datetime | None
    seconds: float  # wall time of the whole seed (generation + load)
    generate_seconds: float
    load_seconds: float
    by_backend: dict[str, int] = field(default_factory=dict)
    by_status: dict[str, int] = field(default_factory=dict)
    by_note: dict[str, int] = field(default_factory=dict)

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0


def policy():
    """The seeded ledger's policy (gateway.policy.Policy): its prices are the ones the rows were costed at."""
    from gateway.policy import parse_policy

    return parse_policy(POLICY_YAML, "ledger_seed.POLICY_YAML")


# --------------------------------------------------------------------------------------------- generation


def _stamp(epoch_us: np.ndarray) -> list[str]:
    """Microseconds since the epoch → 'YYYY-MM-DD HH:MM:SS.ffffff' (UTC), SQLAlchemy's SQLite storage format."""
    text = np.datetime_as_string(epoch_us.astype("datetime64[us]"), unit="us")
    return np.char.replace(text, "T", " ").tolist()


class Column:
    """One column of the seeded ledger, turned into Python values a chunk at a time (bounded memory)."""

    __slots__ = ("convert", "present", "values")

    def __init__(self, values, present: np.ndarray | None = None, convert=None) -> None:
        self.values, self.present, self.convert = values, present, convert

    def __len__(self) -> int:
        return len(self.values)

    def slice(self, lo: int, hi: int) -> list:
        v = self.values[lo:hi]
        out = self.convert(v) if self.convert is not None else v.tolist()
        if self.present is not None:
            for i in np.flatnonzero(~self.present[lo:hi]).tolist():
                out[i] = None
        return out

    def all(self) -> list:
        return self.slice(0, len(self))


def _pick(names, codes: np.ndarray, present: np.ndarray | None = None) -> Column:
    table = np.array(list(names), dtype=object)
    return Column(codes, present, lambda v: table[v].tolist())


def generate(rows: int, days: int, seed: int = 0, start: datetime | None = None) -> tuple[dict, dict]:
    """The seeded ledger as columns: (requests column → Column, engine_uptime column → Column). Timestamps
    are text in SQLAlchemy's SQLite format (UTC); `Column.all()` gives a column's Python values."""
    if days < 1:
        raise ValueError("days must be ≥ 1")
    start = (start or DEFAULT_START).astimezone(UTC)
    rng = np.random.default_rng(seed)
    n = int(rows)
    minutes = days * 1440
    start_us = int(start.timestamp()) * 1_000_000 + start.microsecond

    # ---- when: a weekly and a diurnal shape, minute by minute
    m = np.arange(minutes)
    weekday = ((start + timedelta(minutes=0)).weekday() + m // 1440) % 7
    day_factor = np.where(weekday >= 5, 0.55, 1.0) * (1.0 + 0.004 * (m // 1440))  # slow growth
    hour = (m % 1440) / 60.0
    hour_factor = 0.25 + np.exp(-0.5 * ((hour - 15.0) / 3.5) ** 2) + 0.35 * np.exp(-0.5 * ((hour - 9.0) / 2.0) ** 2)
    weights = day_factor * hour_factor
    minute = np.sort(rng.choice(minutes, size=n, p=weights / weights.sum()))
    offset_us = minute.astype(np.int64) * 60_000_000 + rng.integers(0, 60_000_000, size=n)
    offset_us.sort()
    minute = offset_us // 60_000_000

    # ---- who and where
    team = rng.choice(len(TEAMS), size=n, p=np.array(TEAM_WEIGHTS) / sum(TEAM_WEIGHTS))
    key_no = rng.integers(0, 3, size=n)
    shares = np.array([r[1] for r in ROUTES])
    route = rng.choice(len(ROUTES), size=n, p=shares / shares.sum())
    b_gpu, b_cpu, b_mini, b_claude, b_unpriced = range(5)
    backend = np.array([b_gpu, b_gpu, b_cpu, b_mini, b_claude, b_unpriced])[route]
    reason = np.full(n, 0)  # 0 fixed, 1 difficulty, 2 fallback, 3 spillover
    u = rng.random(n)
    auto = route == 0
    difficulty = np.round(rng.beta(2.0, 3.0, size=n), 6)
    reason[auto] = 1
    backend[auto] = np.where(difficulty[auto] < THRESHOLD, b_gpu, b_claude)
    spill = auto & (backend == b_gpu) & (u < 0.05)
    backend[spill], reason[spill] = b_claude, 3
    fallback = ((route == 0) | (route == 1)) & (u > 0.98)
    backend[fallback], reason[fallback] = b_mini, 2

    # ---- how it ended
    s = rng.random(n)
    status = np.select([s < 0.015, s < 0.025, s < 0.030], [1, 2, 3], 0)  # 0 ok, 1 error, 2 client_closed, 3 rejected
    routed = status != 3
    served = (status == 0) | (status == 2)
    is_engine = routed & (backend <= b_cpu)
    is_api = routed & (backend >= b_mini)

    # ---- tokens
    prompt = np.clip(np.round(rng.lognormal(6.3, 1.0, size=n)), 8, 32000).astype(np.int64)
    completion = np.clip(np.round(rng.lognormal(5.0, 0.8, size=n)), 1, 4096).astype(np.int64)
    completion = np.where(status == 2, np.maximum(completion // 3, 1), completion)
    no_tokens = (status == 0) & (rng.random(n) < 0.0005)
    prompt[no_tokens] = 0
    completion[no_tokens] = 0
    completion[~served] = 0
    prompt[~served] = 0
    cache_hit = rng.random(n)
    frac = rng.uniform(0.2, 0.9, size=n)
    cached = np.zeros(n, dtype=np.int64)
    eng_hit = is_engine & (cache_hit < 0.45)
    cached[eng_hit] = np.floor(prompt[eng_hit] * frac[eng_hit]).astype(np.int64)
    api_hit = is_api & (cache_hit < 0.35) & (prompt >= 1024)
    cached[api_hit] = (np.floor(prompt[api_hit] * frac[api_hit]) // 128 * 128).astype(np.int64)
    cached[~served] = 0

    # ---- engine device seconds, and the engine's minute-by-minute counters
    prefill_s = np.zeros(n)
    decode_s = np.zeros(n)
    for b, name in ((b_gpu, "local-gpu"), (b_cpu, "local-cpu")):
        sel = is_engine & (backend == b)
        p_rate, d_rate = ENGINE_SECONDS_PER_TOKEN[name]
        prefill_s[sel] = (prompt[sel] - cached[sel]) * p_rate
        decode_s[sel] = completion[sel] * d_rate
    gpu_seconds = (prefill_s + decode_s) * rng.uniform(0.8, 1.25, size=n)
    gpu_seconds[no_tokens] = 0.0
    engine_rows = is_engine & served
    up_seconds, busy_seconds = [], []
    utilisation = np.zeros(n)
    minute_start_us = start_us + m.astype(np.int64) * 60_000_000
    for b, name in ((b_gpu, "local-gpu"), (b_cpu, "local-cpu")):
        sel = engine_rows & (backend == b)
        up = np.full(minutes, 60.0)
        short = rng.random(minutes) < 0.002  # a restart: part of the minute down
        up[short] = np.round(rng.uniform(5.0, 55.0, size=int(short.sum())), 3)
        attributed = np.bincount(minute[sel], weights=gpu_seconds[sel], minlength=minutes)
        # Batching gets more efficient under load: a minute never holds more device time than its up time.
        squeeze = np.minimum(1.0, 0.9 * up / np.maximum(attributed, 1e-12))
        gpu_seconds[sel] *= squeeze[minute[sel]]
        attributed = np.bincount(minute[sel], weights=gpu_seconds[sel], minlength=minutes)
        background = rng.uniform(0.05, 0.4, size=minutes)  # health checks, warm-up: busy, charged to nobody
        busy = np.minimum(up, attributed * 1.08 + background)
        busy = np.maximum(busy, np.minimum(attributed, up))
        util = busy / up
        utilisation[sel] = util[minute[sel]]
        up_seconds.append(up)
        busy_seconds.append(busy)

    # ---- costs
    hour_usd = np.array([ENGINES["local-gpu"][0], ENGINES["local-cpu"][0], 0, 0, 0])[backend]
    floor = engine_rows & (utilisation < UTILISATION_FLOOR)
    eng_cost = np.where(engine_rows, gpu_seconds * hour_usd / 3600.0 / np.maximum(utilisation, UTILISATION_FLOOR),
                        0.0)
    price = np.zeros((5, 3))  # input, cached, output per token
    for b, name in ((b_mini, "openai-mini"), (b_claude, "claude-sonnet")):
        _, i, c, o = APIS[name]
        price[b] = (i * 1e-6, c * 1e-6, o * 1e-6)
    pin, pcached, pout = price[backend, 0], price[backend, 1], price[backend, 2]
    api_rows = is_api & served
    api_in = np.where(api_rows, (prompt - cached) * pin + cached * pcached, 0.0)
    api_out = np.where(api_rows, completion * pout, 0.0)
    tokens = prompt + completion
    eng_in = np.where(tokens > 0, eng_cost * prompt / np.maximum(tokens, 1), 0.0)
    input_cost = np.where(engine_rows, eng_in, api_in)
    output_cost = np.where(engine_rows, eng_cost - eng_in, api_out)
    cost = np.where(engine_rows, eng_cost, api_in + api_out)
    cost[~served] = 0.0
    input_cost[~served] = 0.0
    output_cost[~served] = 0.0
    cache_savings = cached * (pin - pcached)
    has_savings = api_rows & (backend != b_unpriced)
    # The route's API alternative, for served rows of routes that name one.
    cf_backend = np.array([b_claude, b_mini, b_mini, -1, -1, -1])[route]
    cf_price = price[np.maximum(cf_backend, 0)]
    counterfactual = (prompt - cached) * cf_price[:, 0] + cached * cf_price[:, 1] + completion * cf_price[:, 2]
    has_cf = served & (cf_backend >= 0)

    # ---- notes: every served row at $0 says why
    note = np.full(n, -1)  # index into NOTES
    notes = ("unpriced_model", "no_tokens", "device_seconds_estimated", "utilisation_floor")
    note[floor] = 3
    note[engine_rows & (status == 2) & (cost > 0)] = 2
    note[served & (backend == b_unpriced)] = 0
    note[no_tokens] = 1

    # ---- latencies
    ttft = np.round(np.where(backend <= b_cpu, 40.0, 250.0) * rng.lognormal(0, 0.5, size=n), 3)
    latency = np.round(ttft + completion * np.where(backend <= b_cpu, 12.0, 25.0) * rng.lognormal(0, 0.3, size=n)
                       + 5.0, 3)
    latency[status == 3] = 1.0
    has_ttft = served & (completion > 0)

    epoch_us = start_us + offset_us
    late = (epoch_us >= start_us + days * 43_200_000_000).astype(np.int64)
    http = np.array([200, 502, 499, 429])[status]
    N = Column
    req = {
        "request_id": N(np.arange(n), convert=lambda v: [f"seed{seed}-{i:08d}" for i in v.tolist()]),
        "created_at": N(epoch_us, convert=_stamp),
        "api_key_id": _pick([f"key_{t}_{k}" for t in TEAMS for k in range(3)], team * 3 + key_no),
        "team": _pick(TEAMS, team),
        "endpoint": _pick(("chat.completions", "completions"), (rng.random(n) >= 0.9).astype(np.int64)),
        "requested_model": _pick([r[2] for r in ROUTES], route),
        "route": _pick([r[0] for r in ROUTES], route),
        "backend": _pick(BACKENDS, backend, routed),
        "served_model": _pick([SERVED_MODEL[b] for b in BACKENDS], backend, served),
        "stream": N(rng.random(n) < 0.6),
        "prompt_tokens": N(prompt),
        "cached_prompt_tokens": N(cached),
        "completion_tokens": N(completion),
        "input_cost_usd": N(input_cost),
        "output_cost_usd": N(output_cost),
        "cost_usd": N(cost),
        "cost_basis": _pick(("gpu_amortized", "api_price"), np.where(backend <= b_cpu, 0, 1), served),
        "gpu_seconds": N(gpu_seconds, engine_rows),
        "counterfactual_cost_usd": N(counterfactual, has_cf),
        "ttft_ms": N(ttft, has_ttft),
        "latency_ms": N(latency),
        "status": _pick(("ok", "error", "client_closed", "rejected"), status),
        "error_type": _pick(("", "upstream_5xx", "", "rate_limited"), status, (status == 1) | (status == 3)),
        "http_status": N(http),
        "attempts": N(np.where(reason == 2, 2, 1)),
        "policy_version": _pick(POLICY_VERSIONS, late),
        "price_table_version": _pick(PRICE_TABLE_VERSIONS, late, served),
        "difficulty": N(difficulty, auto & routed),
        "threshold": N(np.full(n, THRESHOLD), auto & routed),
        "route_reason": _pick(("fixed", "difficulty", "fallback", "spillover"), reason, routed),
        "device_hour_usd": N(hour_usd, engine_rows),
        "device_kind": _pick(("gpu", "cpu"), np.minimum(backend, 1), engine_rows),
        "utilisation": N(np.round(utilisation, 6), engine_rows),
        "cost_note": _pick(notes, np.maximum(note, 0), note >= 0),
        "cache_savings_usd": N(cache_savings, has_savings),
        "busy_cost_usd": N(gpu_seconds * hour_usd / 3600.0, engine_rows),
    }
    up_backend = np.repeat(np.arange(2), minutes)
    up_minute = np.tile(minute_start_us, 2)
    names = ("local-gpu", "local-cpu")
    uptime = {
        "interval_id": N(np.arange(2 * minutes), convert=lambda v: [
            f"{names[i // minutes]}|{t}|seed{seed}" for i, t in zip(v.tolist(), _stamp(up_minute[v]), strict=True)]),
        "created_at": N(up_minute, convert=_stamp),
        "backend": _pick(names, up_backend),
        "seconds": N(np.concatenate(up_seconds)),
        "busy_seconds": N(np.round(np.concatenate(busy_seconds), 6)),
        "device_hour_usd": N(np.array([ENGINES[b][0] for b in names])[up_backend]),
        "devices": N(np.array([ENGINES[b][1] for b in names])[up_backend]),
        "device_kind": _pick([ENGINES[b][2] for b in names], up_backend),
    }
    return req, uptime


# --------------------------------------------------------------------------------------------- loading


def _columns_of(table: sa.Table, wanted: tuple[str, ...]) -> tuple[str, ...]:
    names = set(table.columns.keys())
    missing = [c for c in wanted if c not in names]
    if missing:
        raise RuntimeError(f"{table.name} has no column(s) {missing}: the seeder is out of date with models.py")
    return wanted


def _rows(cols: dict[str, Column], names: tuple[str, ...], lo: int, hi: int) -> list[tuple]:
    return list(zip(*(cols[c].slice(lo, hi) for c in names), strict=True))


def _load_sqlite(engine: sa.Engine, table: sa.Table, cols: dict, names: tuple, chunk: int, progress) -> None:
    total = len(cols[names[0]])
    if total == 0:
        return
    sql = f"INSERT INTO {table.name} ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})"
    for lo in range(0, total, chunk):
        hi = min(lo + chunk, total)
        with engine.begin() as conn:
            conn.exec_driver_sql(sql, _rows(cols, names, lo, hi))
        progress(table.name, hi, total)


def _load_postgresql(engine: sa.Engine, table: sa.Table, cols: dict, names: tuple, chunk: int, progress) -> None:
    total = len(cols[names[0]])
    if total == 0:
        return
    timestamp = names.index("created_at")
    for lo in range(0, total, chunk):
        hi = min(lo + chunk, total)
        raw = engine.raw_connection()
        try:
            cur = raw.driver_connection.cursor()
            with cur.copy(f"COPY {table.name} ({', '.join(names)}) FROM STDIN") as copy:
                for row in _rows(cols, names, lo, hi):
                    row = list(row)
                    row[timestamp] += "+00"
                    copy.write_row(row)
            raw.driver_connection.commit()
        finally:
            raw.close()
        progress(table.name, hi, total)


def _store_policies(engine: sa.Engine, at: datetime) -> None:
    """The seeded policy versions' texts, insert-if-absent (a second seed into the same database shares them)."""
    table = PolicyVersionRow.__table__
    with engine.begin() as conn:
        have = set(conn.execute(sa.select(table.c.version)).scalars())
        rows = [{"version": v, "loaded_at": at, "source": "gateway/testing/ledger_seed.py", "text": t}
                for v, t in zip(POLICY_VERSIONS, POLICY_TEXTS, strict=True) if v not in have]
        if rows:
            conn.execute(table.insert(), rows)


def seed(url: str, *, rows: int, days: int, seed: int = 0, progress: bool = False,
         start: datetime | None = None, chunk: int = 50_000) -> SeedStats:
    """Migrate `url` to head and append a synthetic ledger of `rows` requests over `days` days (see the
    module docstring). Deterministic in `seed`; request ids are `seed{seed}-NNNNNNNN`, so seeding twice with
    the same seed into one database fails on the unique request_id."""
    from gateway import db

    t0 = time.perf_counter()
    db.upgrade(url)
    req, up = generate(rows, days, seed, start)
    t1 = time.perf_counter()
    requests_t, uptime_t = RequestRow.__table__, EngineUptimeRow.__table__
    req_names = _columns_of(requests_t, _REQUEST_COLUMNS)
    up_names = _columns_of(uptime_t, _UPTIME_COLUMNS)

    def report(name: str, done: int, total: int) -> None:
        if progress:
            print(f"\r  {name}: {done:,}/{total:,} ({time.perf_counter() - t0:.1f}s)", end="", file=sys.stderr,
                  flush=True)
            if done == total:
                print(file=sys.stderr)

    engine = sa.create_engine(db.sync_url(url))
    try:
        dialect = engine.dialect.name
        if dialect == "sqlite":
            @sa.event.listens_for(engine, "connect")
            def _fast(dbapi_connection, _record) -> None:
                cur = dbapi_connection.cursor()
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute("PRAGMA synchronous=OFF")
                cur.close()

            load = _load_sqlite
        elif dialect == "postgresql":
            load = _load_postgresql
        else:
            raise ValueError(f"the seeder writes SQLite or PostgreSQL, not {dialect}")
        load(engine, requests_t, req, req_names, chunk, report)
        load(engine, uptime_t, up, up_names, chunk, report)
        _store_policies(engine, start or DEFAULT_START)
        if dialect == "postgresql":
            with engine.begin() as conn:
                conn.exec_driver_sql("ANALYZE requests")
                conn.exec_driver_sql("ANALYZE engine_uptime")
    finally:
        engine.dispose()
    t2 = time.perf_counter()

    def count(column: Column) -> dict[str, int]:
        out: dict[str, int] = {}
        for v in column.all():
            if v is not None:
                out[v] = out.get(v, 0) + 1
        return dict(sorted(out.items()))

    stamps = req["created_at"]
    first = datetime.fromisoformat(stamps.slice(0, 1)[0]).replace(tzinfo=UTC) if rows else None
    last = datetime.fromisoformat(stamps.slice(rows - 1, rows)[0]).replace(tzinfo=UTC) if rows else None
    return SeedStats(dialect, int(rows), len(up["backend"]), first, last, t2 - t0, t1 - t0, t2 - t1,
                     count(req["backend"]), count(req["status"]), count(req["cost_note"]))
