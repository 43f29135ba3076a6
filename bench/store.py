"""Benchmark results filed by benchmark and machine: bench/results/<bench>/<machine>.json and .md.

The JSON holds every run on that machine, oldest first, each stamped where it came from:
    {"bench": ..., "machine": "<slug>", "runs": [{"label", "commit", "date", "machine": {...}, "result": {...}}]}
The .md holds each run's table, newest first under a dated heading. Files beside them (a plot) are
<machine>.<ext>, the latest run's. `--out PATH` on a benchmark bypasses the store (an ad-hoc run, a test).
"""
from __future__ import annotations

import json
import subprocess
from datetime import UTC, datetime
from pathlib import Path

from bench.machine_info import machine as machine_record
from bench.machine_info import machine_slug

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results"


def commit() -> str:
    """The short commit the run measured, '+dirty' when tracked files differ from it ('unknown' outside git)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10,
                              check=False).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head + ("+dirty" if dirty else "")) if head else "unknown"


def stamp(label: str = "") -> dict:
    # UTC, to the millisecond: runs order by this string (two runs filed within one second stay in order)
    date = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return {"label": label, "commit": commit(), "date": date, "machine": machine_record()}


def path(bench: str, machine: str | None = None, suffix: str = ".json", root: Path = RESULTS_DIR) -> Path:
    return root / bench / f"{machine or machine_slug()}{suffix}"


def load(bench: str, machine: str | None = None, root: Path = RESULTS_DIR) -> dict:
    """The benchmark's record on that machine (this one by default); no runs when it never ran there."""
    p = path(bench, machine, root=root)
    if p.exists():
        return json.loads(p.read_text())
    return {"bench": bench, "machine": machine or machine_slug(), "runs": []}


def latest(bench: str, machine: str | None = None, label: str | None = None, root: Path = RESULTS_DIR) -> dict | None:
    """The newest run's result (with that label, when one is given), None when there is none."""
    runs = [r for r in load(bench, machine, root)["runs"] if label is None or r.get("label") == label]
    return runs[-1]["result"] if runs else None


def machines(bench: str, root: Path = RESULTS_DIR) -> list[str]:
    return sorted(p.stem for p in (root / bench).glob("*.json"))


def save(bench: str, result: dict, *, markdown: str | None = None, label: str = "", out: Path | str | None = None,
         machine: str | None = None, root: Path = RESULTS_DIR) -> Path:
    """File one run: appended to <bench>/<machine>.json, its markdown on top of <machine>.md (`machine`: this
    host's slug unless given, e.g. a GPU's). With `out`, write `out`.json (and .md) alone, unstamped: the shape
    the benchmark always wrote. Returns the JSON's path."""
    if out is not None:
        target = Path(out) if str(out).endswith(".json") else Path(f"{out}.json")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(result, indent=2, default=str))
        if markdown is not None:
            target.with_suffix(".md").write_text(markdown)
        return target
    record = load(bench, machine, root=root)
    run = {**stamp(label), "result": result}
    run["machine"]["slug"] = record["machine"]
    record["runs"].append(run)
    target = path(bench, record["machine"], root=root)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2, default=str))
    tmp.replace(target)  # a run interrupted while writing leaves the history whole
    if markdown is not None:
        prepend_markdown(target.with_suffix(".md"), run, markdown)
    return target


def heading(run: dict) -> str:
    label = f" · {run['label']}" if run.get("label") else ""
    return f"## {run['date']}{label} · commit {run['commit']} · {run['machine'].get('cpu_model') or 'CPU not recorded'}"


def prepend_markdown(md: Path, run: dict, markdown: str) -> None:
    """The newest run's tables first; the title line stays on top."""
    title = f"# {md.parent.name} on {md.stem}\n"
    older = md.read_text().removeprefix(title).lstrip("\n") if md.exists() else ""
    md.write_text(f"{title}\n{heading(run)}\n\n{markdown.strip()}\n" + (f"\n{older}" if older else ""))


def artifact(bench: str, suffix: str, root: Path = RESULTS_DIR) -> Path:
    """Where this machine's latest plot (or other file) for the benchmark goes: <bench>/<machine><suffix>."""
    p = path(bench, suffix=suffix, root=root)
    p.parent.mkdir(parents=True, exist_ok=True)
    return p


def newest(bench: str, label: str | None = None, root: Path = RESULTS_DIR) -> tuple[str, dict] | None:
    """(machine, run) of the benchmark's most recent run on any machine (with that label, when given)."""
    found = [(run["date"], m, run) for m in machines(bench, root) for run in load(bench, m, root)["runs"]
             if label is None or run.get("label") == label]
    return max(found, key=lambda t: t[0])[1:] if found else None
