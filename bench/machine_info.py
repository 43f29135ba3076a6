"""What every benchmark records about where it ran, its short stable name, and a free loopback port."""
from __future__ import annotations

import os
import platform
import re
from pathlib import Path

from gateway.listen_address import free_port  # noqa: F401 - the one, re-exported for the benchmarks

# SWITCHYARD_BENCH_MACHINE names the machine when the CPU does not tell it apart (two hosts of one CPU type).
MACHINE_ENV = "SWITCHYARD_BENCH_MACHINE"


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields from /proc/cpuinfo ({} where there is none)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_model() -> str:
    """The CPU's model name (the figures depend on it), from /proc/cpuinfo where there is one."""
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def _zen(family: int, model: int) -> str:
    """AMD's core generation from the CPUID family and model (the model name often says only 'AMD EPYC')."""
    if family == 0x17:
        return "zen1" if model < 0x30 else "zen2"
    if family == 0x19:
        return "zen4" if 0x10 <= model < 0x20 or 0x60 <= model < 0xB0 else "zen3"
    if family == 0x1A:
        return "zen5"
    return f"fam{family}"


def machine_slug(info: dict[str, str] | None = None, cpus: int | None = None) -> str:
    """A short name that stays the same across runs on one kind of machine: epyc-zen4-2vcpu, xeon-spr-2vcpu."""
    if os.environ.get(MACHINE_ENV):
        return os.environ[MACHINE_ENV]
    info = _cpuinfo() if info is None else info
    cpus = os.cpu_count() if cpus is None else cpus
    name, flags = info.get("model name", ""), set(info.get("flags", "").split())
    if info.get("vendor_id") == "AuthenticAMD":
        parts = ["epyc" if "EPYC" in name else "amd", _zen(int(info.get("cpu family", 0)), int(info.get("model", 0)))]
    elif info.get("vendor_id") == "GenuineIntel":
        parts = ["xeon" if "Xeon" in name else "intel", "spr" if "amx_tile" in flags else ""]
    else:
        parts = [re.sub(r"[^a-z0-9]+", "-", (name or platform.machine()).lower()).strip("-")[:24]]
    return "-".join(p for p in [*parts, f"{cpus}vcpu"] if p)


def gpu_slug(device_name: str) -> str:
    """A GPU's results name: 'NVIDIA H200' -> 'h200' (a GPU run is filed by its device, not its host CPU)."""
    name = re.sub(r"^nvidia\s+", "", device_name.strip().lower())
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"


def machine() -> dict:
    return {"cpus": os.cpu_count(), "cpu_model": cpu_model(), "platform": platform.platform(),
            "slug": machine_slug()}


