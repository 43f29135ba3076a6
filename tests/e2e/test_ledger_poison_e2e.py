"""Issue 30, defect 1 and /health's ledger part, through the whole gateway on PostgreSQL with the openai SDK.

Before the fix, `{"model": "x\\u0000"}` from any key made PostgreSQL refuse the row; the writer took that for an
outage and every later row of every tenant only reached the spool, while /health said `ok`.
"""
from __future__ import annotations

import time

import httpx
import openai
import psycopg
import pytest

from tests.e2e.conftest import MASTER_KEY, ledger_rows, run_gateway
from tests.e2e.policy_builder import one_engine_route

HI = [{"role": "user", "content": "hi"}]


def _health(gateway) -> dict:
    return httpx.get(gateway.root + "/health", timeout=10).json()


def _wait(predicate, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


def test_a_nul_in_a_model_name_is_one_clean_row_and_health_reports_the_spool(pg_url, standin, tmp_path):
    with run_gateway(one_engine_route(standin), tmp_path, database_url=pg_url) as gateway:
        client = openai.OpenAI(base_url=gateway.base_url, api_key=MASTER_KEY, max_retries=0)
        with pytest.raises(openai.APIStatusError) as refused:  # the attack: any key, one NUL
            client.chat.completions.create(model="x\u0000", messages=HI, max_tokens=2)
        assert 400 <= refused.value.status_code < 500
        raw = httpx.post(gateway.base_url + "/chat/completions", timeout=10,
                         headers={"authorization": f"Bearer {MASTER_KEY}", "content-type": "application/json"},
                         content=b'{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}')
        assert 400 <= raw.status_code < 500
        for _ in range(3):  # later rows of every tenant still reach the database
            client.chat.completions.create(model="local", messages=HI, max_tokens=2)
        gateway.call(gateway.gw.services.ledger.flush)
        healthy = _health(gateway)
        assert healthy["ledger"] == {"status": "ok", "database": True, "queue": 0, "spool_rows": 0,
                                     "spool_age_s": 0.0, "spool_error": None, "quarantined": 0, "lost": 0}
        assert healthy["database"] is True and healthy["ledger_queue"] == 0  # the older fields stay
        rows = ledger_rows(pg_url)
        assert len(rows) == 5 and sum(r["status"] == "ok" for r in rows) == 3
        assert "x\ufffd" in {r["requested_model"] for r in rows}

        # The table goes away (a botched migration): rows only reach the spool, and /health says so.
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute("ALTER TABLE requests RENAME TO requests_away")
        for _ in range(4):
            client.chat.completions.create(model="local", messages=HI, max_tokens=2)  # clients see nothing
        gateway.call(gateway.gw.services.ledger.flush)
        time.sleep(0.3)
        spooled = _health(gateway)
        assert spooled["status"] == "degraded" and spooled["ledger"]["status"] == "degraded"
        assert spooled["ledger"]["spool_rows"] == 4 and spooled["ledger"]["spool_age_s"] >= 0.3
        assert spooled["database"] is False

        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute("ALTER TABLE requests_away RENAME TO requests")
        recovered = _wait(lambda: (h := _health(gateway))["ledger"]["status"] == "ok" and h)
        assert recovered["ledger"]["spool_rows"] == 0 and recovered["status"] == "ok"
    rows = ledger_rows(pg_url)
    assert len(rows) == 9 and len({r["request_id"] for r in rows}) == 9
