"""The workbook on paper (issue 31 #11): printed (LibreOffice's PDF export, read back with poppler's pdftotext)
every sheet fits the page width, its longest table's header row repeats on each page, and the header and
footer name the sheet and the page. Without a print setup it printed as 28 pages with columns split.

Both workbooks of the module are printed in one soffice call (LibreOffice is slow to start).
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import openpyxl
import pytest
from openpyxl.utils import get_column_letter

from gateway.reports.workbook import HEADER_FILL, SHEET_ORDER
from tests.gateway.test_report_workbook import STACK, _main_rows, _seed, _spreadsheet

SOFFICE = shutil.which("soffice")
PDFTOTEXT = shutil.which("pdftotext")
needs_tools = pytest.mark.skipif(SOFFICE is None or PDFTOTEXT is None,
                                 reason="LibreOffice (soffice) or poppler (pdftotext) is not installed: make system-tools")
FOOTER = re.compile(r"^\s*(?P<sheet>\S[^\n]*?), page (?P<page>\d+) of (?P<pages>\d+)\s*$", re.MULTILINE)
# The smallest printable height of a page at 100%: A4 landscape is 8.27 in high, Letter 8.5 in (portrait: more).
LANDSCAPE_HEIGHT_IN = 8.27
DEFAULT_ROW_PT = 15.0


def _pdf(files: list[Path], workdir: Path) -> dict[Path, Path]:
    """Every workbook printed to PDF by LibreOffice, with a profile of its own (another soffice may be running)."""
    profile = workdir / "lo-profile"
    outdir = workdir / "pdf"
    outdir.mkdir(exist_ok=True)
    subprocess.run([SOFFICE, "--headless", "--norestore", f"-env:UserInstallation={profile.as_uri()}",
                    "--convert-to", "pdf", "--outdir", str(outdir), *map(str, files)],
                   check=True, capture_output=True, timeout=180)
    out = {f: outdir / (f.stem + ".pdf") for f in files}
    for f, o in out.items():
        assert o.exists(), f"LibreOffice did not print {f}"
    return out


def _pages(pdf: Path) -> list[str]:
    text = subprocess.run([PDFTOTEXT, "-layout", str(pdf), "-"], check=True, capture_output=True, text=True,
                          timeout=60).stdout
    pages = text.split("\f")
    return pages[:-1] if pages and not pages[-1].strip() else pages


def _by_sheet(pages: list[str]) -> dict[str, list[str]]:
    """Each sheet's pages, by the footer every page carries ('Traffic, page 2 of 8')."""
    out: dict[str, list[str]] = {}
    for i, page in enumerate(pages, start=1):
        found = FOOTER.findall(page)
        assert found, f"page {i} has no 'sheet, page n of N' footer:\n{page[-400:]}"
        sheet, n, total = found[-1]
        assert (int(n), int(total)) == (i, len(pages)), (i, found[-1])
        out.setdefault(sheet, []).append(page)
    return out


def _header_rows(ws) -> list[list[str]]:
    """The labels of each table's header row (the rows drawn with the header fill)."""
    out = []
    for row in ws.iter_rows():
        labels = [c.value for c in row if isinstance(c.value, str)]
        if len(labels) > 1 and all(c.fill.start_color.rgb.endswith(HEADER_FILL) for c in row if c.value):
            out.append(labels)
    return out


def _title_row(ws) -> int | None:
    """The row repeated at the top of each printed page ('$5:$5'); None for a sheet without a table header."""
    if not _header_rows(ws):
        assert ws.print_title_rows is None, ws.title
        return None
    assert ws.print_title_rows, f"{ws.title}: no header row repeated on each page"
    first, last = ws.print_title_rows.replace("$", "").split(":")
    assert first == last
    return int(first)


def _words(labels: list[str]) -> set[str]:
    return {w for label in labels for w in label.split()}


@pytest.fixture(scope="module")
def printed(tmp_path_factory):
    """A three-day ledger (every sheet short), a forty-day one (Traffic and In-house run onto more pages) and an
    empty one without a benchmark (the Ladder sheet is one paragraph saying why)."""
    tmp = tmp_path_factory.mktemp("print")
    bench = tmp / "stack.json"
    bench.write_text(json.dumps(STACK))
    books = {}
    for name, days in (("short", 3), ("long", 40), ("empty", 0)):
        url = _seed(tmp / f"{name}.db", *(_main_rows(days=days) if days else ([], [])))
        books[name] = tmp / f"{name}.xlsx"
        assert _spreadsheet(books[name], url, "--bench", str(bench if days else tmp / "missing.json")) == 0
    pdfs = _pdf(list(books.values()), tmp) if SOFFICE and PDFTOTEXT else {}
    return {name: (openpyxl.load_workbook(f), _pages(pdfs[f]) if pdfs else []) for name, f in books.items()}


def test_every_sheet_has_a_print_setup(printed):
    for name, (wb, _) in printed.items():
        for ws in wb:
            where = f"{name}:{ws.title}"
            assert ws.sheet_properties.pageSetUpPr.fitToPage, where
            assert (ws.page_setup.fitToWidth, ws.page_setup.fitToHeight) == (1, 0), where
            assert ws.print_area == f"'{ws.title}'!$A$1:${get_column_letter(ws.max_column)}${ws.max_row}", where
            title = _title_row(ws)
            assert title is None or [c.value for c in ws[title] if c.value] in _header_rows(ws), where
            assert "&A" in ws.oddHeader.center.text and "&P" in ws.oddFooter.center.text, where
            assert max(ws.page_margins.left, ws.page_margins.right) <= 0.75, where
            assert ws.page_setup.orientation in ("portrait", "landscape"), where
        assert wb["In-house"].page_setup.orientation == "landscape"  # 27 columns


@needs_tools
@pytest.mark.parametrize("name", ["short", "long", "empty"])
def test_printed_pages_name_their_sheet_and_never_split_columns(printed, name):
    wb, pages = printed[name]
    sheets = _by_sheet(pages)
    assert list(sheets) == list(SHEET_ORDER)
    for title, sheet_pages in sheets.items():
        ws = wb[title]
        title_row = _title_row(ws)
        repeated = _words([c.value for c in ws[title_row] if c.value]) if title_row else set()
        headers = _header_rows(ws)
        for i, page in enumerate(sheet_pages, start=1):
            words = set(page.split())
            # the repeated header row, whole on every page: one page holds every column
            assert repeated <= words, (title, i, sorted(repeated - words))
        for labels in headers:  # every table's header row, whole on one page
            assert any(_words(labels) <= set(p.split()) for p in sheet_pages), (title, labels)


@needs_tools
def test_a_short_sheet_prints_on_one_page(printed):
    """Fitted to the page width, a sheet whose rows fit the page height at 100% is one page (split columns
    made In-house alone several)."""
    wb, pages = printed["short"]
    sheets = _by_sheet(pages)
    short = []
    for ws in wb:
        m = ws.page_margins
        high = (LANDSCAPE_HEIGHT_IN - m.top - m.bottom) * 72
        rows = sum(ws.row_dimensions[r].height or DEFAULT_ROW_PT for r in range(1, ws.max_row + 1))
        if rows <= high:
            short.append(ws.title)
            assert len(sheets[ws.title]) == 1, (ws.title, len(sheets[ws.title]))
    assert {"Traffic", "Prices", "In-house", "Ladder"} <= set(short)


@needs_tools
def test_a_long_sheet_repeats_its_header_on_every_page(printed):
    wb, pages = printed["long"]
    sheets = _by_sheet(pages)
    assert len(sheets["Traffic"]) > 1 and len(sheets["In-house"]) > 1  # the ledger is long enough to show it
    for title in ("Traffic", "In-house"):
        ws = wb[title]
        title_row = _title_row(ws)
        first = ws.cell(row=title_row, column=1).value
        for page in sheets[title]:
            assert first in page, (title, first)
    # In-house: the repeated row is the hourly table's (its longest), not the one-row engine table's
    assert wb["In-house"].cell(row=_title_row(wb["In-house"]), column=1).value == "hour (UTC)"


@needs_tools
@pytest.mark.parametrize("name", ["short", "empty"])
def test_no_text_is_cut_off_at_the_page_edge(printed, name):
    """Every word the sheets hold (labels, notes, the definitions) is printed whole: wrapped text stays inside
    its column and the column inside the page."""
    wb, pages = printed[name]
    sheets = _by_sheet(pages)
    for ws in wb:
        printed_words = {w for page in sheets[ws.title] for w in page.split()}
        for row in ws.iter_rows():
            for c in row:
                if isinstance(c.value, str) and not c.value.startswith("="):
                    lost = set(c.value.split()) - printed_words
                    assert not lost, (ws.title, c.coordinate, sorted(lost))
