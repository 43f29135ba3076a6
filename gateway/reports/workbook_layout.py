"""How the workbook's sheets look on screen and on paper: column widths, wrapped text and row heights, and each
sheet's print setup (fit to the page width, landscape where wide, header rows repeated, a print area, margins,
the sheet name and page number in the header and footer).

Without a print setup the workbook printed (or exported to PDF) as 28 pages with columns split across pages.
Widths are measured in Excel's unit (the width of a '0' in the default font: about 5.25 pt in Calibri, about
7 pt where LibreOffice lacks Calibri's metrics); row heights in points. Text lengths stand in for rendered
widths, rounded up so that wrapped text is never clipped.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import date
from typing import Any

from gateway.reports import workbook_sheets as ws

MIN_WIDTH = 8
MAX_WIDTH = 60
NUMBER_HEADROOM = 3  # an edited input can make a figure longer than the one written: no '###' when printed
LINE_PT = 15.0  # one line of 11 pt text
PROSE_WIDTH = 72  # a paragraph's column, when nothing else sets one
PORTRAIT_MAX_WIDTH = 75  # wider than a portrait page holds at 100% (LibreOffice without Calibri: ~7 pt a unit)
MARGINS_IN = {"left": 0.5, "right": 0.5, "top": 0.75, "bottom": 0.75, "header": 0.3, "footer": 0.3}
TITLE = "Switchyard buy versus host"
HEADER_CENTER = "&A"  # the sheet's name
FOOTER_CENTER = "&A, page &P of &N"


@dataclass
class Layout:
    widths: dict[int, float] = field(default_factory=dict)  # column (1-based) → width
    heights: dict[int, float] = field(default_factory=dict)  # row (1-based) → height in points, where > 1 line
    wrap_rows: set[int] = field(default_factory=set)  # header rows: every cell wraps
    prose_rows: set[int] = field(default_factory=set)  # one-cell rows merged across the columns and wrapped
    columns: int = 1  # the print area's width in columns
    landscape: bool = False

    @property
    def total_width(self) -> float:
        return sum(self.widths.get(c, MIN_WIDTH) for c in range(1, self.columns + 1))


def shown(cell: ws.Cell) -> str:
    """The cell's text as its number format displays it (close enough to size a column)."""
    v = cell.value
    if isinstance(v, bool) or not isinstance(v, int | float):
        return v.isoformat() if isinstance(v, date) else ("" if v is None else str(v))
    fmt = cell.fmt or ""
    if fmt == ws.PCT:
        return f"{v:.1%}"
    if fmt == ws.INT:
        return f"{v:,.0f}"
    decimals = 4 if fmt in (ws.USD_MTOK, ws.USD_HOUR) else 2
    text = f"{v:,.{decimals}f}" if isinstance(v, float) or fmt else str(v)
    return ("$" if fmt.startswith('"$"') else "") + text + ("×" if fmt == ws.X else "")


def wrapped_lines(text: str, width: float) -> int:
    """Lines the text takes wrapped at word boundaries in a column `width` wide (a word longer than a line
    breaks wherever it must)."""
    per_line = max(int(width) - 1, 1)
    lines, used = 1, 0
    for word in text.split():
        n = len(word)
        if used and used + 1 + n <= per_line:
            used += 1 + n
            continue
        if used:
            lines, used = lines + 1, 0
        extra = (n - 1) // per_line  # a word longer than a line runs onto the next ones
        lines, used = lines + extra, n - extra * per_line
    return lines


def layout(sheet: ws.Sheet) -> Layout:
    """Widths from the cells' displayed text (header labels wrap, so only their longest word counts), the
    sheet's own widths where it sets them, and the heights of rows whose text wraps."""
    out = Layout()
    out.wrap_rows = {t.first for t in sheet.tables if len(sheet.rows[t.first - 1]) > 1}
    out.columns = max((len(r) for r in sheet.rows), default=1)
    for r, row in enumerate(sheet.rows, start=1):
        if len(row) == 1:
            if row[0].value is not None and row[0].value != "":
                out.prose_rows.add(r)
            continue
        for c, cell in enumerate(row, start=1):
            text = shown(cell)
            if not text:
                continue
            if r in out.wrap_rows or c in sheet.wrap:
                need = max(len(w) for w in text.split()) + 2
            else:
                need = len(text) + 2 + (NUMBER_HEADROOM if isinstance(cell.value, int | float) else 0)
            out.widths[c] = max(out.widths.get(c, MIN_WIDTH), min(need, MAX_WIDTH))
    out.widths.update(sheet.widths)
    prose = max((len(shown(sheet.rows[r - 1][0])) + 2 for r in out.prose_rows), default=0)
    if out.columns == 1 and prose:  # a sheet of prose alone (a Ladder that could not be built): a readable width
        out.widths[1] = max(out.widths.get(1, MIN_WIDTH), min(prose, PROSE_WIDTH))
    for r, row in enumerate(sheet.rows, start=1):
        if r in out.prose_rows:
            lines = wrapped_lines(shown(row[0]), out.total_width)
        else:
            lines = max((wrapped_lines(shown(cell), out.widths.get(c, MIN_WIDTH) - (1 if r in out.wrap_rows else 0))
                         for c, cell in enumerate(row, start=1) if r in out.wrap_rows or c in sheet.wrap),
                        default=1)
        if lines > 1:
            out.heights[r] = lines * LINE_PT
    out.landscape = out.total_width > PORTRAIT_MAX_WIDTH
    return out


def title_row(sheet: ws.Sheet) -> int | None:
    """The header row repeated on every page: the longest table's (the one that runs onto more pages). Excel and
    LibreOffice repeat it from the page after the one it is printed on."""
    tables = [t for t in sheet.tables if len(sheet.rows[t.first - 1]) > 1]
    if not tables:
        return None
    return max(tables, key=lambda t: t.last - t.first).first


def print_setup(xs: Any, sheet: ws.Sheet, lay: Layout) -> None:
    """One sheet's page setup on an openpyxl worksheet: every column on one page width, as many pages down as
    the rows need, the longest table's header row repeated on each page."""
    from openpyxl.utils import get_column_letter
    from openpyxl.worksheet.page import PageMargins

    last_col = get_column_letter(lay.columns)
    xs.print_area = f"A1:{last_col}{max(len(sheet.rows), 1)}"
    title = title_row(sheet)
    if title is not None:
        xs.print_title_rows = f"{title}:{title}"
    xs.sheet_properties.pageSetUpPr.fitToPage = True
    xs.page_setup.fitToWidth = 1
    xs.page_setup.fitToHeight = 0  # as many pages down as needed
    xs.page_setup.orientation = "landscape" if lay.landscape else "portrait"
    xs.page_margins = PageMargins(**MARGINS_IN)
    xs.print_options.horizontalCentered = False
    for hf in (xs.oddHeader, xs.evenHeader, xs.firstHeader):
        hf.left.text, hf.center.text = TITLE, HEADER_CENTER
    for hf in (xs.oddFooter, xs.evenFooter, xs.firstFooter):
        hf.center.text = FOOTER_CENTER


def merge_prose(xs: Any, lay: Layout) -> None:
    """One-cell rows (notes, explanations) span the print width and wrap there instead of running off it."""
    if lay.columns > 1:
        for r in sorted(lay.prose_rows):
            xs.merge_cells(start_row=r, start_column=1, end_row=r, end_column=lay.columns)
