"""The key cache against a real key table (SQLite): revocations seen within a second, one query per burst,
a bounded negative cache, and stale answers (not 500s) while the key store cannot be reached."""
from __future__ import annotations

import asyncio
import time

import pytest
import sqlalchemy as sa

from gateway import db
from gateway.auth import Authenticator
from gateway.keys import create_key
from openai_wire import APIError


@pytest.fixture
def key_db(tmp_path):
    url = f"sqlite:///{tmp_path / 'keys.db'}"
    db.upgrade(url)
    return url


def _count_key_queries(engine) -> list[int]:
    seen = [0]

    def count(conn, cursor, statement, *args) -> None:
        if "FROM api_keys" in statement:
            seen[0] += 1

    sa.event.listen(engine.sync_engine, "before_cursor_execute", count)
    return seen


def _revoke(url: str, key_id: str) -> None:
    engine = sa.create_engine(db.sync_url(url))
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE api_keys SET revoked = :t WHERE id = :id"), {"t": True, "id": key_id})
    engine.dispose()


def test_a_revoked_key_is_refused_within_one_second(key_db):
    async def scenario() -> float:
        engine = db.create_engine(key_db)
        key, info = await create_key(engine, "search")
        auth = Authenticator(engine, None)
        assert (await auth.authenticate(f"Bearer {key}")).id == info.id
        await asyncio.to_thread(_revoke, key_db, info.id)
        revoked_at = time.monotonic()
        try:
            while time.monotonic() - revoked_at < 5:
                try:
                    await auth.authenticate(f"Bearer {key}")
                except APIError as exc:
                    assert exc.status == 401
                    return time.monotonic() - revoked_at
                await asyncio.sleep(0.02)  # steady traffic on the key: the cache is in use the whole time
            raise AssertionError("revoked key still accepted after 5 s")
        finally:
            await auth.aclose()
            await engine.dispose()

    assert asyncio.run(scenario()) <= 1.2


def test_a_burst_of_one_uncached_key_makes_one_query(key_db):
    async def scenario() -> int:
        engine = db.create_engine(key_db)
        key, info = await create_key(engine, "search")
        queries = _count_key_queries(engine)
        auth = Authenticator(engine, None)
        results = await asyncio.gather(*(auth.authenticate(f"Bearer {key}") for _ in range(200)))
        assert {r.id for r in results} == {info.id}
        # A busy key is revalidated in the background, never one query per request.
        for _ in range(300):
            await auth.authenticate(f"Bearer {key}")
            await asyncio.sleep(0.005)
        await auth.aclose()
        await engine.dispose()
        return queries[0]

    queries = asyncio.run(scenario())
    assert 1 <= queries <= 6, queries  # 1 for the burst, then ~2 a second over the ~1.5 s of steady traffic


def test_unknown_key_flood_is_bounded_and_known_keys_stay_cached(key_db):
    async def scenario() -> None:
        engine = db.create_engine(key_db)
        key, _ = await create_key(engine, "search")
        auth = Authenticator(engine, None, max_unknown=500)
        await auth.authenticate(f"Bearer {key}")
        for i in range(2_000):
            with pytest.raises(APIError) as err:
                await auth.authenticate(f"Bearer sk-guess-{i}")
            assert err.value.status == 401
        assert len(auth._unknown) <= 500 and len(auth._known) == 1
        await auth.aclose()
        await engine.dispose()

    asyncio.run(scenario())


def test_while_the_key_store_fails_known_keys_keep_their_last_answer_and_new_keys_get_503(key_db):
    """A real engine whose table disappears (what a database that stopped answering looks like to a query)."""
    async def scenario() -> None:
        engine = db.create_engine(key_db)
        good, _ = await create_key(engine, "search")
        revoked, revoked_info = await create_key(engine, "search")
        await asyncio.to_thread(_revoke, key_db, revoked_info.id)
        auth = Authenticator(engine, None, fresh_s=0.2)
        await auth.authenticate(f"Bearer {good}")
        with pytest.raises(APIError):
            await auth.authenticate(f"Bearer {revoked}")
        async with engine.begin() as conn:
            await conn.execute(sa.text("ALTER TABLE api_keys RENAME TO api_keys_gone"))
        await asyncio.sleep(0.3)  # past the freshness window
        assert (await auth.authenticate(f"Bearer {good}")).team == "search"
        assert not auth.database_reachable
        with pytest.raises(APIError) as err:
            await auth.authenticate(f"Bearer {revoked}")
        assert err.value.status == 401  # a revocation seen before the outage still holds
        with pytest.raises(APIError) as err:
            await auth.authenticate("Bearer sk-sy-never-seen")
        assert err.value.status == 503 and err.value.headers["Retry-After"]
        async with engine.begin() as conn:
            await conn.execute(sa.text("ALTER TABLE api_keys_gone RENAME TO api_keys"))
        await asyncio.sleep(0.3)
        await auth.authenticate(f"Bearer {good}")  # stale answer; its background retry sees the store back
        await asyncio.sleep(0.1)
        assert auth.database_reachable
        with pytest.raises(APIError) as err:
            await auth.authenticate("Bearer sk-sy-never-seen")
        assert err.value.status == 401
        await auth.aclose()
        await engine.dispose()

    asyncio.run(scenario())
