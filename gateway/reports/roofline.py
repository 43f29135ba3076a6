"""The memory-bandwidth floor of decode: no engine can make one token faster than this.

Each decode step of a replica reads every weight once (the whole batch shares that read) plus the KV cache
of the positions it attends to, so one sequence's per-token latency is at least

    (parameters × bytes per parameter + KV bytes per token) ÷ memory bandwidth.

Bytes per parameter: fp32 4, bf16 / fp16 2, int8 1 and int4 0.5, each quantized format plus one fp16 scale
per 32-value block (1.0625 and 0.5625 B). Pure arithmetic: no database, no torch.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.reports.bench_data import describe, latest_result

SCALE_BLOCK = 32  # values sharing one scale in the quantized formats
SCALE_BYTES = 2  # an fp16 scale
BYTES_PER_PARAM: dict[str, float] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "int8": 1.0 + SCALE_BYTES / SCALE_BLOCK,  # 1.0625
    "int4": 0.5 + SCALE_BYTES / SCALE_BLOCK,  # 0.5625
}
# KV cache element size per weight precision: activations (and the KV cache) stay in the compute dtype;
# weight-only int8 / int4 are assumed to run with an fp16 KV cache.
KV_BYTES_PER_ELEMENT: dict[str, float] = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 2.0, "int4": 2.0}
# Peak memory bandwidth, bytes per second (vendor figures).
ACCELERATORS: dict[str, float] = {
    "H100 SXM": 3.35e12,
    "H200": 4.8e12,
    "A100-80GB": 2.039e12,
    "L40S": 0.864e12,
    "L4": 0.3e12,
    "A10G": 0.6e12,
}
DEFAULT_CONTEXT_TOKENS = 1024

ASSUMPTIONS = (
    ("decode floor = (parameters × bytes/parameter + KV bytes read per token) ÷ peak memory bandwidth: "
    "every weight is read once per decode step (a tied embedding is read by the head), compute is free, "
    "and nothing stays in cache between steps"),
    ("int8 / int4 include one fp16 scale per 32-value block (1.0625 / 0.5625 B per parameter); "
    "their KV cache is fp16, fp32 and bf16 keep the KV cache in their own dtype"),
    ("the floor is per replica on one device: a second GPU serving another replica doubles throughput but "
    "does not lower the floor; tensor parallelism over N GPUs has each GPU read 1/N of the bytes "
    "(floor ÷ N per token, before all-reduce cost) at N times the device cost"),
    ("a batch of B sequences shares one weight read per step, so B × 1000 / floor_ms tokens/s is the "
    "aggregate ceiling only while the KV reads stay small next to the weights"),
)


class RooflineError(ValueError):
    """A roofline input that cannot be used (unknown precision, non-positive bandwidth)."""


def bytes_per_param(precision: str) -> float:
    try:
        return BYTES_PER_PARAM[precision.lower()]
    except KeyError:
        raise RooflineError(f"unknown precision {precision!r}; known: {', '.join(BYTES_PER_PARAM)}") from None


def decode_floor_ms(param_count: float, bytes_per_param: float, bandwidth_bytes_per_s: float,
                    kv_bytes_per_token: float = 0) -> float:
    """Lower bound on one sequence's decode latency per token, in milliseconds."""
    if bandwidth_bytes_per_s <= 0:
        raise RooflineError(f"memory bandwidth must be positive, got {bandwidth_bytes_per_s}")
    if param_count < 0 or bytes_per_param < 0 or kv_bytes_per_token < 0:
        raise RooflineError("parameter count, bytes per parameter and KV bytes must not be negative")
    return (param_count * bytes_per_param + kv_bytes_per_token) / bandwidth_bytes_per_s * 1000.0


def kv_bytes_per_token(kv_values_per_position: float, context_tokens: int, bytes_per_element: float) -> float:
    """KV bytes one decode step reads for one sequence: every cached position's K and V.

    kv_values_per_position = 2 × layers × kv_heads × head_dim (K and V of one position, all layers).
    """
    return kv_values_per_position * max(context_tokens, 0) * bytes_per_element


def kv_values_per_position(num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    return 2 * num_layers * num_kv_heads * head_dim


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the floor needs of the deployed model, and where it came from."""

    param_count: int
    kv_values_per_position: int = 0  # 0 = unknown: the KV read is left out
    source: str = ""


@dataclass(frozen=True, slots=True)
class RooflineRow:
    precision: str
    bytes_per_param: float
    weight_bytes: float
    kv_bytes_per_token: float
    floors_ms: dict[str, float] = field(default_factory=dict)  # accelerator -> floor

    def ceiling_tok_s(self, accelerator: str) -> float:
        """One sequence's best possible decode rate on that accelerator."""
        return 1000.0 / self.floors_ms[accelerator]


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = latest_result(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def model_shape_from_bench(paths: list[str | Path]) -> ModelShape | None:
    """The parameter count (runs.fp32.param_bytes / 4 of bench/results/cheaper_model.json, or model.parameters
    of engine_throughput.json) and the KV shape (that file's model section, or its decode_bandwidth)."""
    params: int | None = None
    kv = 0
    sources: list[str] = []
    for p in map(Path, paths):
        data = _read_json(p)
        if data is None:
            continue
        fp32 = (data.get("runs") or {}).get("fp32") or {}
        model = data.get("model") or {}
        if params is None and fp32.get("param_bytes"):
            params = int(fp32["param_bytes"]) // 4
            sources.append(f"{describe(p)} (runs.fp32.param_bytes / 4)")
        elif params is None and model.get("parameters"):
            params = int(model["parameters"])
            sources.append(f"{describe(p)} (model.parameters)")
        if not kv and model.get("num_hidden_layers") and model.get("num_attention_heads"):
            heads = int(model["num_attention_heads"])
            head_dim = int(model.get("head_dim") or int(model["hidden_size"]) // heads)
            kv = kv_values_per_position(int(model["num_hidden_layers"]),
                                        int(model.get("num_key_value_heads") or heads), head_dim)
        elif not kv and (data.get("decode_bandwidth") or {}).get("kv_bytes_per_token"):
            kv = int(data["decode_bandwidth"]["kv_bytes_per_token"]) // 4  # measured in fp32
    if params is None:
        return None
    return ModelShape(param_count=params, kv_values_per_position=kv, source="; ".join(sources))


@dataclass(frozen=True, slots=True)
class MeasuredCpu:
    """A CPU's measured streaming-read bandwidth, named after the machine the benchmark ran on."""

    label: str  # the roofline column: "AMD EPYC (measured)"
    bytes_per_s: float
    source: str  # the file, the CPU's full name and the thread count


def measured_cpu(paths: list[str | Path]) -> MeasuredCpu | None:
    """The first bench JSON's meta.read_bandwidth, with the CPU it was measured on (meta.cpu)."""
    for p in map(Path, paths):
        data = _read_json(p)
        meta = (data or {}).get("meta") or {}
        bw = meta.get("read_bandwidth") or {}
        if bw.get("gb_s"):
            cpu = str(meta.get("cpu") or "CPU (model not recorded)")
            return MeasuredCpu(f"{cpu} (measured)", float(bw["gb_s"]) * 1e9,
                               f"{describe(p)} (meta.read_bandwidth on {cpu}, {bw.get('threads', '?')} threads)")
    return None


def cpu_read_bandwidth(paths: list[str | Path]) -> tuple[float, str] | None:
    """(bytes/s, where from) of measured_cpu: the benchmark machine's streaming-read bandwidth."""
    cpu = measured_cpu(paths)
    return None if cpu is None else (cpu.bytes_per_s, cpu.source)


def roofline_table(param_count: float, context_tokens: int = DEFAULT_CONTEXT_TOKENS,
                   kv_values: float = 0, accelerators: dict[str, float] | None = None,
                   precisions: tuple[str, ...] = ("fp32", "bf16", "int8", "int4")) -> list[RooflineRow]:
    """Per precision, the decode floor on each accelerator (bandwidth in bytes/s)."""
    accel = ACCELERATORS if accelerators is None else accelerators
    rows = []
    for prec in precisions:
        bpp = bytes_per_param(prec)
        kv = kv_bytes_per_token(kv_values, context_tokens, KV_BYTES_PER_ELEMENT[prec])
        rows.append(RooflineRow(precision=prec, bytes_per_param=bpp, weight_bytes=param_count * bpp,
                                kv_bytes_per_token=kv,
                                floors_ms={name: decode_floor_ms(param_count, bpp, bw, kv)
                                           for name, bw in accel.items()}))
    return rows


def _ms(x: float) -> str:
    return f"{x:.3f}" if x < 1 else f"{x:.2f}" if x < 100 else f"{x:.0f}"


def format_table(rows: list[RooflineRow], accelerators: dict[str, float]) -> str:
    names = list(accelerators)
    head = ["precision", "B/param", "weights MB", "KV MB/token"] + [f"{n} ms" for n in names]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * 4 + " ---: |" * len(names)]
    for r in rows:
        cells = [r.precision, f"{r.bytes_per_param:.4g}", f"{r.weight_bytes / 1e6:,.1f}",
                 f"{r.kv_bytes_per_token / 1e6:,.2f}"] + [_ms(r.floors_ms[n]) for n in names]
        lines.append("| " + " | ".join(cells) + " |")
    bw = ", ".join(f"{n} {b / 1e12:.3g} TB/s" for n, b in accelerators.items())
    return "\n".join(lines) + f"\n(bandwidth: {bw})\n"


def as_json(rows: list[RooflineRow]) -> list[dict[str, Any]]:
    return [{"precision": r.precision, "bytes_per_param": r.bytes_per_param, "weight_bytes": r.weight_bytes,
             "kv_bytes_per_token": r.kv_bytes_per_token, "floor_ms": dict(r.floors_ms),
             "ceiling_tok_s_per_sequence": {n: r.ceiling_tok_s(n) for n in r.floors_ms}} for r in rows]
