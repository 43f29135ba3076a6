"""Keys with a lifecycle through real gateways: the /admin/keys API (httpx), per-key routes on every /v1
endpoint (the openai SDK), revocation seen by two `switchyard serve` processes on one PostgreSQL database
within a second, and the first-start admin key kept out of a piped stdout."""
from __future__ import annotations

import asyncio
import os
import pty
import re
import select
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from gateway import db, keys
from tests.e2e.conftest import MASTER_KEY, free_port, run_cli, run_gateway, wait_http
from tests.e2e.policy_builder import litellm, policy


def policy_text(standin: str) -> str:
    return policy(backends={"chat": litellm(standin), "embed": litellm(standin, model="openai/text-embedding-3-small")},
                  routes={"chatty": {"backend": "chat"}, "vectors": {"backend": "embed"}, "other": {"backend": "chat"}})
REVOKE_WITHIN_S = 1.0  # the promise: every gateway on the database refuses a revoked key within a second
POLL_S = 0.02


@pytest.fixture
def gateway(standin, tmp_path):
    with run_gateway(policy_text(standin), tmp_path) as running:
        yield running


def _admin(gateway, key: str = MASTER_KEY) -> httpx.Client:
    return httpx.Client(base_url=gateway.root, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def _is_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["x-request-id"].startswith("req_")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code, error
    return error


def _refused_after(probe, started: float, limit_s: float) -> float | None:
    """Seconds from `started` until `probe()` answers 401 (polling), or None if it never did within limit_s."""
    while True:
        now = time.monotonic()
        if probe() == 401:
            return now - started
        if now - started > limit_s:
            return None
        time.sleep(POLL_S)


def test_admin_api_needs_the_master_key_or_an_admin_key(gateway):
    with httpx.Client(base_url=gateway.root, timeout=30) as anonymous:
        _is_openai_error(anonymous.get("/admin/keys"), 401, "invalid_api_key")
        _is_openai_error(anonymous.post("/admin/keys", json={"team": "x"}), 401)
        _is_openai_error(anonymous.delete("/admin/keys/key_0", headers={"Authorization": "Bearer sk-sy-wrong"}), 401)
    with _admin(gateway) as master:
        client_key = master.post("/admin/keys", json={"team": "apps"}).json()
        admin_key = master.post("/admin/keys", json={"team": "ops", "admin": True}).json()
    with _admin(gateway, client_key["key"]) as client:
        for response in (client.get("/admin/keys"), client.post("/admin/keys", json={"team": "x", "admin": True}),
                         client.patch(f"/admin/keys/{client_key['id']}", json={"rpm": None}),
                         client.post(f"/admin/keys/{client_key['id']}/rotate"),
                         client.delete(f"/admin/keys/{admin_key['id']}")):
            _is_openai_error(response, 403, "admin_key_required")
    with _admin(gateway, admin_key["key"]) as admin:  # an admin-scoped key may manage keys
        listed = admin.get("/admin/keys")
        assert listed.status_code == 200 and listed.headers["x-request-id"].startswith("req_")
        assert {k["id"] for k in listed.json()["data"]} == {client_key["id"], admin_key["id"]}
        assert admin.delete(f"/admin/keys/{client_key['id']}").json()["revoked"] is True


def test_admin_key_lifecycle_over_http(gateway):
    with _admin(gateway) as admin:
        created = admin.post("/admin/keys", json={"team": "search", "budget_usd": 2.5, "rpm": 30,
                                                  "routes": ["chatty", "vectors"]})
        assert created.status_code == 201 and created.headers["x-request-id"].startswith("req_")
        key = created.json()
        secret, key_id = key.pop("key"), key["id"]
        assert secret.startswith(keys.KEY_PREFIX) and key_id.startswith("key_")
        assert key == {"object": "api_key", "id": key_id, "team": "search", "budget_usd": 2.5, "rpm": 30, "tpm": None,
                       "routes": ["chatty", "vectors"], "admin": False, "revoked": False,
                       "created_at": key["created_at"], "revoked_at": None, "rotated_at": None, "updated_at": None}
        assert abs(key["created_at"] - time.time()) < 60

        listed = admin.get("/admin/keys")
        assert listed.json()["object"] == "list" and listed.json()["data"] == [key]
        assert secret not in listed.text and keys.hash_key(secret) not in listed.text
        assert admin.get(f"/admin/keys/{key_id}").json() == key

        patched = admin.patch(f"/admin/keys/{key_id}", json={"tpm": 1000, "rpm": None, "routes": None}).json()
        assert (patched["budget_usd"], patched["rpm"], patched["tpm"], patched["routes"]) == (2.5, None, 1000, None)
        assert patched["updated_at"] is not None

        rotated = admin.post(f"/admin/keys/{key_id}/rotate")
        assert rotated.status_code == 200
        new_secret = rotated.json()["key"]
        assert rotated.json()["id"] == key_id and rotated.json()["tpm"] == 1000 and new_secret != secret
        models = f"{gateway.base_url}/models"
        started = time.monotonic()
        took = _refused_after(lambda: httpx.get(models, headers={"Authorization": f"Bearer {secret}"}).status_code,
                              started, 5)
        assert took is not None and took <= REVOKE_WITHIN_S + 0.25, took
        assert httpx.get(models, headers={"Authorization": f"Bearer {new_secret}"}).status_code == 200

        revoked = admin.delete(f"/admin/keys/{key_id}")
        assert revoked.status_code == 200 and revoked.json()["revoked"] is True and revoked.json()["revoked_at"]
        _is_openai_error(admin.delete(f"/admin/keys/{key_id}"), 409, "key_revoked")
        _is_openai_error(admin.patch(f"/admin/keys/{key_id}", json={"rpm": 5}), 409, "key_revoked")
        _is_openai_error(admin.post(f"/admin/keys/{key_id}/rotate"), 409, "key_revoked")
        assert admin.get("/admin/keys", params={"revoked": "false"}).json()["data"] == []
        _is_openai_error(admin.get("/admin/keys/key_000000000000"), 404, "key_not_found")
        _is_openai_error(admin.delete("/admin/keys/nonsense"), 404, "key_not_found")
        _is_openai_error(admin.get(f"/admin/keys/{new_secret}"), 400, "invalid_key_id")  # secrets stay out of URLs


@pytest.mark.parametrize("body, param", [
    ({"team": "t", "budget_usd": "nan"}, "budget_usd"),
    ({"team": "t", "budget_usd": -1}, "budget_usd"),
    ({"team": "t", "budget_usd": 0}, "budget_usd"),
    ({"team": "t", "budget_usd": 1e13}, "budget_usd"),
    ({"team": "t", "rpm": 0}, "rpm"),
    ({"team": "t", "rpm": 1.5}, "rpm"),
    ({"team": "t", "tpm": True}, "tpm"),
    ({"team": "t", "tpm": 2**40}, "tpm"),
    ({"team": "t", "routes": "chatty"}, "routes"),
    ({"team": "t", "routes": []}, "routes"),
    ({"team": "t", "routes": [1]}, "routes"),
    ({"team": ""}, "team"),
    ({"team": "a\u0000b"}, "team"),
    ({"team": "t", "admin": "yes"}, "admin"),
    ({"team": "t", "owner": "me"}, "owner"),
    ({"budget_usd": 1}, "team"),
])
def test_bad_values_over_http_change_nothing(gateway, body, param):
    with _admin(gateway) as admin:
        victim = admin.post("/admin/keys", json={"team": "v", "rpm": 5}).json()
        before = admin.get("/admin/keys").json()
        assert _is_openai_error(admin.post("/admin/keys", json=body), 400)["param"] == param
        update = {k: v for k, v in body.items() if k not in ("team", "admin")}
        update = update if param not in ("team", "admin") else {"tpm": -3}
        _is_openai_error(admin.patch(f"/admin/keys/{victim['id']}", json=update), 400)
        assert admin.get("/admin/keys").json() == before


def test_non_finite_numbers_and_bad_bodies_over_http(gateway):
    """JSON has no NaN or Infinity; a body that spells them (or overflows a double) is not JSON: 400."""
    with _admin(gateway) as admin:
        victim = admin.post("/admin/keys", json={"team": "v", "budget_usd": 1}).json()
        headers = {"Content-Type": "application/json"}
        for raw in (b'{"team": "t", "budget_usd": NaN}', b'{"team": "t", "budget_usd": 1e999}',
                    b'{"team": "t", "budget_usd": Infinity}', b"[1]", b"", b"{"):
            _is_openai_error(admin.post("/admin/keys", content=raw, headers=headers), 400, "invalid_json")
            _is_openai_error(admin.patch(f"/admin/keys/{victim['id']}", content=raw, headers=headers), 400)
        _is_openai_error(admin.patch(f"/admin/keys/{victim['id']}", json={}), 400, "missing_required_parameter")
        _is_openai_error(admin.post("/admin/keys", content=b"{" + b" " * 70_000 + b"}", headers=headers), 413)
        data = admin.get("/admin/keys").json()["data"]
        assert len(data) == 1 and data[0]["budget_usd"] == 1.0 and data[0]["updated_at"] is None


def test_key_routes_are_enforced_on_every_endpoint_and_listed(gateway):
    with _admin(gateway) as admin:
        key = admin.post("/admin/keys", json={"team": "apps", "routes": ["chatty", "vectors"]}).json()
    client = openai.OpenAI(base_url=gateway.base_url, api_key=key["key"], max_retries=0)
    assert sorted(m.id for m in client.models.list()) == ["chatty", "vectors"]
    assert client.models.retrieve("chatty").id == "chatty"
    messages = [{"role": "user", "content": "hi"}]
    calls = [lambda: client.models.retrieve("other"),
             lambda: client.chat.completions.create(model="other", messages=messages, max_tokens=5),
             lambda: client.chat.completions.create(model="other", messages=messages, max_tokens=5, stream=True),
             lambda: client.completions.create(model="other", prompt="hi", max_tokens=5),
             lambda: client.embeddings.create(model="other", input="hi"),
             lambda: client.responses.create(model="other", input="hi", max_output_tokens=16)]
    for call in calls:
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert caught.value.code == "model_not_found" and caught.value.response.headers["x-request-id"]
        assert "'other'" in caught.value.message and "chatty" in caught.value.message
        assert "other," not in caught.value.message and ", other" not in caught.value.message  # not listed to it
    assert client.chat.completions.create(model="chatty", messages=messages, max_tokens=5).choices
    assert client.embeddings.create(model="vectors", input="hi").data

    with _admin(gateway) as admin:  # widen it: the change reaches the gateway within about a second
        assert admin.patch(f"/admin/keys/{key['id']}", json={"routes": None}).status_code == 200
    deadline = time.monotonic() + REVOKE_WITHIN_S + 0.25
    while sorted(m.id for m in client.models.list()) != ["chatty", "other", "vectors"]:
        assert time.monotonic() < deadline, "the route change did not reach the gateway within a second"
        time.sleep(POLL_S)
    assert client.chat.completions.create(model="other", messages=messages, max_tokens=5).choices


# ------------------------------------------------------------------ real `switchyard serve` processes


def _serve(tmp_path: Path, policy: Path, port: int, *, database_url: str | None, master: str | None,
           name: str, **popen) -> subprocess.Popen:
    env = {**os.environ, "SWITCHYARD_DATA_DIR": str(tmp_path / f"data-{name}")}
    for var in ("SWITCHYARD_MASTER_KEY", "SWITCHYARD_DATABASE_URL"):
        env.pop(var, None)
    if master:
        env["SWITCHYARD_MASTER_KEY"] = master
    args = [sys.executable, "-m", "gateway.cli", "serve", "--policy", str(policy), "--port", str(port)]
    if database_url:
        args += ["--database-url", database_url]
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.STDOUT)
    return subprocess.Popen(args, env=env, text=True, cwd=tmp_path, **popen)


def _stop(process: subprocess.Popen) -> str:
    process.send_signal(signal.SIGINT)
    try:
        out, _ = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        out, _ = process.communicate()
    return out or ""


def test_revoked_key_is_refused_by_every_gateway_on_the_database_within_a_second(standin, pg_url, tmp_path):
    """Regression: a revoked key kept working for up to 30 s (each process's auth cache) on every gateway."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_text(standin))
    db.upgrade(pg_url)

    async def make() -> list[tuple[str, keys.KeyInfo]]:
        engine = db.create_engine(pg_url)
        try:
            return [await keys.create_key(engine, "apps") for _ in range(2)]
        finally:
            await engine.dispose()

    (revoke_me, revoke_info), (rotate_me, rotate_info) = asyncio.run(make())
    ports = [free_port(), free_port()]
    gateways = [_serve(tmp_path, policy, port, database_url=pg_url, master=MASTER_KEY, name=str(i))
                for i, port in enumerate(ports)]
    try:
        for port in ports:
            wait_http(f"http://127.0.0.1:{port}/health", timeout=120)

        def status(port: int, key: str) -> int:
            return httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {key}"},
                             timeout=10).status_code

        for port in ports:  # both gateways have both keys in their caches
            assert status(port, revoke_me) == 200 and status(port, rotate_me) == 200

        revoked = httpx.delete(f"http://127.0.0.1:{ports[0]}/admin/keys/{revoke_info.id}",
                               headers={"Authorization": f"Bearer {MASTER_KEY}"}, timeout=10)
        started = time.monotonic()
        assert revoked.status_code == 200, revoked.text
        took = [_refused_after(lambda p=port: status(p, revoke_me), started, 5) for port in ports]
        print(f"HTTP revoke refused after {took} s")
        assert all(t is not None and t <= REVOKE_WITHIN_S for t in took), f"refused after {took} s (HTTP revoke)"

        rotated = run_cli("keys", "rotate", rotate_info.id, "--database-url", pg_url)
        started = time.monotonic()
        assert rotated.returncode == 0, rotated.stderr
        new_key = rotated.stdout.strip().splitlines()[-1]
        took = [_refused_after(lambda p=port: status(p, rotate_me), started, 5) for port in ports]
        print(f"CLI rotate: old secret refused after {took} s")
        assert all(t is not None and t <= REVOKE_WITHIN_S for t in took), f"refused after {took} s (CLI rotate)"
        assert all(status(port, new_key) == 200 for port in ports)
    finally:
        outputs = [_stop(process) for process in gateways]
    for out in outputs:
        assert revoke_me not in out and rotate_me not in out


def _key_file(tmp_path: Path, name: str) -> Path:
    return tmp_path / f"data-{name}" / "admin-key.txt"


def test_first_start_key_never_reaches_a_piped_stdout(standin, tmp_path):
    """Regression: `serve` printed the generated admin key on stdout even when stdout was a log file or pipe."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_text(standin))
    port = free_port()
    process = _serve(tmp_path, policy, port, database_url=None, master=None, name="pipe")
    key_file, key = _key_file(tmp_path, "pipe"), None
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=120)
        if key_file.exists():
            key = key_file.read_text().strip()
            headers = {"Authorization": f"Bearer {key}"}
            assert httpx.get(f"http://127.0.0.1:{port}/admin/keys", headers=headers, timeout=10).status_code == 200
    finally:
        output = _stop(process)
    assert keys.KEY_PREFIX not in output, output
    assert key is not None and key.startswith(keys.KEY_PREFIX)
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert str(key_file.resolve()) in output  # the operator is told where it is
    for path in (tmp_path / "data-pipe").rglob("*"):  # nor in any log or database file the gateway wrote
        if path.is_file() and path != key_file:
            assert key.encode() not in path.read_bytes(), path


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 65536):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)


def test_first_start_key_is_shown_on_a_terminal(standin, tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_text(standin))
    port = free_port()
    leader, follower = pty.openpty()
    process = _serve(tmp_path, policy, port, database_url=None, master=None, name="tty", stdout=follower,
                     stderr=follower)
    os.close(follower)
    seen = b""
    try:
        deadline = time.monotonic() + 120
        while b"print(reply.choices[0].message.content)" not in seen:
            assert time.monotonic() < deadline and process.poll() is None, seen.decode(errors="replace")
            if select.select([leader], [], [], 0.5)[0]:
                try:
                    seen += os.read(leader, 65536)
                except OSError:
                    break
        threading.Thread(target=_drain, args=(leader,), daemon=True).start()  # a full pty would block its writes
        text = seen.decode(errors="replace")
        key = re.search(r"(sk-sy-[A-Za-z0-9_\-]+)", text).group(1)
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {key}"},
                         timeout=10).status_code == 200
        assert not _key_file(tmp_path, "tty").exists()
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
