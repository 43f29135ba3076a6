"""PostgreSQL unreachable under a running gateway (a TCP proxy in front of it, closed and reopened): known keys keep
working past the key cache's freshness window, revoked ones stay refused, unknown ones get a 503 with an OpenAI
body, and the rows of the outage land once the database is back."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from gateway import db
from gateway.keys import create_key
from gateway.testing.tcp_proxy import TcpProxy
from tests.e2e.conftest import ledger_rows, run_gateway
from tests.e2e.policy_builder import one_engine_route


@pytest.fixture
def pg_behind_proxy(pg_url):
    """(URL through the proxy, direct URL, the proxy): migrated, proxy open."""
    proxy = TcpProxy(target_port=make_url(pg_url).port or 5432).open()
    url = make_url(pg_url).set(port=proxy.port).render_as_string(hide_password=False)
    try:
        yield url, pg_url, proxy
    finally:
        proxy.close()


def _make_keys(url: str, n: int) -> list[tuple[str, str]]:
    async def make() -> list[tuple[str, str]]:
        engine = db.create_engine(url)
        try:
            return [(key, info.id) for key, info in [await create_key(engine, "search") for _ in range(n)]]
        finally:
            await engine.dispose()

    return asyncio.run(make())


def _revoke(url: str, key_id: str) -> None:
    engine = sa.create_engine(db.sync_url(url))
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE api_keys SET revoked = true WHERE id = :id"), {"id": key_id})
    engine.dispose()


def _chat(base_url: str, key: str) -> httpx.Response:
    return httpx.post(base_url + "/chat/completions", headers={"authorization": f"Bearer {key}"}, timeout=20,
                      json={"model": "local", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})


def test_a_database_outage_keeps_known_keys_working_and_refuses_what_it_cannot_check(standin, tmp_path,
                                                                                      pg_behind_proxy):
    url, direct_url, proxy = pg_behind_proxy
    with run_gateway(one_engine_route(standin), tmp_path, database_url=url) as gateway:
        (good, good_id), (revoked, revoked_id) = _make_keys(direct_url, 2)
        assert _chat(gateway.base_url, good).status_code == 200
        assert _chat(gateway.base_url, revoked).status_code == 200
        _revoke(direct_url, revoked_id)
        time.sleep(1.5)  # ~1 s (tests/gateway/test_auth_cache.py measures it), with slack for a loaded machine
        assert _chat(gateway.base_url, revoked).status_code == 401

        proxy.close()  # PostgreSQL unreachable: connections refused, open ones reset
        time.sleep(1.5)  # past the key cache's freshness window
        client = openai.OpenAI(base_url=gateway.base_url, api_key=good, max_retries=0)
        during = [client.chat.completions.with_raw_response.create(
            model="local", messages=[{"role": "user", "content": "hi"}], max_tokens=3) for _ in range(3)]
        during_ids = [reply.headers["x-request-id"] for reply in during]
        assert [m.id for m in client.models.list()] == ["local"]
        assert _chat(gateway.base_url, revoked).status_code == 401  # a revocation seen before still holds
        unknown = _chat(gateway.base_url, "sk-sy-never-seen-before")
        assert unknown.status_code == 503
        assert unknown.headers["content-type"].startswith("application/json")
        assert unknown.json()["error"]["type"] == "api_error" and int(unknown.headers["retry-after"]) >= 1
        assert unknown.headers["x-request-id"].startswith("req_")
        with pytest.raises(openai.APIStatusError) as err:  # the SDK sees a 503 (with retries on, it would retry)
            openai.OpenAI(base_url=gateway.base_url, api_key="sk-sy-never-seen-before", max_retries=0).models.list()
        assert err.value.status_code == 503

        proxy.open()  # back: a key created meanwhile works, and the outage's rows land
        [(new, _)] = _make_keys(direct_url, 1)
        deadline = time.time() + 15
        while (status := _chat(gateway.base_url, new).status_code) != 200 and time.time() < deadline:
            time.sleep(0.25)
        assert status == 200
        gateway.call(gateway.gw.services.ledger.flush)
        deadline = time.time() + 30
        while not set(during_ids) <= {r["request_id"] for r in ledger_rows(direct_url)} and time.time() < deadline:
            time.sleep(0.25)
        rows = {r["request_id"]: r for r in ledger_rows(direct_url)}
        assert set(during_ids) <= set(rows)
        assert all(rows[i]["status"] == "ok" and rows[i]["api_key_id"] == good_id for i in during_ids)


def test_a_database_that_stops_answering_costs_known_keys_one_bounded_wait(standin, tmp_path, pg_behind_proxy):
    """Blocked, not refused (packets dropped): a lookup hangs. A known key waits for it at most the lookup timeout
    once, then is answered from the cache at once; new keys get 503 without piling up connections."""
    from concurrent.futures import ThreadPoolExecutor

    from gateway.auth import LOOKUP_TIMEOUT_S

    url, direct_url, proxy = pg_behind_proxy
    with run_gateway(one_engine_route(standin), tmp_path, database_url=url) as gateway:
        [(good, _)] = _make_keys(direct_url, 1)
        assert _chat(gateway.base_url, good).status_code == 200
        proxy.hold()
        time.sleep(1.2)
        started = time.monotonic()
        assert _chat(gateway.base_url, good).status_code == 200
        first = time.monotonic() - started
        started = time.monotonic()
        assert [_chat(gateway.base_url, good).status_code for _ in range(5)] == [200] * 5
        then = (time.monotonic() - started) / 5
        started = time.monotonic()
        with ThreadPoolExecutor(20) as pool:
            statuses = list(pool.map(lambda i: _chat(gateway.base_url, f"sk-sy-guess-{i}").status_code, range(20)))
        flood = time.monotonic() - started
        assert set(statuses) == {503}
        proxy.release()
    assert first < LOOKUP_TIMEOUT_S + 2 and then < 1.0, (first, then)
    assert flood < LOOKUP_TIMEOUT_S + 3, flood
