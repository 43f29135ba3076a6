"""Policy file faults against a real gateway (issue 30, defect 9 / deliverable 6 and 8): while the file is
bombed, truncated, replaced, deleted and restored, clients keep being answered by the last good policy,
every answer is a ledger row stamped with the version that served it, and /health and /metrics say what
happened to the file."""
from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path
from typing import Self

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import MASTER_KEY, ledger_rows, run_gateway
from tests.gateway.test_policy_reload_safety import alias_bomb, large_valid_policy

POLICY = """\
backends:
  eng:
    kind: engine
    model: demo-model
    api_base: {standin}
    gpu_hour_usd: 3.6
    max_retries: 0
routes:
  local:
    strategy: fixed
    backend: eng
"""


@pytest.fixture
def gateway(standin, tmp_path):
    with run_gateway(POLICY.format(standin=standin), tmp_path) as running:
        yield running


def health(gateway) -> dict:
    return httpx.get(f"{gateway.root}/health", timeout=10).json()


def metric(gateway, name: str, **labels: str) -> float:
    text = httpx.get(f"{gateway.root}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def wait_for(predicate, timeout: float = 15.0) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "condition not reached"
        time.sleep(0.05)


def ask(client: openai.OpenAI, model: str = "local") -> str:
    """One chat request; returns the gateway's request id (its ledger row's key)."""
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert raw.parse().usage.completion_tokens == 2
    return raw.headers["x-request-id"]


def replace_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class RequestLoop:
    """Chat requests back to back from a thread, each one's latency and outcome recorded."""

    def __init__(self, gateway) -> None:
        self.client = openai.OpenAI(base_url=gateway.base_url, api_key=MASTER_KEY, max_retries=0, timeout=60)
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            try:
                ask(self.client)
            except (openai.OpenAIError, AssertionError) as e:  # recorded, asserted on below
                self.failures.append(repr(e))
            self.latencies.append(time.perf_counter() - started)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def test_requests_keep_flowing_while_a_bomb_and_a_large_file_are_reloaded(gateway):
    path = gateway.config.policy_path
    good = path.read_text()
    first = health(gateway)["policy"]["version"]
    warm_up = ask(openai.OpenAI(base_url=gateway.base_url, api_key=MASTER_KEY, max_retries=0))  # first-use costs
    with RequestLoop(gateway) as loop:
        time.sleep(0.3)
        path.write_text(alias_bomb(9, 7))  # a valid policy but for its 4.8 M-value `x-lol:` section
        wait_for(lambda: health(gateway)["policy"]["reload_failing"])
        path.write_text(large_valid_policy(1_000_000, base=good))  # ~1 MB, valid: goes live
        wait_for(lambda: health(gateway)["policy"]["version"] != first, timeout=60)
        time.sleep(0.3)
    state = health(gateway)["policy"]
    assert state["reload_failing"] is False and state["reloads"] == 1
    assert "alias" in state["last_reload_error"]["message"]  # the bomb's rejection, kept as history
    assert not loop.failures, loop.failures[:3]
    # Before this change the bomb stopped the event loop for ~8 s unloaded (a /health call timed out after
    # 10 s on the shared box), the large file for ~2 s. Off the loop, a reload costs requests a few GIL switch
    # intervals (worst 170-510 ms measured with the box at load 8-10; the bound leaves room for that noise).
    worst, typical = max(loop.latencies), statistics.median(loop.latencies)
    print(f"{len(loop.latencies)} requests during the reloads: median {typical * 1000:.1f} ms, "
          f"worst {worst * 1000:.0f} ms")
    assert worst < 2.5, f"a request waited {worst:.2f}s during a reload (median {typical * 1000:.0f} ms)"
    gateway.call(gateway.gw.services.ledger.flush)
    rows = ledger_rows(gateway.config.database_url)
    assert len(rows) == len(loop.latencies) + 1 and warm_up in {r["request_id"] for r in rows}  # one row each
    assert {r["policy_version"] for r in rows} <= {first, state["version"]}


def test_policy_file_truncated_replaced_deleted_and_restored(gateway):
    client = openai.OpenAI(base_url=gateway.base_url, api_key=MASTER_KEY, max_retries=0)
    path = gateway.config.policy_path
    original = path.read_text()
    v1 = health(gateway)["policy"]["version"]
    invalid_before = metric(gateway, "switchyard_policy_reload_errors_total", reason="invalid")
    missing_before = metric(gateway, "switchyard_policy_reload_errors_total", reason="missing")
    served: dict[str, str] = {ask(client): v1}

    # truncated: cut mid-value (an invalid file); the old policy keeps serving, /health says why
    path.write_text(original[:original.index("kind: engine") + len("kind: eng")])
    wait_for(lambda: health(gateway)["policy"]["reload_failing"])
    state = health(gateway)["policy"]
    assert state["version"] == v1 and state["file"] == "ok"
    err = state["last_reload_error"]
    assert f"{path}:3:5: backends.eng.kind: invalid value 'eng'" in err["message"]
    assert err["file"]["size"] == path.stat().st_size and err["at"]
    assert metric(gateway, "switchyard_policy_reload_failing") == 1
    assert metric(gateway, "switchyard_policy_reload_errors_total", reason="invalid") == invalid_before + 1
    served[ask(client)] = v1

    # replaced by atomic rename: the new policy is live (a new route answers), the failure clears
    replace_atomically(path, original + "  local2:\n    strategy: fixed\n    backend: eng\n")
    wait_for(lambda: health(gateway)["policy"]["version"] != v1)
    v2 = health(gateway)["policy"]["version"]
    assert health(gateway)["policy"]["reload_failing"] is False
    assert metric(gateway, "switchyard_policy_reload_failing") == 0
    assert metric(gateway, "switchyard_policy_version_info", version=v2) == 1
    served[ask(client, "local2")] = v2

    # deleted: the last good policy keeps serving; /health says the file is missing
    path.unlink()
    wait_for(lambda: health(gateway)["policy"]["file"] == "missing")
    state = health(gateway)["policy"]
    assert state["version"] == v2 and state["reload_failing"] is True
    assert "missing" in state["last_reload_error"]["message"] and state["last_reload_error"]["file"] is None
    assert metric(gateway, "switchyard_policy_reload_errors_total", reason="missing") == missing_before + 1
    served[ask(client, "local2")] = v2

    # restored (from the first version's backup): read again once it has settled, and live
    path.write_text(original)
    wait_for(lambda: health(gateway)["policy"]["version"] == v1)
    state = health(gateway)["policy"]
    assert state["file"] == "ok" and state["reload_failing"] is False and state["reloads"] == 2
    served[ask(client)] = v1
    with pytest.raises(openai.NotFoundError):
        ask(client, "local2")

    gateway.call(gateway.gw.services.ledger.flush)
    rows = {r["request_id"]: r for r in ledger_rows(gateway.config.database_url)}
    assert {rid: rows[rid]["policy_version"] for rid in served} == served
