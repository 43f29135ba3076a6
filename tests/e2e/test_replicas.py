"""Gateway replicas behave as one (issue 32, item 1): four gateway processes (three `switchyard serve`, one of them
with `--workers 2`, each serve with its own copy of the policy file as on separate hosts) on one PostgreSQL and one
private Redis, a stand-in upstream. 1,000 concurrent requests on one key spread over the replicas never exceed its
budget (without Redis each replica kept its own: 4x) and leave exactly one ledger row each; its RPM holds within 5%;
a key revoked through the admin API or the keys CLI is refused by every replica within a second; a policy edited on
one replica is served by every replica within a second (each says which version in /health); and Redis stopped
under load then restarted loses nothing: each replica falls back to its share, says so in /health, and shares
again once Redis is back."""
from __future__ import annotations

import asyncio
import collections
import hashlib
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from gateway.shared_state_testing import RedisServer
from gateway.testing.standin import run_standin
from tests.conftest import fresh_pg_database
from tests.e2e.conftest import free_port, ledger_rows, wait_http
from tests.e2e.test_serve_start import MASTER, Serve

LOAD_THREADS = 6
WORKERS = (1, 1, 2)  # per `serve`: four gateway processes on three ports
REPLICAS = sum(WORKERS)
# gpt-4o-mini at litellm's bundled prices ($0.15 / $0.60 per Mtok); the stand-in answers max_tokens tokens, so a
# request costs what it reserved, give or take the prompt estimate.
POLICY = """\
backends:
  api:
    kind: litellm
    model: openai/gpt-4o-mini
    api_base: {standin}
    api_key_env: STANDIN_API_KEY
    max_retries: 0
routes:
  priced: {{backend: api}}
"""
MAX_TOKENS = 100
PER_REQUEST_USD = MAX_TOKENS * 0.60e-6  # the output's worst case
# The estimate error: the prompt's cost, up to 20 tokens with the chat template, which the reservation estimates
# from the text (a request may cost up to this much more than it reserved).
PROMPT_USD_MAX = 20 * 0.15e-6


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(replica base URLs, the Redis server, the database URL, each serve's policy file)."""
    tmp = tmp_path_factory.mktemp("replicas")
    with fresh_pg_database() as db_url, run_standin() as standin, RedisServer() as redis_server:
        env = {"STANDIN_API_KEY": "sk-standin"}
        serves, urls, policies = [], [], []
        try:
            for i, workers in enumerate(WORKERS):
                port = free_port()
                data = tmp / f"r{i}"
                data.mkdir()
                policy = data / "policy.yaml"  # a copy each, as on separate hosts
                policy.write_text(POLICY.format(standin=standin))
                policies.append(policy)
                serves.append(Serve(data, "--policy", str(policy), "--port", str(port), "--database-url", db_url,
                                    "--redis-url", redis_server.url, "--workers", str(workers), env=env))
                urls.append(f"http://127.0.0.1:{port}")
            for url in urls:
                wait_http(f"{url}/health", timeout=300)
            _wait_replicas(urls[0], REPLICAS)
            yield urls, redis_server, db_url, policies
        finally:
            for serve in serves:
                if serve.process.poll() is None:
                    serve.stop()


def _wait_replicas(url: str, count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while _health(url)["shared_state"]["replicas"] != count:
        assert time.monotonic() < deadline, _health(url)["shared_state"]
        time.sleep(0.2)


def _admin(url: str, method: str, path: str, **body) -> dict:
    response = httpx.request(method, f"{url}{path}", json=body or None,
                             headers={"Authorization": f"Bearer {MASTER}"}, timeout=30)
    assert response.status_code in (200, 201), response.text
    return response.json()


def _chat(url: str, key: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                      json={"model": "priced", "max_tokens": MAX_TOKENS,
                            "messages": [{"role": "user", "content": "one two three four five"}]})


def _burst(urls: list[str], key: str, requests: int, in_flight: int = 96) -> list[httpx.Response]:
    """`requests` concurrent requests on one key, round-robin over the replicas (all started at once; at most
    `in_flight` connections open at a time, so a 2-core machine is not measuring its own connection storm)."""
    async def go() -> list[httpx.Response]:
        # A new connection per request: a kept-alive one the server closes as it is reused reads as an error
        limits = httpx.Limits(max_connections=max(1, in_flight // len(urls)), max_keepalive_connections=0)
        clients = [httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(120.0)) for url in urls]
        body = {"model": "priced", "max_tokens": MAX_TOKENS,
                "messages": [{"role": "user", "content": "one two three four five"}]}
        try:
            return await asyncio.gather(*(clients[i % len(urls)].post(
                "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
                for i in range(requests)))
        finally:
            for client in clients:
                await client.aclose()

    return asyncio.run(go())


def _outages(urls: list[str]) -> dict[str, int]:
    """Per replica (every process: new connections reach a port's workers in turn), the Redis outages it saw."""
    seen: dict[str, int] = {}
    for url in urls:
        for _ in range(20):
            shared = _health(url)["shared_state"]
            seen[shared["replica"]] = shared["outages"]
    return seen


def _rows(db_url: str, key_id: str, expected: int, timeout: float = 30) -> list[dict]:
    """The key's ledger rows once all `expected` are written (the writers batch them)."""
    deadline = time.monotonic() + timeout
    while True:
        rows = ledger_rows(db_url, "api_key_id = :k", {"k": key_id})
        if len(rows) >= expected or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


REQUESTS = 1000
AFFORDABLE = 60  # requests the budget pays for at the reservation's worst case


def test_concurrent_requests_on_one_key_never_exceed_its_budget_across_replicas(cluster):
    urls, _, db_url, _ = cluster
    budget = AFFORDABLE * (PER_REQUEST_USD + PROMPT_USD_MAX)
    key = _admin(urls[0], "POST", "/admin/keys", team="t", budget_usd=budget)
    outages_before = _outages(urls)
    responses = _burst(urls, key["key"], REQUESTS)
    assert _outages(urls) == outages_before  # Redis answered throughout (a fallback admits shares on top)
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(ok) + len(refused) == REQUESTS, collections.Counter((r.status_code, r.text[:200]) for r in responses
                                                                   if r.status_code not in (200, 429))
    assert all(r.json()["error"]["code"] == "insufficient_quota" for r in refused)
    # One book admits AFFORDABLE at the worst case, a few more as settles return what the prompt's estimate held
    # beyond its real cost; never more than the budget buys at the least a request costs (its 100 output tokens).
    # Four private books admitted 4x.
    assert AFFORDABLE - 3 <= len(ok) <= int(budget / PER_REQUEST_USD)
    rows = _rows(db_url, key["id"], REQUESTS)
    assert len(rows) == REQUESTS and len({row["request_id"] for row in rows}) == REQUESTS  # one row per request
    spent = sum(row["cost_usd"] or 0.0 for row in rows)
    assert spent <= budget + len(ok) * PROMPT_USD_MAX  # within the estimate error (four books: ~4x the budget)
    assert sum(1 for row in rows if row["status"] == "ok") == len(ok)


def test_rpm_holds_across_replicas(cluster):
    urls = cluster[0]
    key = _admin(urls[0], "POST", "/admin/keys", team="t", rpm=40)
    responses = _burst(urls, key["key"], 160)
    ok = sum(r.status_code == 200 for r in responses)
    limited = [r for r in responses if r.status_code == 429]
    assert 38 <= ok <= 42  # within 5% of 40 per minute (four private windows admitted 160)
    assert all(r.json()["error"]["code"] == "rate_limit_exceeded" and int(r.headers["retry-after"]) >= 1
               for r in limited)


def _known_everywhere(urls: list[str], key: str) -> None:
    """Each process has the key cached: new connections spread over a port's workers, so a few per port."""
    for url in urls:
        assert all(_chat(url, key).status_code == 200 for _ in range(4))


def _admitted_late(urls: list[str], key: str, since: float, watch_s: float = 2.0) -> list[tuple[str, float]]:
    """Requests on the key sent more than a second after `since` (monotonic) that were still admitted: (replica
    URL, seconds after `since` the request was sent). A request is timed when it is sent, before any replica
    could have decided on it, so each one listed was admitted later than a second: no margin is needed. Every
    request opens a new connection, so a port's workers are all asked."""
    late = []
    while time.monotonic() - since < watch_s:
        for url in urls:
            sent = time.monotonic()
            if _chat(url, key).status_code != 401 and sent - since > 1.0:
                late.append((url, round(sent - since, 3)))
    return late


def _refused_everywhere(urls: list[str], key: str) -> None:
    for url in urls:
        assert [_chat(url, key).status_code for _ in range(6)] == [401] * 6


def test_a_revoked_key_is_refused_by_every_replica_within_a_second(cluster):
    urls = cluster[0]
    key = _admin(urls[0], "POST", "/admin/keys", team="t")
    _known_everywhere(urls, key["key"])
    _admin(urls[1], "DELETE", f"/admin/keys/{key['id']}")
    assert _admitted_late(urls, key["key"], time.monotonic()) == []
    _refused_everywhere(urls, key["key"])


def test_a_key_revoked_with_the_cli_is_refused_by_every_replica_within_a_second(cluster):
    """`switchyard keys revoke` writes the database, no gateway involved; with the shared Redis's URL it announces
    the key, and every replica drops it from its cache."""
    urls, redis_server, db_url, _ = cluster
    key = _admin(urls[0], "POST", "/admin/keys", team="t")
    _known_everywhere(urls, key["key"])
    env = {**os.environ, "SWITCHYARD_REDIS_URL": redis_server.url}
    cli = subprocess.Popen([sys.executable, "-m", "gateway.cli", "keys", "revoke", key["id"], "--database-url",
                            db_url], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in cli.stdout:  # printed once the revocation is committed, before it is announced
        if line.startswith(f"Revoked key {key['id']}"):
            revoked_at = time.monotonic()
            break
    else:
        raise AssertionError(cli.stderr.read())
    late = _admitted_late(urls, key["key"], revoked_at)
    out, err = cli.communicate(timeout=60)
    assert cli.returncode == 0, err
    assert f"Announced to {REPLICAS} gateway replicas on Redis." in out
    assert late == []
    _refused_everywhere(urls, key["key"])


def test_a_policy_edit_on_one_replica_is_served_by_every_replica_within_a_second(cluster):
    """Each serve has its own copy of the policy file: the edited copy's replica shares the new text through Redis,
    the others validate and serve it (their files unchanged), and every /health says which version it serves."""
    urls, _, _, policies = cluster
    text = policies[0].read_text() + "  also_priced: {backend: api}\n"
    new_version = hashlib.sha256(text.encode()).hexdigest()[:16]
    staged = policies[0].with_name("policy.next")
    staged.write_text(text)
    os.replace(staged, policies[0])  # an atomic edit, as editors and config tools write
    edited_at = time.monotonic()
    first_served, serving, stale_late = None, set(), []
    while len(serving) < REPLICAS and time.monotonic() - edited_at < 30:
        for url in urls:
            sent = time.monotonic()
            health = _health(url)
            if health["policy_version"] == new_version:
                first_served = first_served or time.monotonic()
                serving.add(health["shared_state"]["replica"])
            elif first_served is not None and sent - first_served > 1.0:
                # asked more than a second after some replica served the new version, and still the old one
                stale_late.append((url, health["shared_state"]["replica"], round(sent - first_served, 3)))
    assert len(serving) == REPLICAS, serving
    assert stale_late == []
    for url in urls:  # each says it serves the shared version (the edited one's publish is a round trip behind it)
        for _ in range(4):
            shared = _health(url)["shared_state"]["policy"]
            assert shared["shared_version"] == shared["serving"] == new_version and shared["in_step"], shared
    assert all(_chat_route(url, "also_priced").status_code == 200 for url in urls)
    assert [p.read_text() == text for p in policies] == [True, False, False]  # the others' files unchanged


def _chat_route(url: str, route: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {MASTER}"}, timeout=60,
                      json={"model": route, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})


def test_workers_share_one_port(cluster):
    urls = cluster[0]
    seen = set()
    for _ in range(40):  # new connections: the kernel spreads them over the port's two processes
        seen.add(httpx.get(f"{urls[WORKERS.index(2)]}/health", timeout=10).json()["shared_state"]["replica"])
        if len(seen) == 2:
            break
    assert len(seen) == 2


def test_workers_without_redis_are_refused_in_one_line(tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.format(standin="http://127.0.0.1:9/v1"))
    env = {k: v for k, v in os.environ.items() if k != "SWITCHYARD_REDIS_URL"}
    done = subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "--policy", str(policy), "--port",
                           str(free_port()), "--workers", "3"], env=env, capture_output=True, text=True, check=False,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith("error: --workers 3 needs --redis-url")
    assert "Switchyard is ready" not in done.stdout


def _health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=10).json()


def _wait_health(urls: list[str], status: str, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(_health(url)["shared_state"]["status"] == status for url in urls):
            return
        time.sleep(0.1)
    raise AssertionError(f"not every replica says {status}: {[_health(u)['shared_state'] for u in urls]}")


def test_redis_stopped_under_load_then_restarted_loses_nothing(cluster):
    urls, redis_server, db_url, _ = cluster
    budget = 90 * (PER_REQUEST_USD + PROMPT_USD_MAX)
    key = _admin(urls[0], "POST", "/admin/keys", team="t", budget_usd=budget, rpm=6000)
    responses: list[httpx.Response] = []
    stop = threading.Event()

    def load(worker: int) -> None:  # closed-loop load on the key, over every replica, until told to stop
        i = worker
        while not stop.is_set():
            responses.append(_chat(urls[i % len(urls)], key["key"]))
            i += 1

    workers = [threading.Thread(target=load, args=(w,)) for w in range(LOAD_THREADS)]
    for worker in workers:
        worker.start()
    try:
        while len(responses) < 20:  # shared, under load
            time.sleep(0.05)
        redis_server.stop()  # Redis gone mid-run: local shares of what is left
        _wait_health(urls, "local_fallback")
        served_before_outage = len(responses)
        health = _health(urls[0])
        assert health["status"] == "degraded" and health["shared_state"]["replicas"] == REPLICAS
        assert "switchyard_shared_state_up 0.0" in httpx.get(f"{urls[0]}/metrics", timeout=10).text
        while len(responses) < served_before_outage + 30:
            time.sleep(0.05)
        redis_server.start()  # empty: the replicas replay what they did and the ledger reseeds the spend
        _wait_health(urls, "shared")
        after_restart = len(responses)
        while len(responses) < after_restart + 30:
            time.sleep(0.05)
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=60)
    ok = sum(r.status_code == 200 for r in responses)
    assert all(r.status_code in (200, 429) for r in responses)
    assert sum(r.status_code == 200 for r in responses[served_before_outage:after_restart]) > 0  # served
    rows = _rows(db_url, key["id"], len(responses))
    assert len(rows) == len(responses) and len({row["request_id"] for row in rows}) == len(responses)
    assert sum(1 for row in rows if row["status"] == "ok") == ok
    # Never over beyond the estimate error and, for the outage, what other replicas admitted after a replica's
    # last view and before their rows reached the ledger (at most the requests in flight: LOAD_THREADS).
    spent = sum(row["cost_usd"] or 0.0 for row in rows)
    assert spent <= budget + ok * PROMPT_USD_MAX + LOAD_THREADS * (PER_REQUEST_USD + PROMPT_USD_MAX)
    assert ok >= 60  # most of the budget stayed usable (the outage shares are of what was left)


def test_stopping_serve_stops_every_worker(tmp_path):
    """SIGTERM to `serve --workers 2` ends both processes (the worker was once left running, orphaned)."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.format(standin="http://127.0.0.1:9/v1"))
    port = free_port()
    with RedisServer() as redis_server:
        serve = Serve(tmp_path, "--policy", str(policy), "--port", str(port), "--database-url",
                      f"sqlite:///{tmp_path / 'ledger.db'}", "--redis-url", redis_server.url, "--workers", "2")
        try:
            wait_http(f"http://127.0.0.1:{port}/health", timeout=120)
            pids = set()
            for _ in range(60):  # new connections until both processes answered
                pids.add(int(_health(f"http://127.0.0.1:{port}")["shared_state"]["replica"].split(":")[1]))
                if len(pids) == 2:
                    break
            assert len(pids) == 2 and serve.process.pid in pids
            serve.stop()
            deadline = time.monotonic() + 30
            while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not [pid for pid in pids if _alive(pid)], serve.output
        finally:
            serve.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
