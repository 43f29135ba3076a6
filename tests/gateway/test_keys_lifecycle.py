"""Key lifecycle on real SQLite and PostgreSQL: gateway/keys.py, and `switchyard keys …` as real subprocesses."""
from __future__ import annotations

import asyncio
import json
import math

import pytest
import sqlalchemy as sa

from gateway import db, keys
from tests.e2e.conftest import run_cli


def _rows(url: str) -> list[dict]:
    engine = sa.create_engine(db.sync_url(url))
    try:
        with engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(sa.text("SELECT * FROM api_keys ORDER BY id"))]
    finally:
        engine.dispose()


def _run(url: str, work):
    async def go():
        engine = db.create_engine(url)
        try:
            return await work(engine)
        finally:
            await engine.dispose()

    return asyncio.run(go())


def _cli(url: str, *args: str):
    return run_cli("keys", *args, "--database-url", url)


def _created(result) -> tuple[str, str]:
    """(key, id) from `keys create` / `keys rotate` output: the key is the last line, the id in the first."""
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    key_id = next(word for word in lines[0].split() if word.startswith("key_"))
    return lines[-1], key_id


# ------------------------------------------------------------------ the domain module, both databases


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1.0, 0.0, 0, True, "5"])
def test_budget_must_be_finite_and_positive(migrated_db_url, bad):
    """Regression: `--budget-usd nan` used to make a key with no effective budget (nan compares false)."""
    with pytest.raises(keys.KeyInputError, match="budget"):
        _run(migrated_db_url, lambda e: keys.create_key(e, "t", budget_usd=bad))
    assert _rows(migrated_db_url) == []


@pytest.mark.parametrize("field, bad", [("rpm", 0), ("rpm", -5), ("tpm", 2**31), ("rpm", 1.5), ("tpm", math.nan),
                                        ("rpm", True)])
def test_limits_must_be_whole_and_positive(migrated_db_url, field, bad):
    with pytest.raises(keys.KeyInputError, match=field):
        _run(migrated_db_url, lambda e: keys.create_key(e, "t", **{field: bad}))
    assert _rows(migrated_db_url) == []


def test_lifecycle_update_rotate_revoke(migrated_db_url):
    url = migrated_db_url
    key, info = _run(url, lambda e: keys.create_key(e, "search", budget_usd=2.5, rpm=10, routes="a, b,a"))
    assert info.routes == ("a", "b") and info.allows("a") and not info.allows("c")
    found = _run(url, lambda e: keys.find_key(e, keys.hash_key(key)))
    assert found == info

    updated = _run(url, lambda e: keys.update_key(e, info.id, tpm=500, budget_usd=None, routes=["c"]))
    assert (updated.budget_usd, updated.rpm, updated.tpm, updated.routes) == (None, 10, 500, ("c",))
    assert updated.updated_at is not None
    with pytest.raises(keys.KeyInputError):  # a bad value changes nothing, the good ones beside it included
        _run(url, lambda e: keys.update_key(e, key, rpm=99, budget_usd=math.nan))
    assert _run(url, lambda e: keys.get_key(e, key)).rpm == 10  # named by its plaintext too
    with pytest.raises(keys.KeyInputError, match="nothing to update"):
        _run(url, lambda e: keys.update_key(e, info.id))

    new_key, rotated = _run(url, lambda e: keys.rotate_key(e, info.id))
    assert rotated.id == info.id and rotated.routes == ("c",) and rotated.tpm == 500 and rotated.rotated_at
    assert _run(url, lambda e: keys.find_key(e, keys.hash_key(key))) is None  # the old secret is dead
    assert _run(url, lambda e: keys.find_key(e, keys.hash_key(new_key))).id == info.id

    revoked = _run(url, lambda e: keys.revoke_key(e, new_key))
    assert revoked.revoked and revoked.revoked_at is not None
    assert _run(url, lambda e: keys.find_key(e, keys.hash_key(new_key))) is None
    for change in (lambda e: keys.revoke_key(e, info.id), lambda e: keys.rotate_key(e, info.id),
                   lambda e: keys.update_key(e, info.id, rpm=5)):
        with pytest.raises(keys.KeyRevoked):
            _run(url, change)
    with pytest.raises(keys.KeyNotFound):
        _run(url, lambda e: keys.revoke_key(e, "key_000000000000"))
    rows = _rows(url)
    assert len(rows) == 1 and rows[0]["rpm"] == 10 and key not in str(rows) and new_key not in str(rows)


@pytest.mark.parametrize("bad", ["", " , ", "a,,b", "a\x00b", "x" * 300])
def test_routes_are_checked(migrated_db_url, bad):
    with pytest.raises(keys.KeyInputError, match="routes"):
        _run(migrated_db_url, lambda e: keys.create_key(e, "t", routes=bad))
    assert _rows(migrated_db_url) == []


def test_team_with_a_nul_byte_is_refused(migrated_db_url):
    with pytest.raises(keys.KeyInputError, match="control"):
        _run(migrated_db_url, lambda e: keys.create_key(e, "a\x00b"))


# ------------------------------------------------------------------ the CLI, real subprocesses, both databases


def test_cli_lifecycle(db_url):
    url = db_url
    key, key_id = _created(_cli(url, "create", "--team", "search", "--budget-usd", "3", "--rpm", "60",
                                "--routes", "gpt-4o-mini,auto"))
    admin_key, admin_id = _created(_cli(url, "create", "--team", "ops", "--admin"))

    updated = _cli(url, "update", key, "--tpm", "1000", "--rpm", "none", "--routes", "auto,gpt-4o-mini")
    assert updated.returncode == 0, updated.stderr
    assert "rpm" not in updated.stdout and "tpm=1000" in updated.stdout

    new_key, same_id = _created(_cli(url, "rotate", key_id))
    assert same_id == key_id and new_key != key
    stored = {r["id"]: r for r in _rows(url)}
    assert stored[key_id]["key_hash"] == keys.hash_key(new_key) and not stored[key_id]["revoked"]

    revoked = _cli(url, "revoke", new_key)
    assert revoked.returncode == 0 and key_id in revoked.stdout and new_key not in revoked.stdout
    assert {r["id"]: r for r in _rows(url)}[key_id]["revoked"]

    listed = _cli(url, "list", "--all")
    assert listed.returncode == 0, listed.stderr
    header, *lines = listed.stdout.strip().splitlines()
    assert header.split() == ["id", "team", "budget_usd", "rpm", "tpm", "routes", "admin", "revoked", "created"]
    row = next(line.split() for line in lines if line.startswith(key_id))
    assert row[:7] == [key_id, "search", "3", "-", "1000", "auto,gpt-4o-mini", "no"] and row[7] != "no"
    assert next(line.split() for line in lines if line.startswith(admin_id))[:8] == [
        admin_id, "ops", "-", "-", "-", "all", "yes", "no"]
    for secret in (key, new_key, admin_key, keys.hash_key(new_key), keys.hash_key(admin_key)):
        assert secret not in listed.stdout
    live = json.loads(_cli(url, "list", "--json").stdout)  # revoked keys only with --all
    assert [r["id"] for r in live] == [admin_id] and live[0]["admin"] is True and "key_hash" not in live[0]


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0"])
def test_cli_create_refuses_a_budget_that_is_not_finite_and_positive(sqlite_url, value):
    """Regression: `keys create --budget-usd nan` made a key that no budget check could stop."""
    result = _cli(sqlite_url, "create", "--team", "t", "--budget-usd", value)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "--budget-usd" in result.stderr, result.stderr
    assert _rows(sqlite_url) == []


def test_cli_update_revoke_rotate_errors_change_nothing(sqlite_url):
    key, key_id = _created(_cli(sqlite_url, "create", "--team", "t", "--budget-usd", "1", "--rpm", "5"))
    before = _rows(sqlite_url)
    for args, code, words in [
        (("update", key_id, "--budget-usd", "nan", "--rpm", "7"), 2, "--budget-usd"),
        (("update", key_id, "--tpm", "-1"), 2, "--tpm"),
        (("update", "key_nope", "--rpm", "3"), 1, "no key matches key_nope"),
        (("revoke", "sk-sy-not-a-key"), 1, "no key matches the key given"),
    ]:
        result = _cli(sqlite_url, *args)
        assert result.returncode == code and words in result.stderr, (args, result.stderr)
        assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr
        assert "sk-sy-not-a-key" not in result.stderr  # a secret given by mistake is not echoed
    assert _rows(sqlite_url) == before
    assert _cli(sqlite_url, "revoke", key_id).returncode == 0
    again = _cli(sqlite_url, "rotate", key)
    assert again.returncode == 1 and "is revoked" in again.stderr


@pytest.mark.parametrize("command", ["list", "create", "update", "rotate", "revoke"])
def test_every_keys_command_has_help(command, capsys):
    from gateway.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["keys", command, "--help"])
    assert exit_.value.code == 0 and "usage: switchyard keys " + command in capsys.readouterr().out
