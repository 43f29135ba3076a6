"""The first-start admin key when the database is down at first start (issue 30 follow-up): `switchyard serve`
makes it once the database answers (after the background migration), writes it to data/admin-key.txt with mode
0600 and never prints or logs it; the key then works."""
from __future__ import annotations

import stat
import time

import httpx
from sqlalchemy.engine import make_url

from gateway.testing.tcp_proxy import TcpProxy
from tests.conftest import fresh_pg_database
from tests.e2e.conftest import free_port, wait_http
from tests.e2e.test_serve_start import POLICY, Serve


def test_the_first_admin_key_is_made_once_the_database_answers(standin, tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.format(standin=standin))
    key_file = tmp_path / "data" / "admin-key.txt"
    with fresh_pg_database() as direct_url:
        proxy = TcpProxy(target_port=make_url(direct_url).port or 5432)  # not open yet: refused
        url = make_url(direct_url).set(port=proxy.port).render_as_string(hide_password=False)
        port = free_port()
        serve = Serve(tmp_path, "--policy", str(policy), "--port", str(port), "--database-url", url, master=None)
        try:
            wait_http(f"http://127.0.0.1:{port}/health", timeout=90)
            serve.wait_for_output("No admin key was created")
            assert not key_file.exists()
            proxy.open()  # the database is back
            deadline = time.time() + 60
            while not key_file.exists() and time.time() < deadline:
                time.sleep(0.2)
            assert key_file.exists(), serve.output
            time.sleep(0.2)  # written in one call; let it land before reading
            key = key_file.read_text().strip()
            assert key.startswith("sk-") and stat.S_IMODE(key_file.stat().st_mode) == 0o600
            response = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10,
                                 headers={"authorization": f"Bearer {key}"})
            assert response.status_code == 200, response.text
            serve.wait_for_output("created the first admin key")
            serve.stop()
        finally:
            serve.kill()
            proxy.close()
    out = serve.output
    assert key not in out and key[-12:] not in out  # neither stdout nor the log has it
    assert str(key_file.resolve()) in out and "Traceback" not in out
