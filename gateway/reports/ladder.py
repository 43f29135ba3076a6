"""`switchyard report ladder`: what each stacked optimization does to $/Mtok.

Reads the engine benchmark's stack (the packaged copy of bench/results/cheaper_model.json, or `--bench FILE`;
section `stack.rows`: one request at a time → + continuous batching → + prefix cache → + quantization →
+ speculative decoding) and prices every rung's measured output tokens/s at the hourly price of the machine the
benchmark ran on (gateway/reports/machine_price.py: a CPU benchmark at a CPU host's price, not a GPU's; the
policy is `--policy`, else the one stored in the ledger, else the default: gateway/reports/report_policy.py):

    $/Mtok = device_hour_usd / (tok_s × 3600 × utilisation) × 1e6

at 100% utilisation and, when known, at the measured utilisation (floored at gateway.pricing's
UTILISATION_FLOOR, 5%, as request pricing does). Speed-ups are shown against the rung before and the first
rung as measured: a rung that got slower shows < 1×.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from gateway.pricing import UTILISATION_FLOOR
from gateway.reports.bench_data import (
    CHEAPER_MODEL,
    Machine,
    describe,
    latest_result,
    machine_of,
    missing_hint,
)
from gateway.reports.machine_price import MachinePriceError, machine_price
from gateway.reports.report_policy import ReportPolicyError, report_policy

DEFAULT_BENCH = CHEAPER_MODEL  # shipped with the package: the ladder works from any directory


class LadderError(ValueError):
    """The ladder cannot be built: no benchmark file, no stack section, a malformed row, no price."""


@dataclass(frozen=True, slots=True)
class LadderRung:
    rung: str
    tok_s: float
    usd_per_mtok_full: float  # at 100% utilisation
    usd_per_mtok_measured: float | None  # at the measured utilisation; None when it is unknown
    speedup_vs_previous: float  # tok_s ÷ the rung this one builds on (1.0 for the first)
    speedup_vs_first: float
    note: str = ""


def _load(path: str | Path | None) -> tuple[Path, Any]:
    p = Path(path) if path else DEFAULT_BENCH
    try:
        return p, latest_result(json.loads(p.read_text()))
    except FileNotFoundError:
        raise LadderError(f"{describe(p)}: no such file ({missing_hint(p, '--bench')})") from None
    except OSError as e:
        raise LadderError(f"{describe(p)}: cannot read it ({e.strerror or e}; {missing_hint(p, '--bench')})") from None
    except ValueError as e:
        raise LadderError(f"{describe(p)}: not JSON ({e}; {missing_hint(p, '--bench')})") from None


def load_stack(path: str | Path | None = None) -> list[dict[str, Any]]:
    """The `stack.rows` of an engine benchmark JSON (default: the packaged cheaper_model.json)."""
    p, data = _load(path)
    stack = data.get("stack") if isinstance(data, dict) else None
    rows = stack.get("rows") if isinstance(stack, dict) else None
    if not rows or not isinstance(rows, list):
        raise LadderError(f"{describe(p)}: no stack section with rows (pass --bench with one, as "
                          "bench/cheaper_model.py --sections stack writes, or leave --bench out)")
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or "stage" not in r or not isinstance(r.get("tok_s"), int | float):
            raise LadderError(f"{p}: stack row {i} needs a `stage` and a numeric `tok_s`")
    return rows


def load_stack_meta(path: str | Path | None = None) -> dict[str, Any]:
    """The stack section without its rows (requests, tokens, gpu_hour_usd, system_prompt_tokens)."""
    p = Path(path) if path else DEFAULT_BENCH
    load_stack(p)  # the same errors
    stack = latest_result(json.loads(p.read_text()))["stack"]
    return {k: v for k, v in stack.items() if k != "rows"}


def bench_machine(path: str | Path | None = None) -> Machine:
    """The machine the benchmark ran on (its meta names it)."""
    return machine_of(_load(path)[1])


def _usd_per_mtok(device_hour_usd: float, tok_s: float, utilisation: float) -> float:
    return device_hour_usd / (tok_s * 3600 * utilisation) * 1e6


def _base_name(stage: str) -> str:
    return stage.strip().removeprefix("+").strip().lower()


def _previous(rows: list[dict[str, Any]], i: int) -> tuple[int, bool]:
    """The index of the rung row i builds on, and whether row i is an alternative (not a `+ …` rung).

    A `+ …` row builds on the row above it. Any other row after the first is an alternative stack: it builds
    on the latest earlier row whose name it starts with ("prefix cache + speculative…" on "+ prefix cache"),
    else on the row above.
    """
    stage = str(rows[i]["stage"]).strip()
    if i == 0 or stage.startswith("+"):
        return max(i - 1, 0), False
    name = stage.lower()
    for j in range(i - 1, -1, -1):
        base = _base_name(str(rows[j]["stage"]))
        if base and name.startswith(base):
            return j, True
    return i - 1, True


def ladder_rows(stack_rows: list[dict[str, Any]], device_hour_usd: float,
                utilisation: float | None) -> list[LadderRung]:
    """Each rung's $/Mtok (output tokens) at 100% and at `utilisation` (None: unknown), and its speed-ups."""
    if device_hour_usd < 0:
        raise LadderError(f"the device price must not be negative, got {device_hour_usd}")
    if not stack_rows:
        raise LadderError("the stack has no rows")
    util = None
    util_note = ""
    if utilisation is not None:
        util = min(float(utilisation), 1.0)
        if util < UTILISATION_FLOOR:
            util_note = (f"utilisation {float(utilisation):.1%} floored at {UTILISATION_FLOOR:.0%} "
                         "(gateway.pricing's UTILISATION_FLOOR)")
            util = UTILISATION_FLOOR
        elif float(utilisation) > 1.0:
            util_note = f"utilisation {float(utilisation):.2f} capped at 100%"
    first = float(stack_rows[0]["tok_s"])
    rungs = []
    for i, row in enumerate(stack_rows):
        tok_s = float(row["tok_s"])
        if tok_s <= 0:
            raise LadderError(f"stack row {row['stage']!r} has tok_s {tok_s}: cannot price it")
        prev_i, alternative = _previous(stack_rows, i)
        prev = float(stack_rows[prev_i]["tok_s"])
        vs_prev = tok_s / prev if i else 1.0
        notes = []
        if alternative:
            notes.append(f"alternative stack: compared with {str(stack_rows[prev_i]['stage']).strip()!r}")
        if i and vs_prev < 1.0:
            notes.append("slower than the rung it builds on")
        if row.get("same_as_stage_1") is False:
            notes.append("greedy output differs from the first rung")
        acc = row.get("spec_acceptance")
        if isinstance(acc, int | float):
            notes.append(f"draft acceptance {acc:.0%}")
        if util_note and i == 0:  # once, on the first rung
            notes.append(util_note)
        rungs.append(LadderRung(
            rung=str(row["stage"]), tok_s=tok_s,
            usd_per_mtok_full=_usd_per_mtok(device_hour_usd, tok_s, 1.0),
            usd_per_mtok_measured=None if util is None else _usd_per_mtok(device_hour_usd, tok_s, util),
            speedup_vs_previous=vs_prev, speedup_vs_first=tok_s / first, note="; ".join(notes)))
    return rungs


def _x(v: float) -> str:
    return f"{v:.2f}×"


def format_ladder(rungs: list[LadderRung], device_hour_usd: float, price_source: str,
                  utilisation: float | None, meta: dict[str, Any], bench: str, machine: Machine | None = None,
                  notes: tuple[str, ...] = ()) -> str:
    measured = utilisation is not None
    head = "| rung | output tok/s | × previous | × first | $/Mtok @ 100% |"
    rule = "| --- | ---: | ---: | ---: | ---: |"
    if measured:
        shown = max(min(utilisation, 1.0), UTILISATION_FLOOR)
        head += f" $/Mtok @ {shown:.0%} measured |"
        rule += " ---: |"
    head += " note |"
    rule += " --- |"
    lines = ["The ladder: optimizations that stack ($ per million output tokens)", ""]
    if machine is not None:
        lines += [f"measured on {machine.name}, priced at ${device_hour_usd:g}/h for it", ""]
    lines += [head, rule]
    for r in rungs:
        cells = [r.rung, f"{r.tok_s:,.1f}", _x(r.speedup_vs_previous), _x(r.speedup_vs_first),
                 f"{r.usd_per_mtok_full:,.3f}"]
        if measured:
            cells.append(f"{r.usd_per_mtok_measured:,.3f}")
        cells.append(r.note)
        lines.append("| " + " | ".join(cells) + " |")
    a = [f"benchmark: {bench}" + (f" ({meta.get('requests')} requests, {meta.get('tokens')} greedy output tokens "
                                  f"each, a {meta.get('system_prompt_tokens')}-token shared system prompt)"
                                  if meta.get("requests") else ""),
         (f"device price ${device_hour_usd:g}/h for the whole engine" + (f" ({machine.name})" if machine else "")
          + f": {price_source}"),
         ("$/Mtok = device_hour_usd / (tok_s × 3600 × utilisation) × 1e6, output tokens only; tok/s is every "
         "output token over the whole workload's wall time (prefill included)")]
    if measured:
        a.append(f"measured utilisation {utilisation:.1%}" + (
            f", floored at {UTILISATION_FLOOR:.0%}" if utilisation < UTILISATION_FLOOR else ""))
    else:
        a.append("measured utilisation unknown: only the 100% column is shown (pass --utilisation)")
    if meta.get("gpu_hour_usd") is not None and abs(float(meta["gpu_hour_usd"]) - device_hour_usd) > 1e-12:
        a.append(f"the benchmark priced its rows at ${float(meta['gpu_hour_usd']):g}/h; this table reprices them")
    a += list(notes)
    lines += ["", "Assumptions:"] + [f"  - {x}" for x in a]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None,
        measured_utilisation: float | None = None) -> int:
    """`switchyard report ladder`. `--utilisation` (args.utilisation) overrides measured_utilisation."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    bench = getattr(args, "bench", None) or DEFAULT_BENCH
    util = getattr(args, "utilisation", None)
    util = measured_utilisation if util is None else float(util)
    try:
        rows = load_stack(bench)
        meta = load_stack_meta(bench)
        machine = bench_machine(bench)
        rp = report_policy(getattr(args, "policy", None), getattr(args, "database_url", None))
        mp = machine_price(machine, rp, getattr(args, "backend", None), getattr(args, "device_hour_usd", None),
                           bench_flag="--bench")
        rungs = ladder_rows(rows, mp.usd_per_hour, util)
    except (LadderError, ReportPolicyError, MachinePriceError) as e:
        print(f"ERROR: {e}", file=err)
        return 1
    notes = (f"prices from {rp.label}",) + ((f"not priced as a GPU: {mp.gpu_note}",) if mp.gpu_note else ())
    if getattr(args, "json", False):
        out.write(json.dumps({"bench": describe(bench), "device_hour_usd": mp.usd_per_hour, "price_source": mp.basis,
                              "machine": machine.as_json(), "pricing_policy": rp.label, "gpu_note": mp.gpu_note,
                              "utilisation": util,
                              "utilisation_used": None if util is None else max(min(util, 1.0), UTILISATION_FLOOR),
                              "rungs": [asdict(r) for r in rungs]}, indent=2) + "\n")
    else:
        out.write(format_ladder(rungs, mp.usd_per_hour, mp.basis, util, meta, describe(bench), machine, notes))
    return 0
