"""bench/ as a harness (issue 33 #5): every benchmark module imports and answers --help as `python -m bench.X`,
none edits sys.path, results are filed as bench/results/<bench>/<machine>.json|md by bench/store.py, and the
machine slug tells the machines the history was measured on apart."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import store
from bench.machine_info import MACHINE_ENV, gpu_slug, machine_slug
from gateway.reports.bench_data import latest_result

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"

# One process for every module (torch imported once): a module with a CLI must exit 0 from --help with a usage
# line, a library module must import. Prints {module: [kind, detail]}.
_RUN_ALL = r"""
import contextlib, importlib.util, io, json, pkgutil, runpy, sys, traceback
import bench
out = {}
for info in pkgutil.walk_packages(bench.__path__, "bench."):
    name = info.name
    if name.endswith(".__main__"):
        continue
    spec = info.module_finder.find_spec(name.rsplit(".", 1)[1])
    source = open(spec.origin).read() if spec.origin and spec.origin.endswith(".py") else ""
    runnable = info.ispkg and importlib.util.find_spec(name + ".__main__") is not None or "__main__" in source
    buf = io.StringIO()
    sys.argv = [name, "--help"]
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            if runnable:
                runpy.run_module(name, run_name="__main__", alter_sys=True)
            else:
                __import__(name)
        out[name] = ["imported" if not runnable else "no exit", ""]
    except SystemExit as e:
        ok = e.code in (0, None) and "usage:" in buf.getvalue()
        out[name] = ["help" if ok else "bad exit", buf.getvalue()[-2000:]]
    except BaseException:
        out[name] = ["error", traceback.format_exc()[-3000:]]
print("RESULT" + json.dumps(out))
"""


def test_every_bench_module_imports_and_answers_help_as_a_module():
    proc = subprocess.run([sys.executable, "-c", _RUN_ALL], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.rsplit("RESULT", 1)[1])
    broken = {name: r for name, r in found.items() if r[0] not in ("help", "imported")}
    assert not broken, "\n\n".join(f"{name}: {kind}\n{detail}" for name, (kind, detail) in broken.items())
    helped = {name for name, r in found.items() if r[0] == "help"}
    # the benchmarks the docs, the Makefile and issue 35 name (a harness that finds nothing must fail)
    assert {"bench.gateway_overhead", "bench.engine_decode", "bench.engine_peers", "bench.cheaper",
            "bench.cheaper_model", "bench.cheaper.peers", "bench.soak", "bench.redis_overhead"} <= helped
    assert {"bench.store", "bench.servers", "bench.roofline", "bench.fixtures", "bench.machine_info"} <= set(found)
    files = {p for p in BENCH.rglob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    assert len(found) >= len(files), sorted(str(p.relative_to(ROOT)) for p in files)


def test_no_benchmark_edits_sys_path():
    offenders = []
    for path in sorted(BENCH.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", "") == "sys":
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders


def test_store_files_runs_by_bench_and_machine(tmp_path, monkeypatch):
    monkeypatch.setenv(MACHINE_ENV, "box-a")
    first = store.save("demo", {"tok_s": 1.0}, markdown="| a |\n", label="before", root=tmp_path)
    second = store.save("demo", {"tok_s": 2.0}, markdown="| b |\n", root=tmp_path)
    assert first == second == tmp_path / "demo" / "box-a.json"
    record = json.loads(first.read_text())
    assert record["bench"] == "demo" and record["machine"] == "box-a"
    assert [r["result"] for r in record["runs"]] == [{"tok_s": 1.0}, {"tok_s": 2.0}]
    for run in record["runs"]:
        assert run["commit"] and run["commit"] != "unknown" and run["date"].endswith("Z")
        assert run["machine"]["slug"] == "box-a" and run["machine"]["cpus"] >= 1
    assert store.latest("demo", root=tmp_path) == {"tok_s": 2.0}
    assert store.latest("demo", label="before", root=tmp_path) == {"tok_s": 1.0}
    assert store.latest("demo", label="nope", root=tmp_path) is None
    md = (tmp_path / "demo" / "box-a.md").read_text()
    assert md.startswith("# demo on box-a\n") and md.index("| b |") < md.index("| a |") and "· before ·" in md

    monkeypatch.setenv(MACHINE_ENV, "box-b")
    store.save("demo", {"tok_s": 3.0}, root=tmp_path)
    assert store.machines("demo", root=tmp_path) == ["box-a", "box-b"]
    assert store.latest("demo", "box-a", root=tmp_path) == {"tok_s": 2.0}
    machine, run = store.newest("demo", root=tmp_path)
    assert machine == "box-b" and run["result"] == {"tok_s": 3.0}
    # --out: one plain file where asked, nothing filed
    plain = store.save("demo", {"tok_s": 4.0}, markdown="x\n", out=tmp_path / "elsewhere" / "run", root=tmp_path)
    assert json.loads(plain.read_text()) == {"tok_s": 4.0} and plain.with_suffix(".md").read_text() == "x\n"
    assert len(json.loads((tmp_path / "demo" / "box-b.json").read_text())["runs"]) == 1
    # a GPU run filed under the device, not the host
    store.save("demo", {"tok_s": 5.0}, machine=gpu_slug("NVIDIA H200"), root=tmp_path)
    assert store.latest("demo", "h200", root=tmp_path) == {"tok_s": 5.0}


def test_gateway_reports_read_a_results_record_as_its_newest_run(tmp_path, monkeypatch):
    monkeypatch.setenv(MACHINE_ENV, "box-a")
    for rate in (1.0, 2.0):
        path = store.save("demo", {"stack": {"rows": [{"stage": "s", "tok_s": rate}]}}, root=tmp_path)
    assert latest_result(json.loads(path.read_text())) == {"stack": {"rows": [{"stage": "s", "tok_s": 2.0}]}}
    one_run = {"meta": {}, "runs": {"fp32": {}}}  # a benchmark's own JSON: passed through
    assert latest_result(one_run) is one_run


@pytest.mark.parametrize(("info", "cpus", "slug"), [
    ({"vendor_id": "AuthenticAMD", "model name": "AMD EPYC", "cpu family": "25", "model": "17"}, 2, "epyc-zen4-2vcpu"),
    ({"vendor_id": "AuthenticAMD", "model name": "AMD EPYC 7B13", "cpu family": "25", "model": "1"}, 4,
     "epyc-zen3-4vcpu"),
    ({"vendor_id": "AuthenticAMD", "model name": "AMD EPYC", "cpu family": "26", "model": "2"}, 2, "epyc-zen5-2vcpu"),
    ({"vendor_id": "AuthenticAMD", "model name": "AMD EPYC 7571", "cpu family": "23", "model": "1"}, 2,
     "epyc-zen1-2vcpu"),
    ({"vendor_id": "GenuineIntel", "model name": "Intel(R) Xeon(R) Processor", "flags": "avx512f amx_tile"}, 2,
     "xeon-spr-2vcpu"),
    ({"vendor_id": "GenuineIntel", "model name": "Intel(R) Xeon(R) Processor", "flags": "avx2"}, 2, "xeon-2vcpu"),
    ({"model name": "Apple M2"}, 8, "apple-m2-8vcpu"),
])
def test_machine_slug_names_the_cpu_generation(info, cpus, slug, monkeypatch):
    monkeypatch.delenv(MACHINE_ENV, raising=False)
    assert machine_slug(info, cpus) == slug


def test_machine_slug_can_be_named(monkeypatch):
    monkeypatch.setenv(MACHINE_ENV, "lab-box-3")
    assert machine_slug({"vendor_id": "AuthenticAMD", "cpu family": "25", "model": "17"}, 2) == "lab-box-3"
    assert gpu_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"


def test_results_are_filed_by_bench_and_machine():
    files = [p for p in (BENCH / "results").rglob("*") if p.is_file()]
    assert files
    for p in files:
        rel = p.relative_to(BENCH / "results")
        assert len(rel.parts) == 2 and p.suffix in (".json", ".md", ".png", ".txt"), rel
    for p in (BENCH / "results").glob("*/*.json"):
        record = json.loads(p.read_text())
        assert record["bench"] == p.parent.name and record["machine"] == p.stem, p
        assert record["runs"], p
        for run in record["runs"]:
            assert {"label", "commit", "date", "machine", "result"} <= set(run), p
        assert [r["date"] for r in record["runs"]] == sorted(r["date"] for r in record["runs"]), p
    for p in (BENCH / "results").glob("*/*.md"):
        assert p.read_text().startswith(f"# {p.parent.name} on {p.stem}\n"), p
