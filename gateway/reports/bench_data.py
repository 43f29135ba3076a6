"""The benchmark figures `report capacity` and `report ladder` plan from, and the machine each was measured on.

The figures ship with the package (gateway/reports/data/, declared as package data), so both reports work from
any directory and on an installed package, not only inside a checkout. Each is the result of the benchmark's
newest run in bench/results/<bench>/<machine>.json (the source: the benchmarks file their runs there), checked
by tests/gateway/test_reports_anywhere.py; after rerunning a benchmark, write that run's result here. Always reading the packaged copy (never bench/results when
it happens to exist) keeps a report's figures the same in a checkout and on an install.

A benchmark names its machine in `meta` (`device`, `cpu` / `gpu`, `threads`) or, for engine_throughput.json,
`machine` (`processor`, `cpu_count`, torch's `+cpu` build): `machine_of` reads either.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

DATA_DIR = Path(__file__).resolve().parent / "data"
ENGINE_CURVE = DATA_DIR / "engine_curve.json"  # bench/engine_curve.py: throughput and TTFT per concurrency
CHEAPER_MODEL = DATA_DIR / "cheaper_model.json"  # bench/cheaper_model.py: the ladder's stack, model size
ENGINE_THROUGHPUT = DATA_DIR / "engine_throughput.json"  # bench/engine_throughput.py: one point, model shape
PACKAGED = (ENGINE_CURVE, CHEAPER_MODEL, ENGINE_THROUGHPUT)


def is_packaged(path: str | Path) -> bool:
    return Path(path).resolve() in PACKAGED


def describe(path: str | Path) -> str:
    """How an input file is named in output: the packaged copies by what they copy."""
    p = Path(path)
    return f"packaged bench/results/{p.name}" if is_packaged(p) else str(p)


def missing_hint(path: str | Path, flag: str) -> str:
    """The cheap fix for an input that cannot be read: another file, or the packaged default."""
    if is_packaged(path):
        return f"the packaged copy is missing from this install: reinstall switchyard, or pass {flag} FILE"
    return f"pass {flag} with a readable benchmark JSON, or leave {flag} out to use the packaged figures"


DeviceKind = Literal["cpu", "gpu"]


@dataclass(frozen=True, slots=True)
class Machine:
    """The machine a benchmark ran on, as its JSON names it."""

    kind: DeviceKind | None  # None: the file does not say
    name: str  # "CPU AMD EPYC, 2 threads", "GPU NVIDIA H100 80GB HBM3", "an unnamed machine"
    gpus: int = 1  # GPUs one measured engine used (a GPU curve's meta.gpus)

    def as_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "gpus": self.gpus if self.kind == "gpu" else None}


UNNAMED = Machine(None, "an unnamed machine (the file has no meta.device, meta.cpu or meta.gpu)")


def machine_of(data: Any) -> Machine:
    """The machine a benchmark JSON was measured on."""
    if not isinstance(data, dict):
        return UNNAMED
    meta = data.get("meta") if isinstance(data.get("meta"), dict) else {}
    mach = data.get("machine") if isinstance(data.get("machine"), dict) else {}
    device = str(meta.get("device") or mach.get("device") or "").lower()
    gpu = meta.get("gpu") or meta.get("gpu_name") or mach.get("gpu")
    if gpu or device.startswith("cuda") or device == "gpu":
        gpus = meta.get("gpus") or mach.get("gpus") or 1
        return Machine("gpu", f"GPU {gpu or '(model not recorded)'}", int(gpus))
    cpu = meta.get("cpu") or mach.get("cpu") or mach.get("processor")
    torch = str(meta.get("torch") or mach.get("torch") or "")
    if device == "cpu" or cpu or torch.endswith("+cpu"):
        if meta.get("threads"):
            size = f", {meta['threads']} threads"
        elif mach.get("cpu_count"):
            size = f", {mach['cpu_count']} CPUs"
        else:
            size = ""
        return Machine("cpu", f"CPU {cpu or '(model not recorded)'}{size}")
    return UNNAMED


def read_json(path: str | Path) -> Any:
    """The parsed file (a results record: its newest run); OSError / ValueError as json and open raise them."""
    return latest_result(json.loads(Path(path).read_text()))


def latest_result(data: Any) -> Any:
    """One run's figures from either file shape: a bench/results/<bench>/<machine>.json record (every run on that
    machine, newest last: its newest run's result) or one run's JSON (what a benchmark writes with --out, and the
    packaged copies)."""
    runs = data.get("runs") if isinstance(data, dict) and "bench" in data else None
    if isinstance(runs, list) and runs and isinstance(runs[-1], dict) and "result" in runs[-1]:
        return runs[-1]["result"]
    return data
