"""Issue 31 finding 5: `report ladder` and `report capacity` work from any directory and on an installed
package, price each benchmark at the price of the machine it ran on, plan to a default TTFT target, name the
machine, and price from the policy the gateway stored in the ledger.

Real subprocesses of the `switchyard` console script (cwd a temporary directory, never the checkout), a copy of
the packages laid out as a wheel installs them (no bench/, no policies/ beside them), real SQLite and
PostgreSQL ledgers with policy texts stored by the gateway's own writer. Expected figures are worked out here
from the benchmark files and the test's own policies.

Before the fix: the ladder read `bench/results/cheaper_model.json` relative to the working directory and told
the user to rerun the benchmark; capacity priced a 2-core CPU curve at the policy's GPU rate, planned at the
largest concurrency (9.9 s TTFT p95), called the benchmark machine "this CPU" and priced from policies/default.yaml
whatever the gateway had stored.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import subprocess
import sys
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest

from bench import store
from gateway import db
from gateway.ledger.policy_versions import PolicyVersionWriter
from gateway.policy import load_policy
from gateway.reports import bench_data
from gateway.reports.capacity import DEFAULT_P95_TTFT_MS
from gateway.reports.machine_price import DEFAULT_CPU_HOUR_USD

ROOT = Path(__file__).resolve().parents[2]
SWITCHYARD = Path(sys.executable).with_name("switchyard")
# The benchmark each packaged file copies: its newest full run on any machine (bench/results/<bench>/<machine>.json).
SOURCES = {"engine_curve.json": "engine_curve", "cheaper_model.json": "cheaper", "engine_throughput.json": "engine_throughput"}
CURVE = store.newest("engine_curve", label="")[1]["result"]
CHEAPER = store.newest("cheaper", label="")[1]["result"]

GPU_POLICY = """\
backends:
  gpu-engine:
    kind: engine
    model: m
    api_base: http://127.0.0.1:9/v1
    gpu_hour_usd: 2.0
    gpus: 2
routes:
  m:
    strategy: fixed
    backend: gpu-engine
"""

# A GPU-priced engine first and a CPU host second: a CPU benchmark takes the CPU host's price.
MIXED_POLICY = GPU_POLICY.replace("routes:", """\
  cpu-engine:
    kind: engine
    model: m
    api_base: http://127.0.0.1:9/v1
    cpu_hour_usd: {cpu}
routes:""")

CPU_POLICY = """\
backends:
  cpu-engine:
    kind: engine
    model: m
    api_base: http://127.0.0.1:9/v1
    cpu_hour_usd: 0.4
routes:
  m:
    strategy: fixed
    backend: cpu-engine
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_")}
    env.pop("PYTHONPATH", None)
    return env


def switchyard(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(SWITCHYARD), *args], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=120, check=False)


def elsewhere(tmp_path: Path) -> Path:
    """A working directory outside the checkout, with an empty data/ (the default SQLite ledger's folder)."""
    work = tmp_path / "elsewhere"
    (work / "data").mkdir(parents=True)
    return work


def write(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("ERROR")]


def best_point(points: list[dict], ttft_ms: float) -> dict:
    return max((p for p in points if p["ttft_p95_ms"] <= ttft_ms), key=lambda p: p["concurrency"])


def cpu_name(meta: dict) -> str:
    return f"CPU {meta['cpu']}, {meta['threads']} threads"


# ------------------------------------------------------------------------------------------ shipped figures


def test_packaged_figures_are_the_bench_results():
    for packaged in bench_data.PACKAGED:
        machine, run = store.newest(SOURCES[packaged.name], label="")
        source = store.path(SOURCES[packaged.name], machine).relative_to(ROOT)
        assert json.loads(packaged.read_bytes()) == run["result"], (
            f"{packaged} differs from the newest run in {source}: after rerunning the benchmark, "
            f"write that run's result to {packaged.relative_to(ROOT)}")


def _copy_as_installed(site: Path) -> None:
    """The packages as a wheel lays them out: .py files and pyproject's package-data patterns, nothing beside
    them (model weights over 1 MB left out: these reports never read them)."""
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = ["*.py", *conf["package-data"]["*"]]
    for pkg in conf["packages"]["find"]["include"]:
        for src in ROOT.glob(pkg.rstrip("*")):
            for f in src.rglob("*"):
                if (f.is_file() and "__pycache__" not in f.parts and any(fnmatch(f.name, p) for p in patterns)
                        and f.stat().st_size < 1 << 20):
                    dst = site / f.relative_to(ROOT)
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(f, dst)


def test_both_reports_run_from_an_installed_copy(tmp_path):
    site, work = tmp_path / "site", elsewhere(tmp_path)
    _copy_as_installed(site)
    assert not (site / "bench").exists() and not (site / "policies").exists()
    env = {**_env(), "PYTHONPATH": str(site)}

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "gateway.cli", *args], cwd=work, env=env, capture_output=True,
                              text=True, timeout=120, check=False)

    where = subprocess.run([sys.executable, "-c", "import gateway; print(gateway.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True, check=True)
    assert where.stdout.strip() == str(site / "gateway" / "__init__.py")  # the copy, not the checkout

    r = cli("report", "ladder", "--json")
    assert r.returncode == 0, r.stderr
    body = json.loads(r.stdout)
    assert body["bench"] == "packaged bench/results/cheaper_model.json"
    assert body["machine"]["kind"] == "cpu" and body["device_hour_usd"] == DEFAULT_CPU_HOUR_USD
    assert body["pricing_policy"].startswith("no policy: no ledger at")  # a wheel ships no policies/

    r = cli("report", "capacity", "--target-tokens-per-s", "500", "--json")
    assert r.returncode == 0, r.stderr
    body = json.loads(r.stdout)
    assert body["curve"]["source"] == "packaged bench/results/engine_curve.json"
    assert body["device_hour_usd"] == DEFAULT_CPU_HOUR_USD
    assert list((work / "data").iterdir()) == []  # no empty ledger file left behind


# ------------------------------------------------------------------------------------------ from elsewhere


def test_ladder_from_another_directory_prices_the_cpu_benchmark_as_a_cpu(tmp_path):
    work = elsewhere(tmp_path)
    r = switchyard("report", "ladder", cwd=work)
    assert r.returncode == 0, r.stderr
    assert f"measured on {cpu_name(CHEAPER['meta'])}, priced at ${DEFAULT_CPU_HOUR_USD:g}/h" in r.stdout
    assert "not priced as a GPU: backend 'smollm2' is priced per GPU" in r.stdout  # the default policy's engine
    assert list((work / "data").iterdir()) == []

    policy = write(tmp_path, "mixed.yaml", MIXED_POLICY.format(cpu=0.3))
    r = switchyard("report", "ladder", "--json", "--policy", policy, "--utilisation", "0.5", cwd=work)
    assert r.returncode == 0, r.stderr
    body = json.loads(r.stdout)
    assert body["device_hour_usd"] == 0.3 and "cpu-engine" in body["price_source"]
    assert body["machine"] == {"kind": "cpu", "name": cpu_name(CHEAPER["meta"]), "gpus": None}
    for rung, row in zip(body["rungs"], CHEAPER["stack"]["rows"], strict=True):
        assert rung["usd_per_mtok_full"] == pytest.approx(0.3 / (row["tok_s"] * 3600) * 1e6)
        assert rung["usd_per_mtok_measured"] == pytest.approx(0.3 / (row["tok_s"] * 3600 * 0.5) * 1e6)


def test_capacity_from_another_directory_defaults_ttft_names_machines_and_prices_a_cpu(tmp_path):
    work = elsewhere(tmp_path)
    gpu_policy = write(tmp_path, "gpu.yaml", GPU_POLICY)
    r = switchyard("report", "capacity", "--target-tokens-per-s", "500", "--json", "--policy", gpu_policy, cwd=work)
    assert r.returncode == 0, r.stderr
    body = json.loads(r.stdout)
    point = best_point(CURVE["points"], DEFAULT_P95_TTFT_MS)
    assert body["p95_ttft_ms"] == DEFAULT_P95_TTFT_MS and body["p95_ttft_ms_source"] == "default"
    assert body["operating_point"]["concurrency"] == point["concurrency"]
    assert body["operating_point"]["ttft_p95_ms"] <= DEFAULT_P95_TTFT_MS
    devices = math.ceil(500 / (point["output_tok_s"] * 0.6))
    assert body["devices"] == devices
    # the curve ran on a CPU; the policy prices only a GPU engine: a stated CPU host rate, no GPU plan
    assert body["device"]["kind"] == "cpu" and body["device"]["name"] == cpu_name(CURVE["meta"])
    assert body["device_hour_usd"] == DEFAULT_CPU_HOUR_USD
    assert body["monthly_usd"] == pytest.approx(devices * DEFAULT_CPU_HOUR_USD * 730)
    assert body["device"]["gpu_plan"].startswith("GPU plan: none: backend 'gpu-engine' is priced per GPU")
    assert body["curve"]["machine"] == cpu_name(CURVE["meta"])
    assert body["roofline"]["measured_cpu"]["label"] == f"{CHEAPER['meta']['cpu']} (measured)"

    r = switchyard("report", "capacity", "--target-tokens-per-s", "500", "--policy", gpu_policy, cwd=work)
    assert r.returncode == 0, r.stderr
    assert f"curve measured on {cpu_name(CURVE['meta'])} (packaged bench/results/engine_curve.json)" in r.stdout
    assert f"TTFT p95 target           {DEFAULT_P95_TTFT_MS:,.0f} ms (default" in r.stdout
    assert f"devices needed            {devices} × {cpu_name(CURVE['meta'])}" in r.stdout
    assert f"| {CHEAPER['meta']['cpu']} (measured) ms |" in r.stdout  # the roofline's CPU column
    assert "this CPU" not in r.stdout
    assert list((work / "data").iterdir()) == []

    # --p95-ttft-ms still overrides; the --help states the default
    r = switchyard("report", "capacity", "--target-tokens-per-s", "500", "--json", "--p95-ttft-ms", "6000",
                   "--policy", gpu_policy, cwd=work)
    body = json.loads(r.stdout)
    assert (body["p95_ttft_ms"], body["p95_ttft_ms_source"]) == (6000, "given")
    assert body["operating_point"]["concurrency"] == best_point(CURVE["points"], 6000)["concurrency"]
    r = switchyard("report", "capacity", "--help", cwd=work)
    assert f"default {DEFAULT_P95_TTFT_MS:g} ms" in " ".join(r.stdout.split())


def test_cpu_curve_takes_the_cpu_hosts_price_or_a_given_one(tmp_path):
    work = elsewhere(tmp_path)
    mixed = write(tmp_path, "mixed.yaml", MIXED_POLICY.format(cpu=0.25))
    r = switchyard("report", "capacity", "--target-tokens-per-s", "300", "--json", "--policy", mixed, cwd=work)
    assert r.returncode == 0, r.stderr
    body = json.loads(r.stdout)
    assert (body["device_backend"], body["device_hour_usd"]) == ("cpu-engine", 0.25)
    assert body["monthly_usd"] == pytest.approx(body["devices"] * 0.25 * 730)
    r = switchyard("report", "capacity", "--target-tokens-per-s", "300", "--json", "--policy", mixed,
                   "--device-hour-usd", "0.07", cwd=work)
    body = json.loads(r.stdout)
    assert body["device_hour_usd"] == 0.07 and body["device"]["price_basis"].startswith("given")


def test_gpu_curve_is_priced_per_gpu_and_refused_without_a_gpu_price(tmp_path):
    work = elsewhere(tmp_path)
    curve = {"meta": {"device": "cuda", "gpu": "NVIDIA H100 80GB HBM3", "gpus": 1, "output_tokens": 100},
             "points": [{"concurrency": 32, "output_tok_s": 4000.0, "ttft_p95_ms": 300,
                         "mean_seconds_in_system": 1.0}]}
    curve_file = write(tmp_path, "h100.json", json.dumps(curve))
    gpu_policy = write(tmp_path, "gpu.yaml", GPU_POLICY)
    r = switchyard("report", "capacity", "--target-tokens-per-s", "10000", "--json", "--curve", curve_file,
                   "--policy", gpu_policy, cwd=work)
    assert r.returncode == 0, r.stderr
    body = json.loads(r.stdout)
    # one GPU measured: gpu_hour_usd 2.0 each, not the engine's 2 GPUs × 2.0
    assert body["device"] == {"kind": "gpu", "name": "GPU NVIDIA H100 80GB HBM3", "gpus": 1,
                              "price_basis": body["device"]["price_basis"], "gpu_plan": None}
    assert body["device_hour_usd"] == 2.0
    assert body["devices"] == math.ceil(10000 / (4000 * 0.6))

    cpu_policy = write(tmp_path, "cpu.yaml", CPU_POLICY)
    r = switchyard("report", "capacity", "--target-tokens-per-s", "10000", "--curve", curve_file,
                   "--policy", cpu_policy, cwd=work)
    assert r.returncode == 1 and r.stdout == ""
    (line,) = error_lines(r.stderr)
    assert "GPU NVIDIA H100 80GB HBM3" in line and "--device-hour-usd" in line


def test_default_ttft_target_unreachable_or_unmeasured(tmp_path):
    work = elsewhere(tmp_path)
    slow = {"meta": {"device": "cpu", "cpu": "Slow CPU", "output_tokens": 64},
            "points": [{"concurrency": 1, "output_tok_s": 10.0, "ttft_p95_ms": 2500, "mean_seconds_in_system": 7.0}]}
    r = switchyard("report", "capacity", "--target-tokens-per-s", "5", "--curve",
                   write(tmp_path, "slow.json", json.dumps(slow)), cwd=work)
    assert r.returncode == 1
    (line,) = error_lines(r.stderr)
    assert f"TTFT p95 <= {DEFAULT_P95_TTFT_MS:g} ms" in line and "--p95-ttft-ms" in line
    # a curve with no TTFT measured (decode rows only): planned at its largest concurrency, and labelled so
    spec_only = {"meta": CHEAPER["meta"], "spec": CHEAPER["spec"]}
    r = switchyard("report", "capacity", "--target-tokens-per-s", "500", "--json", "--curve",
                   write(tmp_path, "spec.json", json.dumps(spec_only)), cwd=work)
    assert r.returncode == 0, r.stderr
    body = json.loads(r.stdout)
    assert body["p95_ttft_ms"] is None and body["p95_ttft_ms_source"] == "none"
    assert body["operating_point"]["concurrency"] == max(p["concurrency"] for p in body["curve"]["points"])


def test_missing_inputs_name_the_cheap_fix(tmp_path):
    work = elsewhere(tmp_path)
    r = switchyard("report", "capacity", "--target-tokens-per-s", "10", "--curve", "nope.json", cwd=work)
    assert r.returncode == 1 and r.stdout == ""
    (line,) = error_lines(r.stderr)
    assert "nope.json" in line and "--curve" in line and "bench/" not in line
    r = switchyard("report", "ladder", "--bench", "nope.json", "--utilisation", "0.5", cwd=work)
    assert r.returncode == 1 and r.stdout == ""
    (line,) = error_lines(r.stderr)
    assert "nope.json" in line and "--bench" in line and "python bench/" not in line
    r = switchyard("report", "ladder", "--device-hour-usd", "-1", "--utilisation", "0.5", cwd=work)
    assert r.returncode == 1 and "--device-hour-usd must be a price >= 0" in r.stderr
    assert list((work / "data").iterdir()) == []


# ------------------------------------------------------------------------------------------ the policy


def _store(url: str, tmp_path: Path, *paths: str) -> list[str]:
    """Each policy's text, written the way the gateway writes it when it loads one (oldest first)."""

    async def go() -> list[str]:
        writer = PolicyVersionWriter(db.async_url(url), tmp_path / "pv-spool.jsonl")
        await writer.start()
        versions = []
        for p in paths:
            policy = load_policy(p)
            assert await writer.record(policy)
            versions.append(policy.version)  # loaded_at = now: the later, the newer
        await writer.close()
        return versions

    return asyncio.run(go())


def test_without_policy_both_price_from_the_newest_stored_policy(migrated_db_url, tmp_path):
    work = elsewhere(tmp_path)
    # before any policy is stored: the default policy, labelled
    r = switchyard("report", "capacity", "--target-tokens-per-s", "300", "--json", "--database-url",
                   migrated_db_url, cwd=work)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["pricing_policy"].startswith("the default policy ")

    older = write(tmp_path, "older.yaml", MIXED_POLICY.format(cpu=0.3))
    newer = write(tmp_path, "newer.yaml", MIXED_POLICY.format(cpu=0.45))
    _, version = _store(migrated_db_url, tmp_path, older, newer)
    r = switchyard("report", "capacity", "--target-tokens-per-s", "300", "--json", "--database-url",
                   migrated_db_url, cwd=work)
    assert r.returncode == 0, r.stderr
    body = json.loads(r.stdout)
    assert body["device_hour_usd"] == 0.45 and body["device_backend"] == "cpu-engine"
    assert body["pricing_policy"].startswith(f"policy version {version}, the newest stored in the ledger")
    r = switchyard("report", "ladder", "--json", "--database-url", migrated_db_url, cwd=work)
    assert r.returncode == 0, r.stderr
    body = json.loads(r.stdout)
    assert body["device_hour_usd"] == 0.45 and version in body["pricing_policy"]
    # --policy still wins
    r = switchyard("report", "ladder", "--json", "--database-url", migrated_db_url, "--policy", older, cwd=work)
    assert json.loads(r.stdout)["device_hour_usd"] == 0.3
