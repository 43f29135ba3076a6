"""Every number the buy-versus-host reports show, computed once, in SQL, from the ledger.

The spreadsheet, the CSV files, the dashboard's JSON and `report capacity --from-ledger` all read these
functions, so a figure means the same thing everywhere. Definitions (docs/sql-cookbook.md repeats them):

- **paid** device time is an engine's measured up time (`engine_uptime.seconds`, read through the
  `engine_minutes` view, which keeps one recording per engine and minute when several gateways scrape
  the same engine): an engine is paid for while it runs. **busy** time is the engine's own forward-pass
  counter over the same intervals.
  **utilisation** = busy / paid. **cost of idle** = (paid − busy) × the engine's hourly price.
- **charged** is what the ledger rows say the requests cost (`cost_usd`, each row amortised at the busy
  fraction of its moment). It is an estimate per request; the reports' truth is paid time.
- **charged at list rate** (`busy_cost_usd`) is each engine row's device seconds at the engine's hourly
  price, with no share of idle: the same request always costs the same (stable chargeback). The engine's
  **cost of idle** is then allocated as its own line: to teams in proportion to their device seconds.
- The **window** is one span for traffic and engine time alike: from the first request or engine-uptime
  interval to the last (at least a minute). Monthly figures scale everything by 730 h / the window's
  hours; a window shorter than a day is labelled as such (it misses the daily cycle).
- **throughput** is tokens (prompt + completion) per busy second: what the engine does when it works.
- With `team`, engine time is allocated to the team by its share of the engine's attributed device
  seconds (`gpu_seconds`) in the window: idle time is shared out at the measured utilisation.

Sync SQLAlchemy Core, portable between SQLite and PostgreSQL; days and hours are UTC.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Self

import sqlalchemy as sa

HOURS_PER_MONTH = 730.0  # 8,760 hours a year / 12
MIN_WINDOW_S = 60.0  # a shorter window (one request, no uptime) still scales; it is labelled as tiny
UTILISATION_LEVELS = (0.10, 0.25, 0.50, 0.75, 1.00)


class ReportError(ValueError):
    """Bad report input (a date that does not parse, an unreachable database): a clear message, exit 1."""


@dataclass(frozen=True, slots=True)
class Window:
    """Which ledger rows a report covers: [since, until) in UTC, optionally one team's."""

    since: datetime | None = None
    until: datetime | None = None
    team: str | None = None

    @classmethod
    def parse(cls, since: str | None = None, until: str | None = None, team: str | None = None) -> Window:
        """`--since DATE` is inclusive, `--until DATE` too (a bare date means up to the end of that day)."""
        return cls(_parse_time(since, "--since", end_of_day=False), _parse_time(until, "--until", end_of_day=True),
                   team)

    def describe(self) -> str:
        parts = [f"since {self.since:%Y-%m-%d %H:%M} UTC" if self.since else "from the first row",
                 f"until {self.until:%Y-%m-%d %H:%M} UTC (exclusive)" if self.until else "to the last row"]
        if self.team:
            parts.append(f"team {self.team!r}")
        return ", ".join(parts)


def _parse_time(text: str | None, flag: str, *, end_of_day: bool) -> datetime | None:
    if text is None or text == "":
        return None
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise ReportError(f"{flag} {text!r} is not a date: write YYYY-MM-DD or an ISO-8601 time") from None
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    value = value.astimezone(UTC)
    if end_of_day and re.fullmatch(r"\d{4}-\d{2}-\d{2}", text.strip()):
        value += timedelta(days=1)
    return value


# --------------------------------------------------------------------------------------------- rows


@dataclass(frozen=True, slots=True)
class TrafficRow:
    """Tokens and spend of one UTC day, route and backend."""

    day: str
    route: str | None
    backend: str | None
    cost_basis: str | None
    requests: int
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    spend_usd: float
    counterfactual_usd: float  # what the route's API alternative would have charged (0 where none)


@dataclass(frozen=True, slots=True)
class ApiBackendRow:
    """One API backend's traffic in the window, and the price-table version its rows were costed with."""

    backend: str
    served_model: str | None
    requests: int
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    spend_usd: float
    cache_savings_usd: float
    unpriced_requests: int  # rows flagged cost_note = 'unpriced_model'
    price_table_version: str | None
    policy_version: str | None = None  # api_backends_by_version: the policy version that served these rows


@dataclass(slots=True)
class EngineRow:
    """One engine backend over the window: what was paid, what was busy, what it served."""

    backend: str
    device_hour_usd: float | None  # the latest hourly price seen (uptime rows, else request rows)
    devices: int
    device_kind: str | None
    has_uptime: bool  # False: no engine_uptime rows, so paid time and idle are unknown
    up_seconds: float
    busy_seconds: float
    paid_usd: float
    busy_usd: float
    requests: int
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    attributed_seconds: float  # SUM(gpu_seconds) of its requests
    charged_usd: float  # SUM(cost_usd) of its requests
    counterfactual_usd: float
    busy_list_usd: float = 0.0  # its requests at the list rate (busy_cost_usd): stable chargeback
    team_share: float = 1.0  # with a team filter: the team's share of attributed seconds
    # KV tiering (migration 0007): prompt tokens restored from the engine's host / disk tier, not recomputed
    restored_host_tokens: int = 0
    restored_disk_tokens: int = 0
    # The measured prefill rate: tokens computed (prompt − cached) over TTFT seconds, on rows with a TTFT and
    # nothing restored. TTFT also holds queueing and the first decode step: the rate is a lower bound.
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def idle_usd(self) -> float:
        return self.paid_usd - self.busy_usd

    @property
    def restored_tokens(self) -> int:
        return self.restored_host_tokens + self.restored_disk_tokens

    @property
    def prefill_tps(self) -> float | None:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds > 0 else None

    @property
    def tiering_saved_seconds(self) -> float | None:
        """Device seconds the restored tokens would have taken to prefill at the measured rate."""
        tps = self.prefill_tps
        return self.restored_tokens / tps if tps else None

    @property
    def unallocated_usd(self) -> float | None:
        """Paid time not charged to any request at the list rate (idle, plus busy work no request was charged
        for): what is shared out on top of the list-rate charges, in proportion to them. None without uptime."""
        return self.paid_usd - self.busy_list_usd if self.has_uptime else None

    @property
    def utilisation(self) -> float | None:
        return self.busy_seconds / self.up_seconds if self.up_seconds > 0 else None

    @property
    def throughput_seconds(self) -> float:
        """Busy seconds behind the served tokens: measured busy time, else the rows' device seconds."""
        return self.busy_seconds if self.has_uptime and self.busy_seconds > 0 else self.attributed_seconds

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens (prompt + completion) per busy second, for the whole engine."""
        s = self.throughput_seconds
        return self.tokens / s if s > 0 else None

    @property
    def tokens_per_device_s(self) -> float | None:
        t = self.tokens_per_s
        return None if t is None else t / max(self.devices, 1)

    @property
    def usd_per_mtok_measured(self) -> float | None:
        """Paid cost per million tokens served (idle included); None without uptime or tokens."""
        if not self.has_uptime or self.tokens == 0:
            return None
        return self.paid_usd / self.tokens * 1e6

    def usd_per_mtok_at(self, utilisation: float) -> float | None:
        """Device price / (throughput × 3600 × utilisation), per million tokens."""
        t = self.tokens_per_s
        if not t or not self.device_hour_usd or utilisation <= 0:  # t == 0: busy time but no tokens
            return None
        return self.device_hour_usd / (t * 3600.0 * utilisation) * 1e6


@dataclass(frozen=True, slots=True)
class HourRow:
    hour: str  # 'YYYY-MM-DD HH' (UTC)
    backend: str
    up_seconds: float
    busy_seconds: float

    @property
    def utilisation(self) -> float | None:
        return self.busy_seconds / self.up_seconds if self.up_seconds > 0 else None


@dataclass(slots=True)
class Summary:
    """Whole-window totals for the decision: how much traffic, on which side, over how many days."""

    first: datetime | None  # first request
    last: datetime | None  # last request
    days: float  # the one window, in days: requests and engine uptime together (≥ MIN_WINDOW_S)
    requests: int
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    spend_usd: float
    api_spend_usd: float
    in_house_charged_usd: float
    counterfactual_usd: float  # for in-house rows with an API alternative
    zero_cost_unexplained: int  # served rows at $0 with no cost_note: must be 0
    notes: dict[str, int] = field(default_factory=dict)  # cost_note → rows
    counterfactual_charged_usd: float = 0.0  # what the in-house rows with an API alternative were charged
    window_start: datetime | None = None  # first request or engine-uptime interval in the window
    window_end: datetime | None = None  # last request, or the end of the last uptime interval
    busy_list_usd: float = 0.0  # engine rows at the list rate (SUM busy_cost_usd, else gpu_seconds × $/h)

    @property
    def window_hours(self) -> float:
        return self.days * 24.0

    @property
    def short_window(self) -> bool:
        """Shorter than a day: monthly figures extrapolate part of a day and miss the daily cycle."""
        return self.requests > 0 and self.days < 1.0

    @property
    def realised_savings_usd(self) -> float:
        """The API alternative minus what the same in-house requests cost (rows without one left out)."""
        return self.counterfactual_usd - self.counterfactual_charged_usd


# --------------------------------------------------------------------------------------------- SQL


# An engine row's cost at the list rate: the stored busy_cost_usd (migration 0005), else (older rows) the same
# product from the columns it is made of.
LIST_COST_SQL = "COALESCE(busy_cost_usd, COALESCE(gpu_seconds, 0.0) * COALESCE(device_hour_usd, 0.0) / 3600.0)"
# A row whose TTFT measures prefill: it computed prompt tokens and restored none from a KV tier.
_PREFILL_ROW_SQL = ("ttft_ms > 0 AND prompt_tokens > cached_prompt_tokens"
                    " AND COALESCE(kv_restored_host_tokens, 0) + COALESCE(kv_restored_disk_tokens, 0) = 0")


def window_caveat(summary: Summary) -> str | None:
    """The label every report prints for a window shorter than a day (None for a day or more)."""
    if not summary.short_window:
        return None
    seconds = summary.days * 86400.0
    span = f"{seconds / 60:,.0f} minutes" if seconds < 5400 else f"{seconds / 3600:,.1f} hours"
    return (f"SHORT WINDOW: the ledger covers {span}, less than a day; monthly figures scale it "
            f"x{HOURS_PER_MONTH * 3600 / seconds:,.0f} and miss the daily cycle: treat them as rough")


def day_sql(dialect: str, column: str = "created_at") -> str:
    if dialect == "postgresql":
        return f"to_char({column} AT TIME ZONE 'UTC', 'YYYY-MM-DD')"
    return f"SUBSTR({column}, 1, 10)"


def hour_sql(dialect: str, column: str = "created_at") -> str:
    if dialect == "postgresql":
        return f"to_char({column} AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24')"
    return f"SUBSTR({column}, 1, 13)"


class Ledger:
    """Report queries over one database. `Ledger.open(url)`; use as a context manager or call close()."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.dialect = engine.dialect.name

    @classmethod
    def open(cls, url: str) -> Ledger:
        from gateway import db

        if db.sqlite_file_missing(url):  # connecting would leave an empty file behind: reports only read
            raise ReportError(f"cannot read the ledger at {db.redact_url(url)}: no such file (pass --database-url "
                              "URL, or start the gateway, `switchyard serve`, which creates it)")
        try:
            engine = sa.create_engine(db.sync_url(url))
            with engine.connect() as conn:
                conn.execute(sa.text("SELECT 1 FROM requests WHERE 1 = 0"))
        except sa.exc.SQLAlchemyError as exc:
            raise ReportError(f"cannot read the ledger at {db.redact_url(url)}: {type(exc).__name__}: "
                              f"{str(exc).splitlines()[0]} (run `switchyard db upgrade` first?)") from None
        return cls(engine)

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------------- helpers

    def _where(self, w: Window, *, team: bool = True, extra: str = "") -> tuple[str, dict[str, Any]]:
        clauses, params = [], {}
        if w.since is not None:
            clauses.append("created_at >= :since")
            params["since"] = w.since
        if w.until is not None:
            clauses.append("created_at < :until")
            params["until"] = w.until
        if team and w.team is not None:
            clauses.append("team = :team")
            params["team"] = w.team
        if extra:
            clauses.append(extra)
        return ("WHERE " + " AND ".join(clauses)) if clauses else "", params

    def _rows(self, sql: str, params: dict[str, Any]) -> list[sa.Row]:
        stmt = sa.text(sql)
        for name in ("since", "until"):
            if name in params:
                stmt = stmt.bindparams(sa.bindparam(name, type_=sa.DateTime(timezone=True)))
        with self.engine.connect() as conn:
            return list(conn.execute(stmt, params))

    # -------------------------------------------------------------------- queries

    def summary(self, w: Window) -> Summary:
        where, params = self._where(w)
        row = self._rows(f"""
            SELECT MIN(created_at), MAX(created_at), COUNT(*),
                   COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(cached_prompt_tokens), 0),
                   COALESCE(SUM(completion_tokens), 0), COALESCE(SUM(cost_usd), 0.0),
                   COALESCE(SUM(CASE WHEN cost_basis = 'api_price' THEN cost_usd ELSE 0.0 END), 0.0),
                   COALESCE(SUM(CASE WHEN cost_basis = 'gpu_amortized' THEN cost_usd ELSE 0.0 END), 0.0),
                   COALESCE(SUM(CASE WHEN cost_basis = 'gpu_amortized' THEN counterfactual_cost_usd ELSE 0.0 END),
                            0.0),
                   COALESCE(SUM(CASE WHEN status = 'ok' AND cost_usd = 0 AND cost_note IS NULL
                                     AND backend IS NOT NULL THEN 1 ELSE 0 END), 0),
                   COALESCE(SUM(CASE WHEN cost_basis = 'gpu_amortized' AND counterfactual_cost_usd IS NOT NULL
                                     THEN cost_usd ELSE 0.0 END), 0.0),
                   COALESCE(SUM(CASE WHEN cost_basis = 'gpu_amortized' THEN {LIST_COST_SQL} ELSE 0.0 END), 0.0)
            FROM requests {where}""", params)[0]
        first, last = _as_utc(row[0]), _as_utc(row[1])
        start, end = self._window_span(w, first, last)
        span_s = (end - start).total_seconds() if start and end else 0.0
        where_n, params_n = self._where(w, extra="cost_note IS NOT NULL")
        notes = {r[0]: int(r[1]) for r in self._rows(
            f"SELECT cost_note, COUNT(*) FROM requests {where_n} GROUP BY cost_note ORDER BY cost_note", params_n)}
        return Summary(first, last, max(span_s, MIN_WINDOW_S) / 86400.0 if first else 0.0, int(row[2]),
                       int(row[3]), int(row[4]), int(row[5]), float(row[6]), float(row[7]), float(row[8]),
                       float(row[9]), int(row[10]), notes, float(row[11]), start, end, float(row[12]))

    def _window_span(self, w: Window, first: datetime | None,
                     last: datetime | None) -> tuple[datetime | None, datetime | None]:
        """One span for traffic and paid engine time: the requests' and the uptime intervals' together, so the
        engines' up-time and the traffic are scaled to a month by the same factor."""
        uw, up = self._where(w, team=False)
        u_first = _as_utc(self._rows(f"SELECT MIN(created_at) FROM engine_minutes {uw}", up)[0][0])
        tail = self._rows(f"SELECT created_at, seconds FROM engine_minutes {uw} ORDER BY created_at DESC, seconds DESC "
                          "LIMIT 1", up)
        u_last = None
        if tail:  # an interval's row is stamped at its start: it ends `seconds` later
            u_last = _as_utc(tail[0][0]) + timedelta(seconds=float(tail[0][1] or 0.0))
            if w.until is not None:
                u_last = min(u_last, w.until)
        starts = [t for t in (first, u_first) if t is not None]
        ends = [t for t in (last, u_last) if t is not None]
        return (min(starts) if starts else None), (max(ends) if ends else None)

    def traffic_daily(self, w: Window) -> list[TrafficRow]:
        where, params = self._where(w)
        day = day_sql(self.dialect)
        return [TrafficRow(r[0], r[1], r[2], r[3], int(r[4]), int(r[5]), int(r[6]), int(r[7]), float(r[8]),
                           float(r[9]))
                for r in self._rows(f"""
            SELECT {day} AS day, route, backend, cost_basis, COUNT(*),
                   SUM(prompt_tokens), SUM(cached_prompt_tokens), SUM(completion_tokens), SUM(cost_usd),
                   COALESCE(SUM(counterfactual_cost_usd), 0.0)
            FROM requests {where}
            GROUP BY {day}, route, backend, cost_basis
            ORDER BY day, route, backend, cost_basis""", params)]

    def api_backends(self, w: Window) -> list[ApiBackendRow]:
        where, params = self._where(w, extra="cost_basis = 'api_price' AND backend IS NOT NULL")
        return [ApiBackendRow(r[0], r[1], int(r[2]), int(r[3]), int(r[4]), int(r[5]), float(r[6]), float(r[7]),
                              int(r[8]), r[9])
                for r in self._rows(f"""
            SELECT backend, MAX(served_model), COUNT(*), SUM(prompt_tokens), SUM(cached_prompt_tokens),
                   SUM(completion_tokens), SUM(cost_usd), COALESCE(SUM(cache_savings_usd), 0.0),
                   SUM(CASE WHEN cost_note = 'unpriced_model' THEN 1 ELSE 0 END), MAX(price_table_version)
            FROM requests {where}
            GROUP BY backend ORDER BY backend""", params)]

    def api_backends_by_version(self, w: Window) -> list[ApiBackendRow]:
        """api_backends, one row per backend and the policy version that served it (reports price each
        version's tokens by its own policy)."""
        where, params = self._where(w, extra="cost_basis = 'api_price' AND backend IS NOT NULL")
        return [ApiBackendRow(r[0], r[1], int(r[2]), int(r[3]), int(r[4]), int(r[5]), float(r[6]), float(r[7]),
                              int(r[8]), r[9], r[10])
                for r in self._rows(f"""
            SELECT backend, MAX(served_model), COUNT(*), SUM(prompt_tokens), SUM(cached_prompt_tokens),
                   SUM(completion_tokens), SUM(cost_usd), COALESCE(SUM(cache_savings_usd), 0.0),
                   SUM(CASE WHEN cost_note = 'unpriced_model' THEN 1 ELSE 0 END), MAX(price_table_version),
                   policy_version
            FROM requests {where}
            GROUP BY backend, policy_version ORDER BY backend, MIN(created_at)""", params)]

    def engines(self, w: Window) -> list[EngineRow]:
        """Every engine backend with uptime or requests in the window."""
        uw, up = self._where(w, team=False)
        uptime = {r[0]: r for r in self._rows(f"""
            SELECT backend, SUM(seconds), SUM(busy_seconds), SUM(seconds * device_hour_usd) / 3600.0,
                   SUM(busy_seconds * device_hour_usd) / 3600.0, MAX(devices), MAX(device_kind),
                   MAX(device_hour_usd)
            FROM engine_minutes {uw} GROUP BY backend""", up)}
        rw, rp = self._where(w, extra="cost_basis = 'gpu_amortized' AND backend IS NOT NULL")
        served = {r[0]: r for r in self._rows(f"""
            SELECT backend, COUNT(*), SUM(prompt_tokens), SUM(cached_prompt_tokens), SUM(completion_tokens),
                   COALESCE(SUM(gpu_seconds), 0.0), SUM(cost_usd), COALESCE(SUM(counterfactual_cost_usd), 0.0),
                   MAX(device_hour_usd), MAX(device_kind), COALESCE(SUM({LIST_COST_SQL}), 0.0),
                   COALESCE(SUM(kv_restored_host_tokens), 0), COALESCE(SUM(kv_restored_disk_tokens), 0),
                   COALESCE(SUM(CASE WHEN {_PREFILL_ROW_SQL} THEN prompt_tokens - cached_prompt_tokens ELSE 0 END), 0),
                   COALESCE(SUM(CASE WHEN {_PREFILL_ROW_SQL} THEN ttft_ms ELSE 0 END), 0) / 1000.0
            FROM requests {rw} GROUP BY backend""", rp)}
        everyone: dict[str, float] = {}
        if w.team is not None:
            aw, ap = self._where(w, team=False, extra="cost_basis = 'gpu_amortized' AND backend IS NOT NULL")
            everyone = {r[0]: float(r[1]) for r in self._rows(
                f"SELECT backend, COALESCE(SUM(gpu_seconds), 0.0) FROM requests {aw} GROUP BY backend", ap)}
        out = []
        for name in sorted(set(uptime) | set(served)):
            u, s = uptime.get(name), served.get(name)
            attributed = float(s[5]) if s else 0.0
            share = 1.0
            if w.team is not None:
                total = everyone.get(name, 0.0)
                share = attributed / total if total > 0 else 0.0
            out.append(EngineRow(
                backend=name,
                device_hour_usd=float(u[7]) if u else (float(s[8]) if s and s[8] is not None else None),
                devices=int(u[5]) if u else 1,
                device_kind=(u[6] if u else (s[9] if s else None)),
                has_uptime=u is not None,
                up_seconds=float(u[1]) * share if u else 0.0,
                busy_seconds=float(u[2]) * share if u else 0.0,
                paid_usd=float(u[3]) * share if u else 0.0,
                busy_usd=float(u[4]) * share if u else 0.0,
                requests=int(s[1]) if s else 0,
                prompt_tokens=int(s[2]) if s else 0,
                cached_prompt_tokens=int(s[3]) if s else 0,
                completion_tokens=int(s[4]) if s else 0,
                attributed_seconds=attributed,
                charged_usd=float(s[6]) if s else 0.0,
                counterfactual_usd=float(s[7]) if s else 0.0,
                busy_list_usd=float(s[10]) if s else 0.0,
                team_share=share,
                restored_host_tokens=int(s[11]) if s else 0,
                restored_disk_tokens=int(s[12]) if s else 0,
                prefill_tokens=int(s[13]) if s else 0,
                prefill_seconds=float(s[14]) if s else 0.0,
            ))
        return out

    def busy_by_hour(self, w: Window) -> list[HourRow]:
        """Each engine's up and busy seconds per UTC hour (the engine's own counters; not per team)."""
        where, params = self._where(w, team=False)
        hour = hour_sql(self.dialect)
        return [HourRow(r[0], r[1], float(r[2]), float(r[3])) for r in self._rows(f"""
            SELECT {hour} AS hour, backend, SUM(seconds), SUM(busy_seconds)
            FROM engine_minutes {where} GROUP BY {hour}, backend ORDER BY hour, backend""", params)]

    def idle_daily(self, w: Window) -> list[dict[str, Any]]:
        """Per engine per UTC day: paid, busy and idle hours and dollars (not per team)."""
        where, params = self._where(w, team=False)
        day = day_sql(self.dialect)
        return [{"day": r[0], "backend": r[1], "paid_hours": float(r[2]) / 3600, "busy_hours": float(r[3]) / 3600,
                     "paid_usd": float(r[4]), "busy_usd": float(r[5]), "idle_usd": float(r[4]) - float(r[5])}
                for r in self._rows(f"""
            SELECT {day} AS day, backend, SUM(seconds), SUM(busy_seconds), SUM(seconds * device_hour_usd) / 3600.0,
                   SUM(busy_seconds * device_hour_usd) / 3600.0
            FROM engine_minutes {where} GROUP BY {day}, backend ORDER BY day, backend""", params)]

    def spend_daily(self, w: Window) -> list[dict[str, Any]]:
        """Spend per UTC day and backend (rows with a backend), with the API alternative of the rows that
        have one and what those same rows were charged (`counterfactual_charged_usd`): realised savings
        are the difference of the two, never an alternative of $0 for a route without one."""
        where, params = self._where(w, extra="backend IS NOT NULL")
        day = day_sql(self.dialect)
        return [{"day": r[0], "backend": r[1], "cost_basis": r[2], "requests": int(r[3]), "tokens": int(r[4]),
                     "spend_usd": float(r[5]), "counterfactual_usd": float(r[6]), "counterfactual_charged_usd": float(r[7])}
                for r in self._rows(f"""
            SELECT {day} AS day, backend, MAX(cost_basis), COUNT(*), SUM(prompt_tokens + completion_tokens),
                   SUM(cost_usd), COALESCE(SUM(counterfactual_cost_usd), 0.0),
                   COALESCE(SUM(CASE WHEN counterfactual_cost_usd IS NOT NULL THEN cost_usd ELSE 0.0 END), 0.0)
            FROM requests {where} GROUP BY {day}, backend ORDER BY day, backend""", params)]

    def top(self, w: Window, column: str, limit: int = 10) -> list[dict[str, Any]]:
        """The `team`s or `route`s that cost the most."""
        if column not in ("team", "route"):
            raise ValueError(column)
        where, params = self._where(w, extra=f"{column} IS NOT NULL")
        params["limit"] = limit
        return [{"name": r[0], "requests": int(r[1]), "tokens": int(r[2]), "spend_usd": float(r[3])}
                for r in self._rows(f"""
            SELECT {column}, COUNT(*), SUM(prompt_tokens + completion_tokens), SUM(cost_usd)
            FROM requests {where} GROUP BY {column} ORDER BY SUM(cost_usd) DESC, {column} LIMIT :limit""", params)]

    def policy_versions(self, w: Window) -> list[dict[str, Any]]:
        """The policy versions that served the window's rows: version, rows, first and last row, oldest first."""
        where, params = self._where(w)
        return [{"version": r[0], "rows": int(r[1]), "first": _as_utc(r[2]), "last": _as_utc(r[3])}
                for r in self._rows(f"""
            SELECT policy_version, COUNT(*), MIN(created_at), MAX(created_at) FROM requests {where}
            GROUP BY policy_version ORDER BY MIN(created_at), policy_version""", params)]

    def policy_texts(self, versions: list[str]) -> dict[str, tuple[str, str | None]]:
        """version → (text, source) of the stored policy versions among `versions` (empty on a database from
        before migration 0005, which has no policy_versions table)."""
        wanted = [v for v in versions if v]
        if not wanted:
            return {}
        stmt = sa.text("SELECT version, text, source FROM policy_versions WHERE version IN :versions").bindparams(
            sa.bindparam("versions", expanding=True))
        try:
            with self.engine.connect() as conn:
                return {r[0]: (r[1], r[2]) for r in conn.execute(stmt, {"versions": wanted})}
        except sa.exc.SQLAlchemyError:
            return {}

    def decisions(self, w: Window) -> list[dict[str, Any]]:
        """Router decisions: requests per route, reason and backend."""
        where, params = self._where(w, extra="route IS NOT NULL")
        return [{"route": r[0], "reason": r[1] or "none", "backend": r[2] or "none", "requests": int(r[3])}
                for r in self._rows(f"""
            SELECT route, route_reason, backend, COUNT(*) FROM requests {where}
            GROUP BY route, route_reason, backend ORDER BY route, route_reason, backend""", params)]


def _as_utc(value: Any) -> datetime | None:
    """A timestamp as read back (SQLite: naive text or datetime; PostgreSQL: aware) → aware UTC."""
    if value is None:
        return None
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
