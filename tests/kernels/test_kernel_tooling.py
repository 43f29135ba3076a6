"""The GPU-only tooling, exercised on CPU: the benchmark script's smoke mode and the sm_90 compile check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels.conftest import KERNEL_TEST_DEVICE, TRITON_ALREADY_COMPILED_MODE

ROOT = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "SWITCHYARD_KERNELS")}
    env.update(extra)
    return env


def test_gpu_bench_script_cpu_smoke(tmp_path):
    proc = subprocess.run(
        ["bash", "bench/gpu_kernels.sh", "--cpu-smoke"], check=False, cwd=ROOT, capture_output=True, text=True, timeout=240,
        env=_env(BENCH_RESULTS_DIR=str(tmp_path), PYTHON=sys.executable),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((tmp_path / "kernels_cpu_smoke.json").read_text())
    impls = {row["impl"] for row in data["rows"]}
    assert {"paged (reference)", "int8 (reference)", "int4 g32 (reference)"} <= impls
    assert all(row["ms"] > 0 for row in data["rows"])
    assert "| decode_attention |" in (tmp_path / "kernels_cpu_smoke.md").read_text()


@pytest.mark.skipif(KERNEL_TEST_DEVICE != "cpu", reason="on a GPU the kernel tests compile every kernel anyway")
def test_kernels_compile_for_hopper():
    # Ahead-of-time compile (to cubin) of one launch configuration per kernel for sm_90, no GPU needed.
    proc = subprocess.run(
        [sys.executable, "-m", "kernels.compile_check", "--arch", "90", "--quick"], check=False, cwd=ROOT,
        capture_output=True, text=True, timeout=280, env=_env(PYTHONPATH=str(ROOT)),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "sm_90: compiled" in proc.stdout
    for kernel in ("decode", "prefill", "int8_linear", "int4_linear", "rms_norm"):
        assert kernel in proc.stdout


@pytest.mark.skipif(not TRITON_ALREADY_COMPILED_MODE, reason="the Triton kernel tests ran in this process")
def test_triton_kernel_tests_in_a_fresh_process():
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/kernels/test_kernel_triton.py", "-q", "-p", "no:cacheprovider"],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=600, env=_env(),
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
