"""`switchyard report capacity`: how many devices a target output-token rate needs, planned in tokens.

Inputs: a target output-token rate λ (tokens/s) — given, or the ledger's busiest hour — and a measured
throughput curve of the engine: per concurrency c, output tokens/s per device, TTFT p95 and the mean time a
request spends in the system. The operating point is the largest measured concurrency whose TTFT p95 meets
the target; then

    devices            = ceil(λ / (throughput(c) × target utilisation))
    request rate       = λ / mean completion tokens per request
    sequences in flight L = request rate × mean time in system        (Little's Law)

and the monthly cost is devices × the hourly price of the device the curve was measured on × 730 h
(gateway/reports/machine_price.py: a CPU curve at a CPU host's price, never at a GPU's; the policy is
`--policy`, else the one stored in the ledger, else the default: gateway/reports/report_policy.py). Without
`--p95-ttft-ms` the target is DEFAULT_P95_TTFT_MS, an interactive chat's. The curves ship with the package
(gateway/reports/bench_data.py). The decode roofline floor (gateway/reports/roofline.py) is printed beside the
plan.

Pure functions underneath `run(args, out)`: `load_curve`, `choose_point`, `plan_capacity`, `ledger_load`;
the price is machine_price.machine_price's. The ledger is read with SQLAlchemy Core (sync) over the `cost_ledger` view.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any, TextIO

from gateway.reports import roofline
from gateway.reports.bench_data import (
    CHEAPER_MODEL,
    ENGINE_CURVE,
    ENGINE_THROUGHPUT,
    UNNAMED,
    Machine,
    describe,
    latest_result,
    machine_of,
    missing_hint,
)
from gateway.reports.machine_price import MachinePrice, MachinePriceError, machine_price
from gateway.reports.report_policy import ReportPolicyError, report_policy

HOURS_PER_MONTH = 730
# Tried in order when --curve is not given (the packaged copies): the first one that yields a curve is used.
DEFAULT_CURVE_FILES: tuple[Path, ...] = (ENGINE_CURVE, CHEAPER_MODEL, ENGINE_THROUGHPUT)
DEFAULT_TARGET_UTILISATION = 0.6
# Without --p95-ttft-ms: 2 s to the first token, about as long as a chat user waits before the answer feels
# stalled. A throughput-only plan (batch work) passes a large --p95-ttft-ms.
DEFAULT_P95_TTFT_MS = 2000.0


class CapacityError(ValueError):
    """A capacity question that cannot be answered: no curve, no traffic, an unreachable TTFT target…"""


# ---------------------------------------------------------------------------------------------- the curve


@dataclass(frozen=True, slots=True)
class CurvePoint:
    concurrency: int
    output_tok_s: float  # output tokens per second, one device, all sequences together
    ttft_p95_ms: float | None  # None: not measured
    mean_seconds_in_system: float  # arrival to last token, one request
    ttft_p50_ms: float | None = None
    time_derived: bool = False  # mean_seconds_in_system = c × tokens / throughput (Little's Law), not timed


@dataclass(frozen=True, slots=True)
class Curve:
    points: tuple[CurvePoint, ...]  # by concurrency
    source: str
    tokens_per_request: float | None = None  # output tokens per request in the benchmark
    prompt_tokens: float | None = None  # prompt tokens per request in the benchmark
    notes: tuple[str, ...] = ()
    machine: Machine = UNNAMED  # what it was measured on

    @property
    def has_ttft(self) -> bool:
        return any(p.ttft_p95_ms is not None for p in self.points)


def _little_time(concurrency: int, tokens: float, tok_s: float) -> float:
    # A closed loop holding c sequences that finishes tok_s / tokens requests per second: W = c / X.
    return concurrency * tokens / tok_s


def _curve_from_points(data: dict[str, Any], source: str) -> Curve:
    meta = data.get("meta") or {}
    tokens = meta.get("output_tokens") or meta.get("new_tokens")
    points = []
    for p in data["points"]:
        c, tok_s = int(p["concurrency"]), float(p["output_tok_s"])
        w = p.get("mean_seconds_in_system")
        derived = w is None
        if derived:
            if not tokens:
                raise CapacityError(f"{source}: point at concurrency {c} has no mean_seconds_in_system "
                                    "and the meta gives no output_tokens to derive it")
            w = _little_time(c, float(tokens), tok_s)
        points.append(CurvePoint(c, tok_s, p.get("ttft_p95_ms"), float(w), p.get("ttft_p50_ms"), derived))
    return Curve(tuple(points), source, float(tokens) if tokens else None,
                 float(meta["prompt_tokens"]) if meta.get("prompt_tokens") else None)


def _curve_from_spec(data: dict[str, Any], source: str) -> Curve:
    spec = data["spec"]
    tokens = float(spec.get("tokens") or 0)
    by_batch: dict[int, list[float]] = {}
    for r in spec.get("rows") or []:
        if r.get("config") == "plain" and r.get("decode_tok_s"):
            by_batch.setdefault(int(r["batch"]), []).append(float(r["decode_tok_s"]))
    if not by_batch or not tokens:
        raise CapacityError(f"{source}: the spec section has no plain rows")
    points = []
    for c, rates in sorted(by_batch.items()):
        tok_s = sum(rates) / len(rates)
        points.append(CurvePoint(c, tok_s, None, _little_time(c, tokens, tok_s), None, True))
    prompt = (data.get("meta") or {}).get("prompt_tokens")
    return Curve(tuple(points), f"{source} (spec: plain decode rows)", tokens,
                 float(prompt) if prompt else None,
                 (("decode-only rates (prefill not timed), mean of the workloads at each batch size; "
                  "no TTFT measured"), "time in system = c × tokens per request ÷ tokens/s (Little's Law)"))


def _curve_from_throughput(data: dict[str, Any], source: str) -> Curve:
    e = data["engine"]
    cfg = data.get("config") or {}
    c = int(e.get("requests") or cfg.get("requests"))
    c = min(c, int(e.get("max_num_seqs") or c))
    tokens = float(cfg.get("output_tokens") or e["output_tokens"] / e["requests"])
    tok_s = float(e["output_tok_s"])
    ttft_max = e.get("ttft_max_s")
    prompt = cfg.get("prompt_len")
    prompt_mean = (sum(prompt) / 2 if isinstance(prompt, list) and len(prompt) == 2 else prompt) or None
    point = CurvePoint(c, tok_s, ttft_max * 1000 if ttft_max is not None else None,
                       _little_time(c, tokens, tok_s),
                       e["ttft_median_s"] * 1000 if e.get("ttft_median_s") is not None else None, True)
    return Curve((point,), f"{source} (engine: all requests submitted at once)", tokens,
                 float(prompt_mean) if prompt_mean else None,
                 ("one point; TTFT p95 bounded by the measured maximum TTFT",
                  "time in system = c × tokens per request ÷ tokens/s (Little's Law)"))


def parse_curve(data: Any, source: str = "<curve>") -> Curve:
    """A curve from any of the three benchmark formats: engine_curve.json (`points`), cheaper_model.json
    (`spec` rows, config plain) or engine_throughput.json (`engine`)."""
    if not isinstance(data, dict):
        raise CapacityError(f"{source}: not a JSON object")
    try:
        if data.get("points"):
            curve = _curve_from_points(data, source)
        elif isinstance(data.get("spec"), dict):
            curve = _curve_from_spec(data, source)
        elif isinstance(data.get("engine"), dict) and "output_tok_s" in data["engine"]:
            curve = _curve_from_throughput(data, source)
        else:
            raise CapacityError(f"{source}: no throughput curve in it (expected `points`, `spec` or `engine`)")
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, CapacityError):
            raise
        raise CapacityError(f"{source}: malformed curve ({type(e).__name__}: {e})") from None
    points = tuple(sorted((p for p in curve.points if p.output_tok_s > 0 and p.concurrency > 0),
                          key=lambda p: p.concurrency))
    if not points:
        raise CapacityError(f"{source}: the curve has no point with a positive throughput")
    return Curve(points, curve.source, curve.tokens_per_request, curve.prompt_tokens, curve.notes, machine_of(data))


def load_curve(path: str | Path | None = None) -> Curve:
    """The curve in `path`; without one, the first of DEFAULT_CURVE_FILES that exists and has a curve."""
    candidates = [Path(path)] if path else list(DEFAULT_CURVE_FILES)
    problems = []
    for p in candidates:
        try:
            data = latest_result(json.loads(p.read_text()))
        except OSError as e:
            problems.append(f"{describe(p)}: {e.strerror or e}")
            continue
        except ValueError as e:
            problems.append(f"{describe(p)}: not JSON ({e})")
            continue
        try:
            return parse_curve(data, describe(p))
        except CapacityError as e:
            problems.append(str(e))
    raise CapacityError(f"no throughput curve: {'; '.join(problems)} ({missing_hint(candidates[0], '--curve')})")


def choose_point(points: tuple[CurvePoint, ...] | list[CurvePoint], p95_ttft_ms: float | None = None) -> CurvePoint:
    """The largest measured concurrency whose TTFT p95 meets the target (any point when there is none: the CLI
    always has one, DEFAULT_P95_TTFT_MS when not given)."""
    if not points:
        raise CapacityError("the curve has no points")
    if p95_ttft_ms is None:
        return max(points, key=lambda p: p.concurrency)
    measured = [p for p in points if p.ttft_p95_ms is not None]
    if not measured:
        raise CapacityError(f"no curve point meets TTFT p95 <= {p95_ttft_ms:g} ms: the curve has no TTFT "
                            "measurements (leave --curve out for the packaged engine_curve.json, which has them)")
    ok = [p for p in measured if p.ttft_p95_ms <= p95_ttft_ms]
    if not ok:
        best = min(measured, key=lambda p: p.ttft_p95_ms)
        raise CapacityError(f"no curve point meets TTFT p95 <= {p95_ttft_ms:g} ms: the best measured is "
                            f"{best.ttft_p95_ms:.0f} ms at concurrency {best.concurrency} (pass a larger "
                            "--p95-ttft-ms)")
    return max(ok, key=lambda p: p.concurrency)


@dataclass(frozen=True, slots=True)
class CapacityPlan:
    target_tokens_per_s: float
    target_utilisation: float
    p95_ttft_ms: float | None
    point: CurvePoint
    mean_completion_tokens: float
    request_rate_per_s: float
    seconds_in_system: float  # the curve's, scaled to mean_completion_tokens when they differ
    sequences_in_flight: float  # L, all devices together
    devices: int
    sequences_per_device: float
    achieved_utilisation: float  # λ / (devices × throughput)


def plan_capacity(curve: Curve, target_tokens_per_s: float, target_utilisation: float = DEFAULT_TARGET_UTILISATION,
                  p95_ttft_ms: float | None = None, mean_completion_tokens: float | None = None) -> CapacityPlan:
    """Devices and Little's Law for λ output tokens/s on the curve's engine.

    mean_completion_tokens defaults to the curve's tokens per request; when it differs, the time in system
    is scaled in proportion (decode-dominated requests: time grows with the tokens produced).
    """
    if not target_tokens_per_s or target_tokens_per_s <= 0 or not math.isfinite(target_tokens_per_s):
        raise CapacityError(f"the target rate must be a positive number of tokens/s, got {target_tokens_per_s}")
    if not 0 < target_utilisation <= 1:
        raise CapacityError(f"the target utilisation must be in (0, 1], got {target_utilisation}")
    point = choose_point(curve.points, p95_ttft_ms)
    tokens = mean_completion_tokens or curve.tokens_per_request
    if not tokens or tokens <= 0:
        raise CapacityError("mean completion tokens per request unknown: the curve does not say and none was given")
    w = point.mean_seconds_in_system
    if curve.tokens_per_request and mean_completion_tokens and mean_completion_tokens != curve.tokens_per_request:
        w = w * mean_completion_tokens / curve.tokens_per_request
    devices = max(1, math.ceil(target_tokens_per_s / (point.output_tok_s * target_utilisation) - 1e-9))
    rate = target_tokens_per_s / tokens
    in_flight = rate * w
    return CapacityPlan(target_tokens_per_s=target_tokens_per_s, target_utilisation=target_utilisation,
                        p95_ttft_ms=p95_ttft_ms, point=point, mean_completion_tokens=float(tokens),
                        request_rate_per_s=rate, seconds_in_system=w, sequences_in_flight=in_flight,
                        devices=devices, sequences_per_device=in_flight / devices,
                        achieved_utilisation=target_tokens_per_s / (devices * point.output_tok_s))


# ---------------------------------------------------------------------------------------------- the ledger


@dataclass(frozen=True, slots=True)
class LedgerLoad:
    requests: int  # ok requests in the window
    busiest_hour: str  # 'YYYY-MM-DD HH' (UTC)
    busiest_hour_requests: int
    output_tok_s: float  # busiest hour's completion tokens / 3600
    prompt_tok_s: float  # the same hour's prompt tokens / 3600
    mean_prompt_tokens: float  # over every ok request in the window
    mean_completion_tokens: float
    hours_with_traffic: int
    span_hours: int = 0  # UTC hours from the first hour with traffic to the last, both included

    @property
    def window_note(self) -> str | None:
        """The label every report gives a window shorter than a day (its busiest hour may be a partial one)."""
        if self.span_hours >= 24:
            return None
        return (f"SHORT WINDOW: the ledger's traffic spans {self.span_hours} UTC hour(s), less than a day: its "
                "busiest hour may be partly covered and misses the daily peak; give --target-tokens-per-s to plan")


def parse_when(value: str | date | datetime | None) -> datetime | None:
    """A --since / --until value (a date or an ISO timestamp; naive means UTC) as an aware UTC datetime."""
    if value is None or value == "":
        return None
    if isinstance(value, datetime):
        dt = value
    elif isinstance(value, date):
        dt = datetime(value.year, value.month, value.day)
    else:
        try:
            dt = datetime.fromisoformat(str(value).strip())
        except ValueError:
            raise CapacityError(f"not a date or ISO timestamp: {value!r} (e.g. 2025-03-01)") from None
    return dt.replace(tzinfo=UTC) if dt.tzinfo is None else dt.astimezone(UTC)


def ledger_load(url: str, since: str | datetime | None = None, until: str | datetime | None = None,
                backend: str | None = None) -> LedgerLoad:
    """The busiest hour (by output tokens) of successful requests in [since, until), optionally one backend."""
    from sqlalchemy import (
        DateTime,
        Integer,
        String,
        and_,
        cast,
        column,
        create_engine,
        func,
        literal_column,
        select,
        table,
    )
    from sqlalchemy.exc import SQLAlchemyError

    from gateway.db import redact_url, sync_url

    ledger = table("cost_ledger", column("created_at", DateTime(timezone=True)), column("status", String),
                   column("backend", String), column("prompt_tokens", Integer),
                   column("completion_tokens", Integer))
    c = ledger.c
    from gateway.db import sqlite_file_missing

    if sqlite_file_missing(url):  # create_engine would leave an empty file behind
        raise CapacityError(f"cannot read the ledger at {redact_url(url)}: no such file (pass --database-url URL, "
                            "or --target-tokens-per-s N instead of --from-ledger)")
    db_engine = create_engine(sync_url(url))
    try:
        if db_engine.dialect.name == "postgresql":
            hour = func.to_char(func.timezone(literal_column("'UTC'"), c.created_at),
                                literal_column("'YYYY-MM-DD HH24'"))
        else:  # SQLite stores UTC timestamps as text
            hour = func.substr(cast(c.created_at, String(32)), literal_column("1"), literal_column("13"))
        conds = [c.status == "ok"]
        start, end = parse_when(since), parse_when(until)
        if start is not None:
            conds.append(c.created_at >= start)
        if end is not None:
            conds.append(c.created_at < end)
        if backend:
            conds.append(c.backend == backend)
        q = (select(hour.label("hour"), func.count().label("n"),
                    func.coalesce(func.sum(c.prompt_tokens), 0).label("prompt"),
                    func.coalesce(func.sum(c.completion_tokens), 0).label("completion"))
             .where(and_(*conds)).group_by(hour))
        try:
            with db_engine.connect() as conn:
                rows = [(str(h), int(n), int(p), int(k)) for h, n, p, k in conn.execute(q)]
        except SQLAlchemyError as e:
            raise CapacityError(f"cannot read the ledger at {redact_url(url)}: {e.__class__.__name__}: "
                                f"{str(e).splitlines()[0]} (run `switchyard db upgrade`?)") from None
    finally:
        db_engine.dispose()
    requests = sum(r[1] for r in rows)
    where = "" if not backend else f" for backend {backend!r}"
    window = "" if start is None and end is None else (
        f" between {start.isoformat() if start else 'the start'} and {end.isoformat() if end else 'now'}")
    if requests == 0:
        raise CapacityError(f"the ledger has no successful requests{where}{window}: nothing to plan from "
                            "(give --target-tokens-per-s instead)")
    completion = sum(r[3] for r in rows)
    if completion == 0:
        raise CapacityError(f"the ledger's {requests} successful requests{where}{window} produced no output tokens")
    hour_, n, p, k = max(rows, key=lambda r: (r[3], r[2], r[0]))
    hours = sorted(datetime.strptime(r[0], "%Y-%m-%d %H") for r in rows)
    span = int((hours[-1] - hours[0]).total_seconds() // 3600) + 1
    return LedgerLoad(requests=requests, busiest_hour=hour_, busiest_hour_requests=n, output_tok_s=k / 3600,
                      prompt_tok_s=p / 3600, mean_prompt_tokens=sum(r[2] for r in rows) / requests,
                      mean_completion_tokens=completion / requests, hours_with_traffic=len(rows), span_hours=span)


# ---------------------------------------------------------------------------------------------- the report


@dataclass(slots=True)
class CapacityReport:
    plan: CapacityPlan
    curve: Curve
    price: MachinePrice
    monthly_usd: float
    load: LedgerLoad | None
    roofline_rows: list[roofline.RooflineRow]
    roofline_accelerators: dict[str, float]
    roofline_context: int
    roofline_source: str
    assumptions: list[str] = field(default_factory=list)
    policy_label: str = ""
    ttft_target_source: str = "given"  # "given", "default" or "none" (the curve measures no TTFT)
    roofline_cpu: roofline.MeasuredCpu | None = None


def _ttft_target(args: argparse.Namespace, curve: Curve) -> tuple[float | None, str]:
    given = getattr(args, "p95_ttft_ms", None)
    if given is not None:
        if not given > 0:
            raise CapacityError(f"--p95-ttft-ms must be a positive number of milliseconds, got {given:g}")
        return float(given), "given"
    if not curve.has_ttft:  # nothing to check the default against: plan at the largest concurrency, labelled
        return None, "none"
    return DEFAULT_P95_TTFT_MS, "default"


def build_report(args: argparse.Namespace) -> CapacityReport:
    target = getattr(args, "target_tokens_per_s", None)
    from_ledger = bool(getattr(args, "from_ledger", False))
    if (target is None) == (not from_ledger):
        raise CapacityError("give exactly one of --target-tokens-per-s N and --from-ledger")
    backend = getattr(args, "backend", None)
    util = getattr(args, "target_utilisation", None)
    util = DEFAULT_TARGET_UTILISATION if util is None else float(util)
    curve_file = getattr(args, "curve", None)
    curve = load_curve(curve_file)
    ttft, ttft_source = _ttft_target(args, curve)
    try:
        rp = report_policy(getattr(args, "policy", None), getattr(args, "database_url", None))
        price = machine_price(curve.machine, rp, backend, getattr(args, "device_hour_usd", None))
    except (ReportPolicyError, MachinePriceError) as e:
        raise CapacityError(str(e)) from None
    load = None
    if from_ledger:
        from gateway.settings import database_url

        load = ledger_load(database_url(getattr(args, "database_url", None)), getattr(args, "since", None),
                           getattr(args, "until", None), backend)
        target = load.output_tok_s
    plan = plan_capacity(curve, float(target), util, ttft, load.mean_completion_tokens if load else None)
    monthly = plan.devices * price.usd_per_hour * HOURS_PER_MONTH

    bench_files = [p for p in (CHEAPER_MODEL, ENGINE_THROUGHPUT) if p.is_file()]
    if curve_file:
        bench_files.insert(0, Path(curve_file))
    shape = roofline.model_shape_from_bench(bench_files)
    accel = dict(roofline.ACCELERATORS)
    cpu = roofline.measured_cpu(bench_files)
    if cpu is not None:
        accel[cpu.label] = cpu.bytes_per_s
    if load is not None:
        context = round(load.mean_prompt_tokens + load.mean_completion_tokens)
        context_why = "the ledger's mean prompt + completion tokens"
    elif curve.prompt_tokens and curve.tokens_per_request:
        context = round(curve.prompt_tokens + curve.tokens_per_request)
        context_why = "the curve benchmark's prompt + output tokens"
    else:
        context, context_why = roofline.DEFAULT_CONTEXT_TOKENS, "a default"
    rows = (roofline.roofline_table(shape.param_count, context, shape.kv_values_per_position, accel)
            if shape else [])

    a = [f"curve: {curve.source}, measured on {curve.machine.name}"]
    a += [f"curve: {n}" for n in curve.notes]
    if curve.tokens_per_request:
        a.append(f"curve measured at {curve.tokens_per_request:g} output tokens per request"
                 + (f", {curve.prompt_tokens:g} prompt tokens" if curve.prompt_tokens else ""))
    if load is not None:
        since, until = parse_when(getattr(args, "since", None)), parse_when(getattr(args, "until", None))
        a.append(f"λ = busiest hour of the ledger (UTC {load.busiest_hour}:00, status = 'ok'"
                 + (f", backend {backend}" if backend else "")
                 + (f", since {since.isoformat()}" if since else "") + (f", until {until.isoformat()}" if until else "")
                 + f"): {load.busiest_hour_requests} requests, output tokens / 3600 s")
        if curve.tokens_per_request and load.mean_completion_tokens != curve.tokens_per_request:
            a.append(f"time in system scaled from the curve's {curve.tokens_per_request:g} to the ledger's "
                     f"{load.mean_completion_tokens:.1f} output tokens per request (decode-dominated)")
    else:
        a.append(f"λ = {plan.target_tokens_per_s:g} output tokens/s (given)")
    a.append(f"target utilisation {util:g}: devices = ceil(λ / (tokens/s per device × {util:g}))")
    if ttft_source == "given":
        a.append(f"TTFT p95 target: {ttft:g} ms (--p95-ttft-ms)")
    elif ttft_source == "default":
        a.append(f"TTFT p95 target: {ttft:g} ms, the default for interactive chat (--p95-ttft-ms to change it)")
    else:
        a.append(f"TTFT p95 target: none: the curve measures no TTFT, so the default {DEFAULT_P95_TTFT_MS:g} ms "
                 "cannot be checked (largest measured concurrency)")
    a.append("Little's Law: sequences in flight = (λ / mean completion tokens) × mean time in system")
    a.append(f"device price ${price.usd_per_hour:g}/h per {price.device_word} ({curve.machine.name}) = "
             f"{price.basis}; a month = {HOURS_PER_MONTH} h")
    if price.gpu_note:
        a.append(_gpu_note(price))
    if shape:
        a.append(f"roofline: {shape.param_count:,} parameters from {shape.source}; KV read at "
                 f"{context} tokens of context ({context_why})"
                 + ("" if shape.kv_values_per_position else "; KV shape unknown: KV read left out"))
        if cpu is not None:
            a.append(f"roofline: {cpu.label} at {cpu.bytes_per_s / 1e9:.1f} GB/s read bandwidth, {cpu.source}")
    a += [f"roofline: {x}" for x in roofline.ASSUMPTIONS]
    return CapacityReport(plan=plan, curve=curve, price=price, monthly_usd=monthly, load=load,
                          roofline_rows=rows, roofline_accelerators=accel, roofline_context=context,
                          roofline_source=shape.source if shape else "", assumptions=a, policy_label=rp.label,
                          ttft_target_source=ttft_source, roofline_cpu=cpu)


def report_json(r: CapacityReport) -> dict[str, Any]:
    p = r.plan
    return {"target_tokens_per_s": p.target_tokens_per_s, "target_utilisation": p.target_utilisation,
            "p95_ttft_ms": p.p95_ttft_ms, "p95_ttft_ms_source": r.ttft_target_source,
            "operating_point": asdict(p.point),
            "tokens_per_s_per_device": p.point.output_tok_s,
            "mean_completion_tokens": p.mean_completion_tokens,
            "request_rate_per_s": p.request_rate_per_s, "seconds_in_system": p.seconds_in_system,
            "sequences_in_flight": p.sequences_in_flight, "sequences_per_device": p.sequences_per_device,
            "devices": p.devices, "achieved_utilisation": p.achieved_utilisation,
            "device_backend": r.price.backend, "device_hour_usd": r.price.usd_per_hour,
            "device": {**r.curve.machine.as_json(), "price_basis": r.price.basis,
                       "gpu_plan": _gpu_note(r.price) if r.price.gpu_note else None},
            "pricing_policy": r.policy_label,
            "hours_per_month": HOURS_PER_MONTH, "monthly_usd": r.monthly_usd,
            "ledger": {**asdict(r.load), "window_note": r.load.window_note} if r.load else None,
            "curve": {"source": r.curve.source, "machine": r.curve.machine.name,
                      "tokens_per_request": r.curve.tokens_per_request,
                      "points": [asdict(x) for x in r.curve.points]},
            "roofline": {"context_tokens": r.roofline_context,
                         "measured_cpu": None if r.roofline_cpu is None else asdict(r.roofline_cpu),
                         "bandwidth_bytes_per_s": r.roofline_accelerators,
                         "rows": roofline.as_json(r.roofline_rows)},
            "assumptions": r.assumptions}


def _gpu_note(price: MachinePrice) -> str:
    return f"GPU plan: none: {price.gpu_note}; the decode roofline floor is an estimate, not a plan"


def _opt_ms(x: float | None) -> str:
    return "—" if x is None else f"{x:,.0f}"


def format_report(r: CapacityReport) -> str:
    p = r.plan
    lines = ["Capacity plan (tokens per second)", ""]
    if r.load and r.load.window_note:
        lines += [r.load.window_note, ""]
    if r.load:
        lines += [(f"ledger: {r.load.requests:,} ok requests over {r.load.hours_with_traffic} hours with traffic; "
                  f"busiest hour {r.load.busiest_hour}:00 UTC: {r.load.output_tok_s:,.2f} output tok/s, "
                  f"{r.load.prompt_tok_s:,.2f} prompt tok/s; mean {r.load.mean_prompt_tokens:,.1f} prompt + "
                  f"{r.load.mean_completion_tokens:,.1f} completion tokens per request"), ""]
    lines += [f"curve measured on {r.curve.machine.name} ({r.curve.source})", "",
              "| concurrency | output tok/s per device | TTFT p50 ms | TTFT p95 ms | time in system s | |",
              "| ---: | ---: | ---: | ---: | ---: | --- |"]
    for x in r.curve.points:
        mark = "chosen" if x == p.point else ""
        lines.append(f"| {x.concurrency} | {x.output_tok_s:,.1f} | {_opt_ms(x.ttft_p50_ms)} | "
                     f"{_opt_ms(x.ttft_p95_ms)} | {x.mean_seconds_in_system:,.2f} | {mark} |")
    lines += ["",
              f"target λ                  {p.target_tokens_per_s:,.2f} output tokens/s",
              "TTFT p95 target           " + (f"{p.p95_ttft_ms:,.0f} ms" if p.p95_ttft_ms is not None else "none")
              + {"given": "", "default": " (default; --p95-ttft-ms to change)",
                 "none": " (the curve measures no TTFT)"}[r.ttft_target_source],
              f"operating point           concurrency {p.point.concurrency}"
              + (f", TTFT p95 {p.point.ttft_p95_ms:,.0f} ms" if p.point.ttft_p95_ms is not None else ""),
              (f"tokens/s per device       {p.point.output_tok_s:,.1f} measured, "
              f"{p.point.output_tok_s * p.target_utilisation:,.1f} at {p.target_utilisation:.0%} utilisation"),
              (f"request rate              {p.request_rate_per_s:,.3f} /s ({p.mean_completion_tokens:,.1f} "
              "output tokens per request)"),
              f"time in system            {p.seconds_in_system:,.2f} s",
              (f"sequences in flight (L)   {p.sequences_in_flight:,.2f} total, {p.sequences_per_device:,.2f} "
              "per device"),
              (f"devices needed            {p.devices} × {r.curve.machine.name} (each at "
               f"{p.achieved_utilisation:.0%} of measured throughput)"),
              (f"monthly device cost       ${r.monthly_usd:,.2f} ({p.devices} × ${r.price.usd_per_hour:g}/h "
               f"× {HOURS_PER_MONTH} h per {r.price.device_word}: {r.price.basis})"),
              f"prices from               {r.policy_label}"]
    if r.price.gpu_note:
        lines += ["", _gpu_note(r.price)]
    if r.roofline_rows:
        lines += ["", (f"Decode roofline floor (an estimate from bandwidth, not a measurement), ms per token for "
                      f"one sequence at {r.roofline_context} tokens of context (no engine goes faster):"), "",
                  roofline.format_table(r.roofline_rows, r.roofline_accelerators).rstrip()]
    lines += ["", "Assumptions:"] + [f"  - {x}" for x in r.assumptions]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """`switchyard report capacity`. 0 on success, 1 with a message on stderr when it cannot answer."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    try:
        report = build_report(args)
    except (CapacityError, roofline.RooflineError) as e:
        print(f"ERROR: {e}", file=err)
        return 1
    if getattr(args, "json", False):
        out.write(json.dumps(report_json(report), indent=2) + "\n")
    else:
        out.write(format_report(report))
    return 0
