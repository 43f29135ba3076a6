"""Issue 34 (visibility): the workbook's In-house sheet shows what KV tiering saved — tokens restored from the
engine's host / disk tier instead of recomputed, the prefill rate measured from the ledger, and the device time
and money that restoring saved at that rate. LibreOffice recomputes the formulas; the figures must match SQL,
and editing the engine's $/hour on the Prices sheet must move the saving."""
from __future__ import annotations

from datetime import timedelta

import openpyxl
import pytest

from tests.gateway.test_report_workbook import (
    BASE,
    _engine_req,
    _errors,
    _q,
    _recalc,
    _seed,
    _spreadsheet,
    _table,
    _uptime,
    approx,
    needs_lo,
)

HEAD = "KV tiering: engine"


def _rows():
    reqs = [  # prefill rows: computed tokens and a TTFT, nothing restored
        _engine_req(1, BASE + timedelta(hours=9), "alpha", 2000, 10, 1.0, ttft_ms=800.0,
                    kv_restored_host_tokens=0, kv_restored_disk_tokens=0),
        _engine_req(2, BASE + timedelta(hours=9, minutes=5), "beta", 1200, 10, 0.7, cached=200, ttft_ms=400.0),
        # returning conversations: restored from host memory and from disk (their TTFT is not a prefill rate)
        _engine_req(3, BASE + timedelta(hours=10), "alpha", 2016, 10, 0.2, cached=2000, ttft_ms=30.0,
                    kv_restored_host_tokens=1984, kv_restored_disk_tokens=0),
        _engine_req(4, BASE + timedelta(hours=10, minutes=5), "beta", 1216, 10, 0.2, cached=1200, ttft_ms=90.0,
                    kv_restored_host_tokens=0, kv_restored_disk_tokens=992),
    ]
    return reqs, [_uptime("smollm2", BASE + timedelta(hours=h), 600.0) for h in (9, 10)]


@pytest.fixture(scope="module")
def book(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tiering")
    path = tmp / "tiering.db"
    url = _seed(path, *_rows())
    out = tmp / "tiering.xlsx"
    assert _spreadsheet(out, url) == 0
    return {"tmp": tmp, "path": path, "url": url, "out": out}


def test_the_sheet_writes_the_saving_as_formulas_with_values(book):
    raw = openpyxl.load_workbook(book["out"])
    (row,) = _table(raw["In-house"], HEAD)
    assert row["restored from host"] == 1984 and row["restored from disk"] == 992
    assert str(row["restored tokens"]).startswith("=")
    assert str(row["device s saved"]).startswith("=") and str(row["USD saved (list rate)"]).startswith("=")
    assert row["prefill tokens"] == 2000 + 1000  # rows 3 and 4 restored: left out
    assert row["prefill s (TTFT)"] == approx(1.2)


@needs_lo
def test_libreoffice_recomputes_the_saving_and_it_matches_sql(book):
    wb = openpyxl.load_workbook(_recalc([book["out"]], book["tmp"])[book["out"]], data_only=True)
    assert _errors(wb) == []
    (row,) = _table(wb["In-house"], HEAD)
    host, disk = _q(book["path"], "SELECT SUM(kv_restored_host_tokens), SUM(kv_restored_disk_tokens) FROM requests")
    computed, ttft = _q(book["path"], "SELECT SUM(prompt_tokens - cached_prompt_tokens), SUM(ttft_ms) / 1000.0 "
                                      "FROM requests WHERE COALESCE(kv_restored_host_tokens, 0) + "
                                      "COALESCE(kv_restored_disk_tokens, 0) = 0")
    rate = computed / ttft
    assert row["restored tokens"] == host + disk == 2976
    assert row["prefill tokens/s"] == approx(rate)
    assert row["device s saved"] == approx((host + disk) / rate)
    assert row["USD saved (list rate)"] == approx((host + disk) / rate * 2.5 / 3600)


@needs_lo
def test_editing_the_engine_price_moves_the_saving(book):
    edited = book["tmp"] / "edited"
    edited.mkdir()
    wb = openpyxl.load_workbook(book["out"])
    prices = wb["Prices"]
    cell = next(r[2] for r in prices.iter_rows() if r[0].value == "smollm2")
    cell.value = 10.0
    path = edited / "tiering.xlsx"
    wb.save(path)
    got = openpyxl.load_workbook(_recalc([path], edited)[path], data_only=True)
    (row,) = _table(got["In-house"], HEAD)
    assert row["USD saved (list rate)"] == approx(row["device s saved"] * 10.0 / 3600)
