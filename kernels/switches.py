"""The engine's kernel switches, decided once for a process: which backend `ops.select` picks, whether the native
CPU kernels are built and with which target, AMX, packed CPU weights, the native decode step and Triton autotuning.

An engine sets them from its config when it starts (hosted/config.py EngineConfig, `switchyard engine serve`
flags; hosted/model_runner.py calls `configure`). The environment variables are documented overrides of the
defaults, read here and nowhere else, once (the first time anything asks for `current()`):

  SWITCHYARD_KERNELS              kernels             auto | triton | reference (kernels/ops.py)
  SWITCHYARD_CPU_NATIVE=0         cpu_native          no compiled CPU kernels: the torch reference
  SWITCHYARD_CPU_AMX=0            cpu_amx             bf16 projections off AMX tiles where the CPU has them
  SWITCHYARD_CPU_MARCH            cpu_march           the -march the native kernels build for (default native)
  SWITCHYARD_CPU_PACKED_WEIGHTS=0 cpu_packed_weights  CPU GEMMs on the weights as loaded (no packed copy)
  SWITCHYARD_CPU_DECODE_STEP=0    cpu_decode_step     the per-op decode loop instead of the native layer loop
  SWITCHYARD_KERNEL_AUTOTUNE=0    kernel_autotune     Triton GEMV tiles from a heuristic table, not autotuned

Tests and benchmarks pass a mode: `configure(kernels="reference")`, or `ops.select(device, "reference")`.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

MODES = ("auto", "triton", "reference")


@dataclass(frozen=True, slots=True)
class Switches:
    kernels: str = "auto"
    cpu_native: bool = True
    cpu_amx: bool = True
    cpu_march: str = "native"
    cpu_packed_weights: bool = True
    cpu_decode_step: bool = True
    kernel_autotune: bool = True

    def __post_init__(self) -> None:
        if self.kernels not in MODES:
            raise ValueError(f"kernels (SWITCHYARD_KERNELS) {self.kernels!r} is not one of {', '.join(MODES)}")


_ENV = {"kernels": "SWITCHYARD_KERNELS", "cpu_native": "SWITCHYARD_CPU_NATIVE", "cpu_amx": "SWITCHYARD_CPU_AMX",
        "cpu_march": "SWITCHYARD_CPU_MARCH", "cpu_packed_weights": "SWITCHYARD_CPU_PACKED_WEIGHTS",
        "cpu_decode_step": "SWITCHYARD_CPU_DECODE_STEP", "kernel_autotune": "SWITCHYARD_KERNEL_AUTOTUNE"}


def from_env(environ: Mapping[str, str] = os.environ) -> Switches:
    """The defaults with the environment's overrides (an on/off switch is on unless 0 / false / no / off)."""
    values: dict[str, object] = {}
    for name, var in _ENV.items():
        raw = environ.get(var, "").strip()
        if not raw:
            continue
        if name in ("kernels", "cpu_march"):
            values[name] = raw.lower() if name == "kernels" else raw
        else:
            values[name] = raw.lower() not in ("0", "false", "no", "off")
    return Switches(**values)


_state: dict[str, Switches] = {}
_listeners: list[Callable[[Switches, Switches], None]] = []


def current() -> Switches:
    """The process's switches: the environment's overrides of the defaults, read on first use, then `configure`d."""
    switches = _state.get("now")
    if switches is None:
        switches = _state["now"] = from_env()
    return switches


def configure(**changes: object) -> Switches:
    """Set switches for this process (an engine's config at start; tests); returns the previous ones. Listeners
    (cpu_native: the library to build again) hear of a change."""
    before = current()
    after = dataclasses.replace(before, **changes)  # type: ignore[arg-type]
    _state["now"] = after
    if after != before:
        for listener in _listeners:
            listener(before, after)
    return before


@contextmanager
def using(**changes: object) -> Iterator[Switches]:
    """`configure(**changes)` inside the block, the previous switches restored after (tests, benchmarks)."""
    before = configure(**changes)
    try:
        yield current()
    finally:
        configure(**dataclasses.asdict(before))


def on_change(listener: Callable[[Switches, Switches], None]) -> None:
    _listeners.append(listener)
