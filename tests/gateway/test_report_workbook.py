"""`switchyard report spreadsheet`: the workbook recomputed by LibreOffice matches hand-written SQL and
decision.decide, edits to its inputs recompute it, and the edge cases show no error cells.

LibreOffice is slow to start, so every workbook of the module is converted in one soffice call (a
module-scoped fixture) and the edited one in a second.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import shutil
import sqlite3
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import openpyxl
import pytest
import sqlalchemy as sa

from gateway import db
from gateway.cli import main
from gateway.ledger.models import EngineUptimeRow, RequestRow
from gateway.ledger.record import LedgerRecord, UptimeRecord
from gateway.policy import load_policy
from gateway.reports import decision as dec
from gateway.reports.figures import UTILISATION_LEVELS, Ledger, Window
from gateway.settings import DEFAULT_POLICY

SOFFICE = shutil.which("soffice")
needs_lo = pytest.mark.skipif(SOFFICE is None, reason="LibreOffice (soffice) is not installed")
ERRORS = ("#DIV/0!", "#VALUE!", "#REF!", "#NAME?", "#N/A", "#NUM!", "#NULL!")
BASE = datetime(2024, 5, 1, tzinfo=UTC)
STACK = {"stack": {"requests": 4, "tokens": 8, "gpu_hour_usd": 2.5, "rows": [
    {"stage": "one request at a time", "tok_s": 50.0},
    {"stage": "+ continuous batching", "tok_s": 200.0},
    {"stage": "+ prefix cache", "tok_s": 600.0}]}}


# --------------------------------------------------------------------------------------------- fixtures


def _engine_req(n: int, when: datetime, team: str, prompt: int, completion: int, gpu_s: float,
                **kw) -> LedgerRecord:
    return LedgerRecord(f"r{n}", when, team=team, route="smollm2", backend="smollm2", served_model="smollm2",
                        prompt_tokens=prompt, cached_prompt_tokens=kw.pop("cached", 0), completion_tokens=completion,
                        cost_usd=gpu_s * 2.5 / 3600 / 0.5, cost_basis="gpu_amortized", gpu_seconds=gpu_s,
                        counterfactual_cost_usd=(prompt * 0.15 + completion * 0.6) / 1e6, device_hour_usd=2.5,
                        device_kind="gpu", utilisation=0.5, **kw)


def _api_req(n: int, when: datetime, team: str, prompt: int, cached: int, completion: int,
             backend: str = "mini") -> LedgerRecord:
    return LedgerRecord(f"r{n}", when, team=team, route="gpt-4o-mini", backend=backend, served_model="gpt-4o-mini",
                        prompt_tokens=prompt, cached_prompt_tokens=cached, completion_tokens=completion,
                        cost_usd=((prompt - cached) * 0.15 + cached * 0.075 + completion * 0.6) / 1e6,
                        cost_basis="api_price", price_table_version="litellm-test+0001",
                        cost_note="unpriced_model" if backend != "mini" else None)


def _uptime(backend: str, when: datetime, busy: float, seconds: float = 3600.0) -> UptimeRecord:
    return UptimeRecord(f"{backend}|{when.isoformat()}|a", when, backend, seconds, busy, 2.5)


def _seed(path: Path, requests: list[LedgerRecord], uptime: list[UptimeRecord]) -> str:
    url = "sqlite:///" + str(path)
    db.upgrade(url)
    engine = sa.create_engine(db.sync_url(url))
    with engine.begin() as conn:
        if requests:
            conn.execute(RequestRow.__table__.insert(), [r.to_row() for r in requests])
        if uptime:
            conn.execute(EngineUptimeRow.__table__.insert(), [u.to_row() for u in uptime])
    engine.dispose()
    return url


def _main_rows(days: int = 3, engine: bool = True, api: bool = True):
    reqs, ups, n = [], [], 0
    for d in range(days):
        day = BASE + timedelta(days=d)
        if engine:
            for i in range(4):
                n += 1
                reqs.append(_engine_req(n, day + timedelta(hours=9 + i, minutes=5), "alpha" if i % 2 == 0 else "beta",
                                        15_000_000 + 1000 * i + d, 4_500_000 + i, 0.5 + 0.1 * i, cached=20 * i))
            for h in range(9, 13):
                ups.append(_uptime("smollm2", day + timedelta(hours=h), 900.0 + 100 * h + d))
        if api:
            for i in range(3):
                n += 1
                reqs.append(_api_req(n, day + timedelta(hours=10 + i, minutes=7), "beta" if i else "alpha",
                                     2_000_000 + 7 * i, 640_000 * i, 300_000 + i))
    if engine:  # a row with a cost note, and a rejected request with no backend
        n += 1
        reqs.append(_engine_req(n, BASE + timedelta(hours=15), "beta", 500, 100, 0.01, cost_note="utilisation_floor"))
    n += 1
    reqs.append(LedgerRecord(f"r{n}", BASE + timedelta(hours=16), team="alpha", route="auto", status="rejected"))
    return reqs, ups


def _spreadsheet(out: Path, url: str, *extra: str) -> int:
    return main(["report", "spreadsheet", "--out", str(out), "--database-url", url, "--no-progress", *extra])


def _recalc(files: list[Path], workdir: Path) -> dict[Path, Path]:
    """Open every file in LibreOffice Calc (always recalculating on load) and save it back as .xlsx."""
    profile = workdir / "lo-profile"
    (profile / "user").mkdir(parents=True, exist_ok=True)
    (profile / "user" / "registrymodifications.xcu").write_text(
        '<?xml version="1.0" encoding="UTF-8"?>\n<oor:items xmlns:oor="http://openoffice.org/2001/registry" '
        'xmlns:xs="http://www.w3.org/2001/XMLSchema" xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance">\n'
        '<item oor:path="/org.openoffice.Office.Calc/Formula/Load"><prop oor:name="OOXMLRecalcMode" oor:op="fuse">'
        '<value>0</value></prop></item>\n</oor:items>\n')
    outdir = workdir / "recalc"
    outdir.mkdir(exist_ok=True)
    subprocess.run([SOFFICE, "--headless", "--norestore", f"-env:UserInstallation={profile.as_uri()}",
                    "--convert-to", "xlsx:Calc MS Excel 2007 XML", "--outdir", str(outdir), *map(str, files)],
                   check=True, capture_output=True, timeout=120)
    out = {f: outdir / f.name for f in files}
    for f, o in out.items():
        assert o.exists(), f"LibreOffice did not convert {f}"
    return out


def _errors(wb) -> list[str]:
    return [f"{ws.title}!{c.coordinate}={c.value}" for ws in wb for row in ws.iter_rows() for c in row
            if isinstance(c.value, str) and (c.value in ERRORS or c.value.startswith("Err:"))]


def _decision(ws) -> dict[str, object]:
    """The Decision sheet's lines: label → value."""
    return {r[0].value: r[1].value for r in ws.iter_rows(min_row=2) if r[0].value is not None and len(r) > 1}


def _decision_cell(ws, label: str):
    for r in ws.iter_rows(min_row=2):
        if r[0].value == label:
            return r[1]
    raise KeyError(label)


def _table(ws, first_label: str) -> list[dict[str, object]]:
    """The rows under the header row whose first cell is `first_label`, as dicts, up to a blank row."""
    rows = list(ws.iter_rows(values_only=True))
    start = next(i for i, r in enumerate(rows) if r and r[0] == first_label)
    head = [h for h in rows[start] if h is not None]
    out = []
    for r in rows[start + 1:]:
        if not r or r[0] is None:
            break
        out.append(dict(zip(head, r, strict=False)))
    return out


def _inputs(url: str, team: str | None = None) -> dec.DecisionInputs:
    with Ledger.open(url) as ledger:
        return dec.DecisionInputs.from_ledger(ledger, Window(team=team), load_policy(DEFAULT_POLICY))


def _q(path: Path, sql: str, *params):
    with sqlite3.connect(path) as conn:
        return conn.execute(sql, params).fetchone()


def approx(v):
    return pytest.approx(v, rel=1e-9, abs=1e-9)


@pytest.fixture(scope="module")
def books(tmp_path_factory):
    """Every workbook of the module, built with the command, recomputed by LibreOffice in one call."""
    tmp = tmp_path_factory.mktemp("workbook")
    bench = tmp / "stack.json"
    bench.write_text(json.dumps(STACK))
    dbs: dict[str, tuple[Path, str]] = {}

    def ledger(name, reqs, ups):
        p = tmp / f"{name}.db"
        dbs[name] = (p, _seed(p, reqs, ups))

    ledger("main", *_main_rows())
    ledger("empty", [], [])
    ledger("one_day", *_main_rows(days=1))
    ledger("api_only", *_main_rows(engine=False))
    ledger("in_house_only", *_main_rows(api=False))
    # an API backend the policy does not price, and an engine with uptime but no requests at all
    reqs, ups = _main_rows(days=1)
    reqs.append(_api_req(999, BASE + timedelta(hours=11), "alpha", 1000, 0, 100, backend="mystery"))
    ups.append(_uptime("local", BASE + timedelta(hours=9), 600.0))
    edge = _engine_req(998, BASE + timedelta(hours=12), "beta", 4000, 1000, 2.0)  # an engine with no uptime rows
    edge.backend = "edge"
    reqs.append(edge)
    ledger("unpriced", reqs, ups)
    files: dict[str, Path] = {}
    for name, (_, url) in dbs.items():
        files[name] = tmp / f"{name}.xlsx"
        assert _spreadsheet(files[name], url, "--bench", str(bench)) == 0
    files["team"] = tmp / "team.xlsx"
    assert _spreadsheet(files["team"], dbs["main"][1], "--team", "alpha", "--bench", str(bench)) == 0
    files["no_bench"] = tmp / "no_bench.xlsx"
    assert _spreadsheet(files["no_bench"], dbs["main"][1], "--bench", str(tmp / "missing.json")) == 0
    recalced = _recalc(list(files.values()), tmp) if SOFFICE else {}
    values = {k: openpyxl.load_workbook(recalced[f], data_only=True) for k, f in files.items()} if SOFFICE else {}
    return {"tmp": tmp, "dbs": dbs, "files": files, "bench": bench, "values": values}


# --------------------------------------------------------------------------------------------- the main ledger


@needs_lo
def test_workbook_recalculates_and_matches_sql_and_decide(books):
    path, url = books["dbs"]["main"]
    raw = openpyxl.load_workbook(books["files"]["main"])  # as written: formulas, no cached values
    wb = books["values"]["main"]
    assert wb.sheetnames == ["Traffic", "Prices", "In-house", "Decision", "Ladder", "Notes"]
    assert _errors(wb) == []
    # LibreOffice truly recalculated: a cell written as a formula (no cached value) came back with a number
    assert str(_decision_cell(raw["Decision"], "all-API USD/month").value).startswith("=")
    assert isinstance(_decision_cell(wb["Decision"], "all-API USD/month").value, float)
    assert raw["Traffic"].freeze_panes == "A2"

    # Traffic: totals row (SUM formulas) against SQL
    traffic = wb["Traffic"]
    total = next(r for r in traffic.iter_rows(values_only=True) if r[0] == "total")
    sql = _q(path, "SELECT COUNT(*), SUM(prompt_tokens), SUM(cached_prompt_tokens), SUM(completion_tokens), "
                   "SUM(cost_usd), COALESCE(SUM(counterfactual_cost_usd), 0) FROM requests")
    assert list(total[4:10]) == [approx(v) for v in sql]
    assert str(next(r for r in raw["Traffic"].iter_rows() if r[0].value == "total")[4].value).startswith("=SUM(")
    days = {r[0].date().isoformat() for r in traffic.iter_rows(min_row=2, values_only=True)
            if isinstance(r[0], datetime)}
    assert days == {"2024-05-01", "2024-05-02", "2024-05-03"}

    # In-house: utilisation, idle, $/Mtok at every level, from the engine_uptime and requests tables
    up, busy, paid, busy_usd = _q(path, "SELECT SUM(seconds), SUM(busy_seconds), SUM(seconds * device_hour_usd) "
                                        "/ 3600, SUM(busy_seconds * device_hour_usd) / 3600 FROM engine_uptime "
                                        "WHERE backend = 'smollm2'")
    tokens, = _q(path, "SELECT SUM(prompt_tokens + completion_tokens) FROM requests WHERE backend = 'smollm2'")
    (eng,) = _table(wb["In-house"], "engine backend")
    assert eng["engine backend"] == "smollm2"
    assert eng["measured utilisation"] == approx(busy / up)
    assert eng["cost of idle USD"] == approx(paid - busy_usd)
    assert eng["paid USD"] == approx(paid)
    tps = tokens / busy
    assert eng["tokens/s (engine)"] == approx(tps)
    for u in UTILISATION_LEVELS:
        assert eng[f"$/Mtok @ {u:.0%}"] == approx(2.5 / (tps * 3600 * u) * 1e6)
    assert eng["$/Mtok @ measured utilisation"] == approx(2.5 / (tps * 3600 * busy / up) * 1e6)
    hours = _table(wb["In-house"], "hour (UTC)")
    assert len(hours) == 12
    h0 = _q(path, "SELECT SUM(seconds), SUM(busy_seconds) FROM engine_uptime WHERE SUBSTR(created_at, 1, 13) = "
                  "'2024-05-01 09'")
    assert hours[0]["utilisation"] == approx(h0[1] / h0[0])

    # Decision: every output against decide() and against hand arithmetic over SQL
    x = _inputs(url)
    r = dec.decide(x)
    d = _decision(wb["Decision"])
    first, last = _q(path, "SELECT MIN(created_at), MAX(created_at) FROM requests")
    # One window for traffic and paid engine time: the requests' span and the uptime intervals' together (an
    # interval's row is stamped at its start and ends `seconds` later).
    with sqlite3.connect(path) as conn:
        intervals = conn.execute("SELECT created_at, seconds FROM engine_uptime").fetchall()
    starts = [datetime.fromisoformat(first), *(datetime.fromisoformat(t) for t, _ in intervals)]
    ends = [datetime.fromisoformat(last), *(datetime.fromisoformat(t) + timedelta(seconds=s) for t, s in intervals)]
    hours_window = (max(ends) - min(starts)).total_seconds() / 3600
    m = 730 / hours_window
    p, c, o = (v * m for v in sql[1:4])
    price = dec.api_prices(load_policy(DEFAULT_POLICY))["mini"]
    all_api = ((p - c) * price.input_per_mtok + c * price.cached_per_mtok + o * price.output_per_mtok) / 1e6
    hosted = (p + o) / (tps * 3600) / (busy / up) * 2.5
    assert d["window hours"] == approx(hours_window)
    assert d["all-API USD/month"] == approx(all_api) == approx(r.all_api_usd)
    assert d["all-hosted USD/month"] == approx(hosted) == approx(r.all_hosted_usd)
    api_p, api_c, api_o = _q(path, "SELECT SUM(prompt_tokens), SUM(cached_prompt_tokens), SUM(completion_tokens) "
                                   "FROM requests WHERE backend = 'mini'")
    mix = m * ((api_p - api_c) * price.input_per_mtok + api_c * price.cached_per_mtok
               + api_o * price.output_per_mtok) / 1e6 + up / 3600 * m * 2.5
    assert d["current mix USD/month"] == approx(mix) == approx(r.current_mix_usd)
    assert d["cost of idle USD/month"] == approx((up - busy) / 3600 * m * 2.5) == approx(r.idle_usd)
    assert d["break-even utilisation"] == approx((p + o) / (tps * 3600) * 2.5 / all_api)
    assert d["break-even utilisation"] == approx(r.break_even_utilisation)
    assert d["break-even daily tokens"] == approx(2.5 * 24 / (all_api / (p + o))) == approx(r.break_even_daily_tokens)
    assert d["capacity tokens/day"] == approx(tps * 86400) == approx(r.capacity_daily_tokens)
    assert d["utilisation to price all-hosted at"] == approx(busy / up)
    assert r.cheaper == "hosting" and d["at the utilisation above"] == "hosting is cheaper"

    # Prices: inputs are filled and noted; the ledger's price-table version is shown
    prices = _table(wb["Prices"], "API backend")
    assert [(q["API backend"], q["output $/Mtok"], q["price-table version"]) for q in prices] == [
        ("mini", approx(price.output_per_mtok), "litellm-test+0001")]
    cell = raw["Prices"]["E2"]
    assert cell.comment is not None and "edit me" in cell.comment.text and cell.fill.start_color.rgb.endswith("FFF2CC")

    # Ladder: formulas over the device $/hour and the Decision utilisation, as ladder_rows computes them
    from gateway.reports import ladder

    rungs = ladder.ladder_rows(STACK["stack"]["rows"], 2.5, busy / up)
    got = _table(wb["Ladder"], "rung")
    assert [g["rung"] for g in got] == [g.rung for g in rungs]
    for g, want in zip(got, rungs, strict=True):
        assert g["$/Mtok @ 100%"] == approx(want.usd_per_mtok_full)
        assert g["$/Mtok @ the Decision utilisation"] == approx(want.usd_per_mtok_measured)

    notes = {row[0]: row[1] for row in wb["Notes"].iter_rows(min_row=2, values_only=True) if row[0]}
    assert notes["rows with cost_note utilisation_floor"] == 1
    assert notes["database"] == db.redact_url(url)


@needs_lo
def test_editing_inputs_recomputes_every_output(books):
    _, url = books["dbs"]["main"]
    tmp = books["tmp"] / "edited"
    tmp.mkdir()
    wb = openpyxl.load_workbook(books["files"]["main"])
    ucell = _decision_cell(wb["Decision"], "utilisation to price all-hosted at")
    assert ucell.comment is not None and "edit me" in ucell.comment.text
    ucell.value = 0.2
    wb["Prices"]["E2"] = 1.2  # mini's output $/Mtok
    engine_row = next(r for r in wb["Prices"].iter_rows() if r[0].value == "smollm2")
    engine_row[2].value = 4.0  # smollm2's device $/hour
    edited = tmp / "edited.xlsx"
    wb.save(edited)
    got = openpyxl.load_workbook(_recalc([edited], tmp)[edited], data_only=True)
    assert _errors(got) == []

    x = _inputs(url)
    price = dataclasses.replace(x.reference, output_per_mtok=1.2)
    x2 = dataclasses.replace(x, reference=price, device_hour_usd=4.0,
                             api=[dataclasses.replace(a, price=price) for a in x.api])
    want = dec.decide(x2, utilisation=0.2)
    before = dec.decide(x)
    d = _decision(got["Decision"])
    for label, value in [("all-API USD/month", want.all_api_usd), ("all-hosted USD/month", want.all_hosted_usd),
                         ("current mix USD/month", want.current_mix_usd), ("cost of idle USD/month", want.idle_usd),
                         ("break-even utilisation", want.break_even_utilisation),
                         ("break-even daily tokens", want.break_even_daily_tokens)]:
        assert d[label] == approx(value), label
    assert want.all_api_usd != approx(before.all_api_usd) and want.all_hosted_usd != approx(before.all_hosted_usd)
    assert want.cheaper == "API" and d["at the utilisation above"] == "the API is cheaper"
    (eng,) = _table(got["In-house"], "engine backend")
    tps = x.tokens_per_s
    assert eng["$/Mtok @ 50%"] == approx(4.0 / (tps * 3600 * 0.5) * 1e6)
    ladder_first = _table(got["Ladder"], "rung")[0]
    assert ladder_first["$/Mtok @ 100%"] == approx(4.0 / (50.0 * 3600) * 1e6)
    assert ladder_first["$/Mtok @ the Decision utilisation"] == approx(4.0 / (50.0 * 3600 * 0.2) * 1e6)


# --------------------------------------------------------------------------------------------- edge cases


@needs_lo
@pytest.mark.parametrize("name", ["empty", "one_day", "api_only", "in_house_only", "unpriced", "team", "no_bench"])
def test_edge_cases_recalculate_without_error_cells(books, name):
    wb = books["values"][name]
    assert _errors(wb) == []
    d = _decision(wb["Decision"])
    url = books["dbs"]["main" if name in ("team", "no_bench") else name][1]
    x = _inputs(url, team="alpha" if name == "team" else None)
    r = dec.decide(x, utilisation=x.utilisation if x.utilisation is not None else 0.5)
    for label, value in [("all-API USD/month", r.all_api_usd), ("all-hosted USD/month", r.all_hosted_usd),
                         ("current mix USD/month", r.current_mix_usd), ("cost of idle USD/month", r.idle_usd),
                         ("break-even utilisation", r.break_even_utilisation),
                         ("break-even daily tokens", r.break_even_daily_tokens),
                         ("capacity tokens/day", r.capacity_daily_tokens)]:
        assert d[label] == ("n/a" if value is None else approx(value)), (name, label)
    if name == "empty":
        assert d["all-hosted USD/month"] == "n/a" and d["current mix USD/month"] == 0
        assert d["utilisation to price all-hosted at"] == 0.5 and d["measured utilisation"] == "n/a"
    if name == "api_only":
        assert d["all-hosted USD/month"] == "n/a" and d["measured tokens/s"] == "n/a"
    if name == "in_house_only":
        assert _table(wb["Decision"], "API traffic in the window") == []
        assert d["all-API USD/month"] > 0 and d["current mix USD/month"] == approx(r.current_mix_usd)
    if name == "unpriced":
        prices = {q["API backend"]: q for q in _table(wb["Prices"], "API backend")}
        assert prices["mystery"]["input $/Mtok"] is None and "unpriced" in prices["mystery"]["status"]
        engines = {e["engine backend"]: e for e in _table(wb["In-house"], "engine backend")}
        assert engines["local"]["tokens/s (engine)"] == 0 and engines["local"]["$/Mtok @ 50%"] == "n/a"
        assert engines["local"]["cost of idle USD"] == approx(3000 * 2.5 / 3600)
        e = engines["edge"]
        assert e["paid USD"] == e["cost of idle USD"] == e["up (paid) s"] == "no uptime recorded"
        assert e["measured utilisation"] == "n/a" and e["tokens/s (engine)"] == approx(5000 / 2.0)
        assert e["$/Mtok @ 100%"] == approx(2.5 / (2500 * 3600) * 1e6)
        assert "edge" in {q["engine backend"] for q in _table(wb["Prices"], "engine backend")}
    if name == "no_bench":
        assert "no ladder" in wb["Ladder"]["A2"].value and "missing.json" in wb["Ladder"]["A2"].value


@needs_lo
def test_team_filter(books):
    path, _ = books["dbs"]["main"]
    wb = books["values"]["team"]
    total = next(r for r in wb["Traffic"].iter_rows(values_only=True) if r[0] == "total")
    sql = _q(path, "SELECT COUNT(*), SUM(prompt_tokens), SUM(completion_tokens), SUM(cost_usd) FROM requests "
                   "WHERE team = 'alpha'")
    assert [total[4], total[5], total[7], total[8]] == [approx(v) for v in sql]
    share = (_q(path, "SELECT SUM(gpu_seconds) FROM requests WHERE team = 'alpha' AND backend = 'smollm2'")[0]
             / _q(path, "SELECT SUM(gpu_seconds) FROM requests WHERE backend = 'smollm2'")[0])
    up, busy = _q(path, "SELECT SUM(seconds), SUM(busy_seconds) FROM engine_uptime")
    (eng,) = _table(wb["In-house"], "engine backend")
    assert eng["up (paid) s"] == approx(up * share) and eng["busy s"] == approx(busy * share)
    assert eng["requests"] == _q(path, "SELECT COUNT(*) FROM requests WHERE team = 'alpha' AND backend = 'smollm2'")[0]


# --------------------------------------------------------------------------------------------- CSV and errors


def test_csv_writes_the_same_numbers(tmp_path, capsys):
    path = tmp_path / "l.db"
    url = _seed(path, *_main_rows())
    out = tmp_path / "csv"
    assert _spreadsheet(out, url, "--format", "csv", "--bench", str(tmp_path / "none.json")) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"wrote {out} (one CSV file per table)"
    # the summary, then one chargeback line per engine (list rate and amortised side by side)
    assert printed[1].startswith("prices: the policy that served the rows") or printed[1].startswith("prices: ")
    idle = next(i for i, line in enumerate(printed) if line.startswith("cost of idle: $"))
    assert [line.split(" ")[0] for line in printed[idle + 1:]] == ["chargeback"] * (len(printed) - idle - 1) != []
    for name in ("traffic", "prices", "in_house", "busy_by_hour", "decision", "ladder"):
        assert (out / f"{name}.csv").exists(), name

    def read(name):
        with (out / f"{name}.csv").open() as f:
            return list(csv.reader(f))

    traffic = read("traffic")
    assert traffic[0][:5] == ["day", "route", "backend", "cost basis", "requests"]
    total = next(r for r in traffic if r[0] == "total")
    sql = _q(path, "SELECT COUNT(*), SUM(prompt_tokens), SUM(cached_prompt_tokens), SUM(completion_tokens), "
                   "SUM(cost_usd) FROM requests")
    assert [float(v) for v in total[4:9]] == [approx(v) for v in sql]
    head, row = read("in_house")
    eng = dict(zip(head, row, strict=True))
    up, busy, paid, busy_usd = _q(path, "SELECT SUM(seconds), SUM(busy_seconds), SUM(seconds * device_hour_usd) "
                                        "/ 3600, SUM(busy_seconds * device_hour_usd) / 3600 FROM engine_uptime")
    assert float(eng["measured utilisation"]) == approx(busy / up)
    assert float(eng["cost of idle USD"]) == approx(paid - busy_usd)
    r = dec.decide(_inputs(url))
    d = {row[0]: row[1] for row in read("decision") if len(row) > 1}
    assert float(d["all-API USD/month"]) == approx(r.all_api_usd)
    assert float(d["all-hosted USD/month"]) == approx(r.all_hosted_usd)
    assert float(d["current mix USD/month"]) == approx(r.current_mix_usd)
    assert float(d["cost of idle USD/month"]) == approx(r.idle_usd)
    assert float(d["break-even utilisation"]) == approx(r.break_even_utilisation)
    assert d["at the utilisation above"] == "hosting is cheaper"
    assert read("ladder")[1][0].startswith("no ladder: LadderError")


def test_bad_since_and_unreachable_database_exit_1(tmp_path, capsys):
    url = _seed(tmp_path / "l.db", [], [])
    assert _spreadsheet(tmp_path / "b.xlsx", url, "--since", "last tuesday") == 1
    err = capsys.readouterr().err
    assert "--since 'last tuesday' is not a date" in err and "Traceback" not in err
    assert _spreadsheet(tmp_path / "b.xlsx", "sqlite:////nonexistent/dir/ledger.db") == 1
    err = capsys.readouterr().err
    assert "cannot read the ledger" in err and "Traceback" not in err
    assert _spreadsheet(tmp_path / "b.xlsx", url, "--policy", str(tmp_path / "nope.yaml")) == 1
    assert "cannot read file" in capsys.readouterr().err
    assert not (tmp_path / "b.xlsx").exists()


def test_a_missing_sqlite_ledger_is_an_error_and_stays_missing(tmp_path, capsys):
    # connecting used to create an empty file there, which the next command then read as an empty ledger
    missing = tmp_path / "typo.db"
    assert _spreadsheet(tmp_path / "b.xlsx", f"sqlite:///{missing}") == 1
    err = capsys.readouterr().err
    assert f"cannot read the ledger at sqlite:///{missing}: no such file" in err and "--database-url" in err
    assert not missing.exists() and not (tmp_path / "b.xlsx").exists()
