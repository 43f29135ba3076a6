"""Report queries over a big ledger: every report entry point, timed on SQLite and PostgreSQL.

Seeds a synthetic ledger (gateway/testing/ledger_seed.py: 1,000,000 requests over 30 days by default, plus one
engine_uptime row per engine per minute) into a SQLite file in a temporary directory and into a fresh
PostgreSQL database (dropped at the end), then times, over the whole ledger:

- each `Ledger` method in gateway/reports/figures.py (summary, traffic_daily, api_backends, engines — also
  with a team, busy_by_hour, idle_daily, spend_daily, top team, top route, decisions);
- `DecisionInputs.from_ledger` + `decide` (gateway/reports/decision.py);
- `SELECT *` from each of the six views of migration 0003, fully fetched;
- `switchyard report spreadsheet` (xlsx and csv) and `report capacity --from-ledger`, through gateway.cli.main;
- each dashboard JSON endpoint's query function (gateway/dashboard.py) plus its orjson encoding — the
  endpoints minus HTTP and the admin-key check.

Each entry point runs `--repeat` times (default 2: the first run is cold); the table shows the slowest run
and PASS when it is at most 10 s. `--index TABLE:COL1,COL2` creates an extra index by hand after seeding
(to measure what a migration would buy; never committed to the schema).

    .venv/bin/python -m bench.reports [--rows 1000000] [--days 30] [--databases sqlite,postgresql]
                                      [--out FILE] (default: bench/results/reports/<machine>.json)
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from bench import store
from bench.machine_info import cpu_model
from gateway import db
from gateway.reports.decision import DecisionInputs, decide
from gateway.reports.figures import Ledger, Window
from gateway.testing import ledger_seed, postgres

ROOT = Path(__file__).resolve().parent.parent

LIMIT_S = 10.0
VIEWS = ("daily_spend", "engine_utilisation_hourly", "route_cost_per_1k_requests", "realised_savings_daily",
         "prefix_cache_savings_daily", "engine_idle_daily")


@contextlib.contextmanager
def database(kind: str, workdir: Path):
    """A fresh, empty database URL of `kind`; dropped (PostgreSQL) or deleted with workdir (SQLite)."""
    if kind == "sqlite":
        yield f"sqlite:///{workdir / 'bench-ledger.db'}"
        return
    with postgres.fresh_database("sy_bench") as url:
        yield url


class _FakeRequest:
    """What the dashboard's query functions read from a request: only `query_params`."""

    def __init__(self) -> None:
        self.query_params: dict[str, str] = {}


def entry_points(url: str, workdir: Path, policy_file: Path) -> dict[str, Callable[[], Any]]:
    from gateway.reports.decision import api_prices

    policy = ledger_seed.policy()
    api_prices(policy)  # imports litellm once (seconds), so no entry point below is charged for it
    ledger = Ledger.open(url)
    w = Window()
    team = Window(team=ledger_seed.TEAMS[0])
    out: dict[str, Callable[[], Any]] = {
        "Ledger.summary": lambda: ledger.summary(w),
        "Ledger.traffic_daily": lambda: ledger.traffic_daily(w),
        "Ledger.api_backends": lambda: ledger.api_backends(w),
        "Ledger.engines": lambda: ledger.engines(w),
        "Ledger.engines (team)": lambda: ledger.engines(team),
        "Ledger.busy_by_hour": lambda: ledger.busy_by_hour(w),
        "Ledger.idle_daily": lambda: ledger.idle_daily(w),
        "Ledger.spend_daily": lambda: ledger.spend_daily(w),
        "Ledger.top team": lambda: ledger.top(w, "team"),
        "Ledger.top route": lambda: ledger.top(w, "route"),
        "Ledger.decisions": lambda: ledger.decisions(w),
        "from_ledger + decide": lambda: decide(DecisionInputs.from_ledger(ledger, w, policy)),
        "from_ledger + decide (team)": lambda: decide(DecisionInputs.from_ledger(ledger, team, policy)),
    }

    def view(name: str) -> Callable[[], int]:
        def run() -> int:
            with ledger.engine.connect() as conn:
                return len(conn.exec_driver_sql(f"SELECT * FROM {name}").all())
        return run

    for name in VIEWS:
        out[f"SELECT * FROM {name}"] = view(name)

    try:
        from gateway import cli
        from gateway.reports import workbook  # noqa: F401 - only to know whether it exists yet
    except ImportError:
        cli = None
    if cli is not None:
        def spreadsheet(fmt: str) -> Callable[[], int]:
            def run() -> int:
                target = workdir / (f"report-{uuid.uuid4().hex[:6]}.xlsx" if fmt == "xlsx" else f"csv-{uuid.uuid4().hex[:6]}")
                with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
                    rc = cli.main(["report", "spreadsheet", "--out", str(target), "--format", fmt,
                                   "--database-url", url, "--policy", str(policy_file), "--no-progress"])
                if rc != 0:
                    raise RuntimeError(f"report spreadsheet exited {rc}: {err.getvalue()[-500:]}")
                return rc
            return run

        def capacity() -> int:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
                rc = cli.main(["report", "capacity", "--from-ledger", "--json", "--database-url", url,
                               "--policy", str(policy_file)])
            if rc != 0:
                raise RuntimeError(f"report capacity exited {rc}: {err.getvalue()[-500:]}")
            return rc

        out["report spreadsheet (xlsx)"] = spreadsheet("xlsx")
        out["report spreadsheet (csv)"] = spreadsheet("csv")
        out["report capacity --from-ledger"] = capacity

    try:
        import orjson

        from gateway import dashboard
    except ImportError:
        dashboard = None
    if dashboard is not None:
        for name in ("summary", "spend", "share", "utilisation", "idle", "top", "decisions", "savings"):
            fn = getattr(dashboard, f"_{name}", None)
            if fn is not None:
                out[f"dashboard /api/{name}"] = (
                    lambda fn=fn: orjson.dumps(fn(ledger, w, policy, _FakeRequest()), default=str))
    out["_close"] = ledger.close
    return out


def time_all(points: dict[str, Callable[[], Any]], repeat: int, only: set[str] | None) -> dict[str, dict]:
    results: dict[str, dict] = {}
    for name, fn in points.items():
        if name.startswith("_") or (only and name not in only):
            continue
        runs: list[float] = []
        error = None
        for _ in range(repeat):
            t = time.perf_counter()
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - a failing entry point is reported, not fatal
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                break
            runs.append(time.perf_counter() - t)
        worst = max(runs) if runs else None
        results[name] = {"runs_s": [round(r, 4) for r in runs], "worst_s": round(worst, 4) if worst else None,
                         "pass": error is None and worst is not None and worst <= LIMIT_S, "error": error}
        print(f"    {name:<40} {'ERROR ' + error if error else ' '.join(f'{r:7.3f}s' for r in runs)}",
              file=sys.stderr, flush=True)
    points["_close"]()
    return results


def machine(urls: dict[str, str]) -> dict[str, Any]:
    import sqlite3

    info: dict[str, Any] = {
        "platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
        "processor": cpu_model(), "sqlite": sqlite3.sqlite_version,
        "sqlalchemy": sa.__version__, "loadavg_start": os.getloadavg(),
    }
    with contextlib.suppress(OSError):
        mem = Path("/proc/meminfo").read_text().split("\n")[0]
        info["memory"] = mem.split(":", 1)[1].strip()
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--days", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--databases", default="sqlite,postgresql")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated entry point names (default: all)")
    ap.add_argument("--index", action="append", default=[], metavar="TABLE:COL1,COL2",
                    help="create this extra index by hand after seeding (measure it; migrations own the schema)")
    ap.add_argument("--out", default=None, help="write this JSON file instead of filing the run in "
                                                "bench/results/reports/<machine>.json")
    ap.add_argument("--label", default="", help="a name for this run in the results history")
    args = ap.parse_args(argv)
    kinds = [k.strip() for k in args.databases.split(",") if k.strip()]
    only = {s.strip() for s in args.only.split(",") if s.strip()} or None
    info = machine({})
    doc: dict[str, Any] = {"meta": {"rows": args.rows, "days": args.days, "seed": args.seed, "repeat": args.repeat,
                                    "limit_s": LIMIT_S, "extra_indexes": args.index,
                                    "date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": info},
                           "seed": {}, "results": {}}
    with tempfile.TemporaryDirectory(prefix="sy-bench-reports-") as tmp:
        workdir = Path(tmp)
        policy_file = workdir / "policy.yaml"
        policy_file.write_text(ledger_seed.POLICY_YAML)
        for kind in kinds:
            with database(kind, workdir) as url:
                print(f"{kind}: seeding {args.rows:,} rows over {args.days} days", file=sys.stderr, flush=True)
                stats = ledger_seed.seed(url, rows=args.rows, days=args.days, seed=args.seed, progress=True)
                print(f"  seeded in {stats.seconds:.1f}s (generate {stats.generate_seconds:.1f}s, "
                      f"load {stats.load_seconds:.1f}s: {stats.rows / stats.load_seconds:,.0f} rows/s)",
                      file=sys.stderr, flush=True)
                engine = sa.create_engine(db.sync_url(url))
                with engine.begin() as conn:
                    if kind == "postgresql":
                        doc["meta"]["machine"]["postgresql"] = conn.exec_driver_sql("SHOW server_version").scalar()
                    for spec in args.index:
                        table, _, cols = spec.partition(":")
                        name = f"ix_bench_{table}_{'_'.join(c.strip() for c in cols.split(','))}"
                        conn.exec_driver_sql(f"CREATE INDEX {name} ON {table} ({cols})")
                        conn.exec_driver_sql(f"ANALYZE {table}")
                engine.dispose()
                doc["seed"][kind] = {"rows": stats.rows, "uptime_rows": stats.uptime_rows,
                                     "seconds": round(stats.seconds, 2),
                                     "generate_seconds": round(stats.generate_seconds, 2),
                                     "load_seconds": round(stats.load_seconds, 2),
                                     "rows_per_s": round(stats.rows / stats.load_seconds)}
                if kind == "sqlite":
                    doc["seed"][kind]["file_mb"] = round(Path(url.removeprefix("sqlite:///")).stat().st_size / 1e6, 1)
                doc["results"][kind] = time_all(entry_points(url, workdir, policy_file), args.repeat, only)
    doc["meta"]["machine"]["loadavg_end"] = os.getloadavg()
    names = list(dict.fromkeys(n for r in doc["results"].values() for n in r))
    head = f"{'entry point':<40}" + "".join(f"{k:>14}{'':>6}" for k in kinds)
    print(head)
    print("-" * len(head))
    for name in names:
        cells = []
        for k in kinds:
            r = doc["results"][k].get(name)
            if r is None:
                cells.append(f"{'—':>14}{'':>6}")
            elif r["error"]:
                cells.append(f"{'error':>14}{'FAIL':>6}")
            else:
                cells.append(f"{r['worst_s']:>13.3f}s{'PASS' if r['pass'] else 'FAIL':>6}")
        print(f"{name:<40}" + "".join(cells))
    seed_line = ", ".join(f"{k}: {v['load_seconds']}s ({v['rows_per_s']:,} rows/s)" for k, v in doc["seed"].items())
    print(f"\nseed load: {seed_line}; load average {info['loadavg_start']} → {doc['meta']['machine']['loadavg_end']}")
    print(f"wrote {store.save('reports', doc, label=args.label, out=args.out)}")
    failed = [(k, n) for k, r in doc["results"].items() for n, v in r.items() if not v["pass"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
