"""What one device of the machine a benchmark ran on costs per hour — the price its throughput is worth.

A throughput measured on a 2-core CPU says nothing about what a GPU-hour buys, so a benchmark is priced at the
price of the kind of device it was measured on:

- a CPU benchmark: the engine backend's `cpu_hour_usd` (the named one, else the first engine priced per CPU
  host), else a stated rate for a small CPU host (DEFAULT_CPU_HOUR_USD, the policy docs' example). A GPU-priced
  engine gets no figures from it: `gpu_note` says so (capacity's roofline floor is its only GPU estimate).
- a GPU benchmark: the engine's `gpu_hour_usd` × the GPUs the benchmark used; refused if no engine is priced
  per GPU.
- a benchmark that names no machine: the engine's own price, as measured on it (labelled an assumption).

`--device-hour-usd` replaces all of that with a given price for one such device.
"""
from __future__ import annotations

from dataclasses import dataclass

from gateway.reports.bench_data import Machine
from gateway.reports.report_policy import ReportPolicy

# The hourly price of a small CPU host (2-4 vCPUs) when the policy prices none; policies/default.yaml's comment
# suggests the same figure for an engine on a CPU host.
DEFAULT_CPU_HOUR_USD = 0.10


class MachinePriceError(ValueError):
    """The benchmark's machine cannot be priced from the policy (a GPU benchmark, no GPU price)."""


@dataclass(frozen=True, slots=True)
class MachinePrice:
    usd_per_hour: float  # one device of the benchmark's machine (a CPU host, or the GPUs one engine used)
    basis: str  # how it was worked out, for the assumptions
    backend: str | None  # the engine backend whose price it is (None: given or stated)
    machine: Machine
    gpu_note: str | None = None  # a CPU benchmark beside a GPU-priced engine: why there is no GPU plan

    @property
    def device_word(self) -> str:
        return {"cpu": "CPU host", "gpu": "GPU"}.get(self.machine.kind or "", "device")


def _engines(rp: ReportPolicy, backend: str | None) -> list:
    """The engine backends to price from: the named one (checked), else all, in policy order."""
    policy = rp.policy
    if backend:
        if policy is None:
            raise MachinePriceError(f"--backend {backend}: {rp.label}")
        spec = policy.backends.get(backend)
        if spec is None:
            raise MachinePriceError(f"no backend {backend!r} in {rp.name} (have: {', '.join(policy.backends)})")
        if spec.kind != "engine":
            raise MachinePriceError(f"backend {backend!r} in {rp.name} is kind {spec.kind}, not an engine")
        return [spec]
    return [] if policy is None else [b for b in policy.backends.values() if b.kind == "engine"]


def _gpu_priced(spec) -> bool:
    return spec.cpu_hour_usd is None and spec.gpu_hour_usd > 0


def machine_price(machine: Machine, rp: ReportPolicy, backend: str | None = None,
                  device_hour_usd: float | None = None, bench_flag: str = "--curve") -> MachinePrice:
    """The hourly price of one device of `machine`, from the policy `rp` (or `device_hour_usd`, given).
    `bench_flag`: the report's flag for another benchmark file, named in the no-GPU-plan note."""
    engines = _engines(rp, backend)
    if device_hour_usd is not None:
        if not device_hour_usd >= 0:
            raise MachinePriceError(f"--device-hour-usd must be a price >= 0, got {device_hour_usd}")
        return MachinePrice(float(device_hour_usd), f"given (--device-hour-usd) for one {machine.name}", None,
                            machine)
    if machine.kind == "cpu":
        gpu = engines[0] if engines and _gpu_priced(engines[0]) else None  # the engine the plan is for
        note = None if gpu is None else (
            f"backend {gpu.name!r} is priced per GPU (${gpu.gpu_hour_usd:g}/h × {gpu.gpus}), "
            f"but the benchmark ran on {machine.name}; GPU figures need a benchmark measured on that GPU "
            f"({bench_flag} FILE)")
        spec = next((e for e in engines if e.cpu_hour_usd is not None), None)
        if spec is not None:
            return MachinePrice(float(spec.cpu_hour_usd), f"cpu_hour_usd of backend {spec.name!r} ({rp.name})",
                                spec.name, machine, note)
        return MachinePrice(DEFAULT_CPU_HOUR_USD,
                            f"a stated ${DEFAULT_CPU_HOUR_USD:.2f}/h for a small CPU host ({rp.name} prices no "
                            "engine per CPU host: set cpu_hour_usd on one, or pass --device-hour-usd)",
                            None, machine, note)
    if machine.kind == "gpu":
        spec = next((e for e in engines if _gpu_priced(e)), None)
        if spec is None:
            raise MachinePriceError(
                f"the benchmark ran on {machine.name}, and no engine backend is priced per GPU in {rp.name}: "
                "pass --device-hour-usd USD (the GPU's hourly price) or --policy FILE")
        return MachinePrice(spec.gpu_hour_usd * machine.gpus,
                            f"gpu_hour_usd {spec.gpu_hour_usd:g} of backend {spec.name!r} × the benchmark's "
                            f"{machine.gpus} GPU(s) ({rp.name})", spec.name, machine)
    if not engines:
        raise MachinePriceError(f"no engine backend to price the benchmark's device with in {rp.name}: pass "
                                "--device-hour-usd USD or --policy FILE")
    from gateway.pricing import device_hour_usd as engine_hour_usd

    spec = engines[0]
    how = (f"cpu_hour_usd of backend {spec.name!r}" if spec.cpu_hour_usd is not None
           else f"gpu_hour_usd {spec.gpu_hour_usd:g} × gpus {spec.gpus} of backend {spec.name!r}")
    return MachinePrice(engine_hour_usd(spec), f"{how} ({rp.name}); the benchmark names no machine, so it is "
                        "assumed measured on that engine", spec.name, machine)
