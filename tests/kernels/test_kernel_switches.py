"""The kernel switches are decided once per process: the environment's overrides read at start, then only what the
engine's config (or a test) sets through kernels/switches.py; the dispatch never looks at the environment again."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kernels import ops, switches
from kernels.switches import Switches


def test_overrides_parse():
    assert switches.from_env({}) == Switches()
    env = {"SWITCHYARD_KERNELS": " Reference ", "SWITCHYARD_CPU_NATIVE": "off", "SWITCHYARD_CPU_AMX": "0",
           "SWITCHYARD_CPU_MARCH": "x86-64-v3", "SWITCHYARD_CPU_PACKED_WEIGHTS": "no",
           "SWITCHYARD_CPU_DECODE_STEP": "1", "SWITCHYARD_KERNEL_AUTOTUNE": "false"}
    assert switches.from_env(env) == Switches(kernels="reference", cpu_native=False, cpu_amx=False,
                                              cpu_march="x86-64-v3", cpu_packed_weights=False,
                                              kernel_autotune=False)
    with pytest.raises(ValueError, match="SWITCHYARD_KERNELS"):
        switches.from_env({"SWITCHYARD_KERNELS": "bogus"})


def test_the_environment_after_start_changes_nothing_and_a_mode_is_passed(monkeypatch, kernel_switches):
    cpu = torch.device("cpu")
    chosen = ops.select(cpu)
    monkeypatch.setenv("SWITCHYARD_KERNELS", "triton" if chosen.name != "triton" else "reference")
    assert ops.select(cpu) is chosen  # read once, at start: not per call
    kernel_switches(kernels="reference")
    assert ops.select(cpu) is ops.REFERENCE and ops.backend_mode() == "reference"
    assert ops.select(cpu, "auto") is ops.CPU  # an explicit mode wins over the switch
    with pytest.raises(ValueError, match="bogus"):
        ops.select(cpu, "bogus")


def test_using_restores_the_previous_switches():
    before = switches.current()
    with switches.using(kernels="reference", cpu_decode_step=False) as now:
        assert now.kernels == "reference" and not now.cpu_decode_step
    assert switches.current() == before


def test_an_override_in_the_environment_at_start_is_honoured():
    env = {**os.environ, "SWITCHYARD_KERNELS": "reference"}
    out = subprocess.run([sys.executable, "-c", "from kernels import ops; print(ops.select('cpu').name)"],
                         env=env, capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.strip() == "reference"
