"""Gateway overhead before and after: bench/gateway_overhead.py on a base commit and on this checkout, alternated.

The base commit runs from a detached git worktree with this checkout's venv (its packages are the same; the
worktree's own `gateway` package comes first on the path). Rounds alternate base, head, base, head… so a
slow spell of a shared machine hits both sides; each run also measures the stand-in direct, so overheads
are differences taken inside one run.

    .venv/bin/python -m bench.overhead_before_after [--base 7454a84] [--rounds 2] [--quick]

Prints a table and files the run in bench/results/overhead_before_after/<machine>.json (bench/store.py).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import store

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ("gateway, engine backend", "gateway, engine backend, difficulty router on", "gateway, litellm backend")


def worktree(base: str) -> Path:
    sha = subprocess.run(["git", "rev-parse", "--short", base], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    path = Path(tempfile.gettempdir()) / f"switchyard-base-{sha}"
    if not (path / "bench" / "gateway_overhead.py").exists():  # the benchmark's file in either layout
        subprocess.run(["git", "worktree", "add", "--quiet", "--detach", str(path), sha], cwd=ROOT, check=True)
    return path


def run_once(tree: Path, out: Path, quick: bool) -> dict:
    # A tree with bench/ as a package runs it as a module; an older one ran the file (which edited sys.path).
    entry = ["-m", "bench.gateway_overhead"] if (tree / "bench" / "__init__.py").exists() \
        else [str(tree / "bench" / "gateway_overhead.py")]
    cmd = [sys.executable, *entry, "--skip-litellm-proxy", "--out", str(out)]
    subprocess.run(cmd + (["--quick"] if quick else []), cwd=tree, check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, "PYTHONPATH": str(tree)})
    return json.loads(out.read_text())["results"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="7454a84", help="the commit to compare against")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="write this JSON file instead of filing the run")
    parser.add_argument("--label", default="", help="a name for this run in the results history")
    args = parser.parse_args()
    trees = {"before": worktree(args.base), "after": ROOT}
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="sy-ba-") as tmp:
        for i in range(args.rounds):
            for side, tree in trees.items():
                print(f"round {i + 1}/{args.rounds}: {side} ({tree})", flush=True)
                runs[side].append(run_once(tree, Path(tmp) / f"{side}{i}.json", args.quick))

    def med(side: str, target: str, key: str) -> float:
        return statistics.median(r[target][key] for r in runs[side])

    table = {}
    print("\n| target | overhead p50 ms before → after | overhead p99 ms before → after | peak RPS before → after "
          "(after / before) |")
    print("|---|---:|---:|---:|")
    for target in TARGETS:
        row = {f"{k}_{side}": med(side, target, k) for side in runs
               for k in ("overhead_p50_ms", "overhead_p99_ms", "peak_rps")}
        table[target] = row
        print(f"| {target} | {row['overhead_p50_ms_before']:.2f} → {row['overhead_p50_ms_after']:.2f} | "
              f"{row['overhead_p99_ms_before']:.2f} → {row['overhead_p99_ms_after']:.2f} | "
              f"{row['peak_rps_before']:.0f} → {row['peak_rps_after']:.0f} "
              f"({row['peak_rps_after'] / row['peak_rps_before']:.2f}×) |")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=False)
    saved = store.save("overhead_before_after", {"base": args.base, "head": head.stdout.strip(), "rounds": args.rounds,
                                                 "quick": args.quick, "medians": table, "runs": runs},
                       label=args.label or ("quick" if args.quick else ""), out=args.out)
    print(f"\nsaved {saved} (medians of {args.rounds} alternated rounds; 'after' is the working tree)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
