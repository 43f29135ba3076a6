"""`switchyard report spreadsheet`: the buy-versus-host workbook (or the same tables as CSV files).

Sheets: Traffic (per day, route and backend), Prices (the editable inputs: API $/Mtok, engine $/hour),
In-house (per engine: paid, busy, idle, $/Mtok at each utilisation; busy fraction by hour), Decision
(decision.decide's arithmetic as live formulas), Ladder ($/Mtok per optimisation rung) and Notes.
Every number comes from gateway/reports/figures.py and decision.py; the sheets are built once as rows
(gateway/reports/workbook_sheets.py) and rendered to either format.
"""
from __future__ import annotations

import argparse
import csv
import re
import sys
from dataclasses import dataclass
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any, TextIO

from sqlalchemy.exc import SQLAlchemyError

from gateway.reports import decision as dec
from gateway.reports import figures
from gateway.reports import workbook_layout as layout
from gateway.reports import workbook_sheets as ws
from gateway.reports.figures import Ledger, ReportError, Window

SHEET_ORDER = ("Traffic", "Prices", "In-house", "Decision", "Ladder", "Notes")
INPUT_FILL = "FFF2CC"  # light yellow: the cells to edit
HEADER_FILL = "DDEBF7"


@dataclass
class Book:
    sheets: list[ws.Sheet]
    inputs: dec.DecisionInputs
    decision: ws.DecisionCells
    summary: figures.Summary
    window: Window
    engines: list[figures.EngineRow]


def definitions() -> list[str]:
    """The bullet definitions of figures.py's docstring, then decision.py's model, one paragraph each."""
    out = []
    for doc in (figures.__doc__ or "", dec.__doc__ or ""):
        current: list[str] = []
        for line in doc.splitlines():
            text = line.strip()
            if text.startswith("- "):
                if current:
                    out.append(" ".join(current))
                current = [text[2:]]
            elif current and text:
                current.append(text)
            elif current:
                out.append(" ".join(current))
                current = []
        if current:
            out.append(" ".join(current))
    return [re.sub(r"\*\*(.+?)\*\*", r"\1", p) for p in out]


def build(ledger: Ledger, window: Window, policy, *, bench: str | None, database: str,
          progress: Any = None) -> Book:
    """Every sheet, in dependency order (a formula can only name a cell that already has an address).

    `policy`: a served_policy.ServedPolicies (each row priced by the policy that served it), or one Policy."""
    from gateway.pricing import price_table_version
    from gateway.reports.served_policy import ServedPolicies

    def step(name: str) -> None:
        if progress is not None:
            progress.set_description(name)
            progress.update(1)

    summary = ledger.summary(window)
    engines = ledger.engines(window)
    api_rows = ledger.api_backends(window)
    served = policy if isinstance(policy, ServedPolicies) else ServedPolicies.single(policy)
    inputs = dec.DecisionInputs.from_figures(summary, engines, ledger.api_backends_by_version(window), served)
    traffic = ws.traffic_sheet(ledger.traffic_daily(window))
    step("Traffic")
    prices, price_cells = ws.prices_sheet(served.latest, api_rows, engines, price_table_version, inputs.api)
    step("Prices")
    in_house, engine_cells = ws.in_house_sheet(engines, ledger.busy_by_hour(window), price_cells)
    step("In-house")
    decision, decision_cells = ws.decision_sheet(inputs, price_cells, engine_cells)
    step("Decision")
    ladder = ws.ladder_sheet(bench, price_cells, decision_cells)
    step("Ladder")
    notes = ws.notes_sheet(window.describe(), database, served.label(), summary, inputs,
                           datetime.now(UTC), definitions())
    step("Notes")
    return Book([traffic, prices, in_house, decision, ladder, notes], inputs, decision_cells, summary, window,
                engines)


# --------------------------------------------------------------------------------------------- rendering


def write_xlsx(book: Book, path: Path) -> None:
    from openpyxl import Workbook
    from openpyxl.comments import Comment
    from openpyxl.styles import Alignment, Font, PatternFill
    from openpyxl.utils import get_column_letter

    wb = Workbook()
    wb.remove(wb.active)
    input_fill = PatternFill("solid", start_color=INPUT_FILL, end_color=INPUT_FILL)
    header_fill = PatternFill("solid", start_color=HEADER_FILL, end_color=HEADER_FILL)
    bold = Font(name="Calibri", sz=11, bold=True)  # a bare <b/> reads as a serif font in LibreOffice
    for sheet in sorted(book.sheets, key=lambda s: SHEET_ORDER.index(s.title)):
        sh = wb.create_sheet(sheet.title)
        lay = layout.layout(sheet)
        for r, row in enumerate(sheet.rows, start=1):
            for c, cell in enumerate(row, start=1):
                value = cell.formula if cell.formula is not None else cell.value
                if value is None:
                    continue
                xc = sh.cell(row=r, column=c, value=value)
                if cell.fmt and (cell.formula is not None or isinstance(cell.value, int | float | date)):
                    xc.number_format = cell.fmt
                if cell.bold or r in lay.wrap_rows:
                    xc.font = bold
                if r in lay.wrap_rows:
                    xc.fill = header_fill
                wrap = r in lay.wrap_rows or r in lay.prose_rows or c in sheet.wrap
                if wrap or r in lay.heights:  # a row of several lines: every cell starts at its top
                    xc.alignment = Alignment(wrap_text=wrap, vertical="top")
                if cell.input:
                    xc.fill = input_fill
                    xc.comment = Comment(cell.note or "edit me", "switchyard")
        for c, w in lay.widths.items():
            sh.column_dimensions[get_column_letter(c)].width = w
        for r, h in lay.heights.items():
            sh.row_dimensions[r].height = h
        layout.merge_prose(sh, lay)
        layout.print_setup(sh, sheet, lay)
        if sheet.freeze:
            sh.freeze_panes = sheet.freeze
    path.parent.mkdir(parents=True, exist_ok=True)
    wb.save(path)


def _csv_value(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, date):
        return v.isoformat()
    if isinstance(v, float):
        return repr(v)
    return v


CSV_NAMES = {"traffic": "traffic.csv", "prices": "prices.csv", "engine_prices": "engine_prices.csv",
             "in_house": "in_house.csv", "busy_by_hour": "busy_by_hour.csv", "kv_tiering": "kv_tiering.csv",
             "decision": "decision.csv", "decision_api": "decision_api.csv", "ladder": "ladder.csv", "notes": "notes.csv"}


def write_csv(book: Book, directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for sheet in book.sheets:
        for table in sheet.tables:
            p = directory / CSV_NAMES[table.csv]
            with p.open("w", newline="", encoding="utf-8") as f:
                w = csv.writer(f)
                for row in sheet.csv_rows(table):
                    w.writerow([_csv_value(v) for v in row])
            written.append(p)
    return written


# --------------------------------------------------------------------------------------------- the command


def _usd(v: float | None) -> str:
    return "n/a" if v is None else f"${v:,.2f}"


def summary_lines(book: Book) -> list[str]:
    x, r, s = book.inputs, book.decision.result, book.summary
    assert r is not None
    u = book.decision.utilisation_value
    measured = f"{x.utilisation:.1%}" if x.utilisation is not None else "unknown (no engine uptime recorded)"
    priced = "" if x.utilisation is not None else f" (all-hosted priced at an assumed {u:.0%})"
    be = r.break_even_utilisation
    verdict = {"hosting": "hosting is cheaper", "API": "the API is cheaper", "unknown": "verdict unknown"}[r.cheaper]
    lines = [line for line in (x.window_note,) if line] + x.pricing
    return lines + [
        f"window: {book.window.describe()} ({x.window_hours:,.2f} h, traffic and engine time together)",
        f"requests: {s.requests:,} ({s.prompt_tokens + s.completion_tokens:,} tokens, ${s.spend_usd:,.2f} charged)",
        f"measured utilisation: {measured}{priced}",
        (f"monthly: all-API {_usd(r.all_api_usd)} vs all-hosted {_usd(r.all_hosted_usd)} vs current mix "
         f"{_usd(r.current_mix_usd)}"),
        (f"break-even utilisation: {'n/a' if be is None else f'{be:.1%}'} ({verdict} at {u:.1%}); "
        f"{dec.standing(r, u)}"),
        f"cost of idle: {_usd(r.idle_usd)}/month (paid device-hours not spent on requests)",
    ] + chargeback_lines(book.engines)


def chargeback_lines(engines: list[figures.EngineRow]) -> list[str]:
    """Per engine: the stable list-rate charges, the utilisation-amortised ones, and the paid time left over."""
    out = []
    for e in engines:
        left = e.unallocated_usd
        tail = "" if left is None else (f", paid ${e.paid_usd:,.2f}: ${left:,.2f} not charged at list rate "
                                        "(idle and unattributed work), shared out by device seconds")
        out.append(f"chargeback {e.backend} ({e.device_kind or 'device ?'}): ${e.busy_list_usd:,.4f} at the list "
                   f"rate (device-seconds x ${e.device_hour_usd or 0:,.2f}/h), ${e.charged_usd:,.4f} "
                   f"utilisation-amortised{tail}")
    return out


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    from gateway import db, settings
    from gateway.policy import PolicyError
    from gateway.reports.served_policy import resolve

    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    try:
        window = Window.parse(args.since, args.until, getattr(args, "team", None))
        url = settings.database_url(args.database_url)
        ledger = Ledger.open(url)
    except ReportError as e:
        print(f"ERROR: {e}", file=err)
        return 1
    try:  # each row by the policy version that served it; --policy is an explicit what-if
        policy = resolve(ledger, window, args.policy, settings.DEFAULT_POLICY)
    except (PolicyError, SQLAlchemyError) as e:
        ledger.close()
        print(f"ERROR: {e}", file=err)
        return 1
    from tqdm import tqdm

    disabled = bool(getattr(args, "no_progress", False)) or not (hasattr(err, "isatty") and err.isatty())
    fmt = getattr(args, "format", "xlsx") or "xlsx"
    target = Path(args.out)
    try:
        with ledger, tqdm(total=len(SHEET_ORDER) + 1, unit="sheet", disable=disabled, file=err) as bar:
            book = build(ledger, window, policy, bench=getattr(args, "bench", None), database=db.redact_url(url),
                         progress=bar)
            bar.set_description("writing")
            if fmt == "csv":
                write_csv(book, target)
            else:
                write_xlsx(book, target)
            bar.update(1)
    except ReportError as e:
        print(f"ERROR: {e}", file=err)
        return 1
    except SQLAlchemyError as e:
        print(f"ERROR: cannot read the ledger: {type(e).__name__}: {str(e).splitlines()[0]}", file=err)
        return 1
    except OSError as e:
        print(f"ERROR: cannot write {target}: {e.strerror or e}", file=err)
        return 1
    print(f"wrote {target}" + (" (one CSV file per table)" if fmt == "csv" else ""), file=out)
    for line in summary_lines(book):
        print(line, file=out)
    return 0
