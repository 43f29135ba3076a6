"""The import rules of docs/architecture.md, checked by walking every module's imports with `ast`.

Lazy imports inside functions count the same as top-level ones: a rule is about what a package may
depend on, not about when the import runs.
"""
from __future__ import annotations

import ast
import functools
import itertools
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "router", "hosted", "kernels", "openai_wire")
CLI_DISPATCH = {"gateway/cli.py"}  # the one gateway module that may reach hosted/ (`switchyard engine …`)
SERVER_ENTRY = {"gateway/serve.py"}  # the one module that may import gateway.app
# The kernels modules the engine may import, and what for. Everything else in kernels/ (the Triton kernels,
# compile_check) is reached only through the backend `ops.select(device)` picks. docs/architecture.md lists the same.
HOSTED_KERNELS = {
    "ops": "the backend a model runner chose (`ops.select`, `Kernels`), through which the layers compute",
    "reference": "torch references used outside a forward: int8 quantization at load, the student's rotary tables",
    "cpu_native": "`PackedLinear`: fp32 weights packed once per layer at load",
    "cpu_lowp": "`LowpStrips`: bf16 / int8 / int4 weights packed once per layer; the CPU features precision reads",
    "cpu_decode": "`DecodeStep` and its per-layer weights: a decode step's layer loop in one native call",
    "huge_pages": "packed weights and the KV pool placed on 2 MiB pages",
    "switches": "the process's kernel switches, set from EngineConfig at start (environment overrides read once)",
}
# Inside the gateway the request path runs one way: app -> proxy -> routing / shadow -> backends / ledger.
# A module may import its own layer and those below it, never one above (type-only imports included).
GATEWAY_LAYERS = {"gateway.proxy": 3, "gateway.routing": 2, "gateway.shadow": 2,
                  "gateway.backends": 1, "gateway.ledger": 1}
# The reports read the ledger (CLI and dashboard alike): none of the serving machinery, nor the page.
SERVING = ("gateway.app", "gateway.proxy", "gateway.routing", "gateway.shadow", "gateway.backends",
           "gateway.backend_pool", "gateway.embedded", "gateway.dashboard")


def _layer(module: str) -> int | None:
    for prefix, layer in GATEWAY_LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return None


# Parsed in a fresh interpreter: CPython 3.11.7's AST recursion-depth bookkeeping can be left wrong by code that
# ran earlier in this process (seen after the litellm-as-a-client test), and every later ast.parse then raises
# "SystemError: AST constructor recursion depth mismatch".
_PARSE_ALL = """
import ast, pickle, sys
paths = sys.argv[1:]
trees = {p: ast.parse(open(p, encoding="utf-8").read(), filename=p) for p in paths}
sys.stdout.buffer.write(pickle.dumps(trees))
"""


@functools.cache
def _trees(root: Path) -> dict[str, ast.Module]:
    """Every module under `root` (ROOT, or a test's own tree), parsed in one fresh interpreter."""
    paths = [str(p) for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))]
    done = subprocess.run([sys.executable, "-c", _PARSE_ALL, *paths], capture_output=True, check=True)
    return pickle.loads(done.stdout)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) for every import in the file, relative imports resolved."""
    tree = _trees(ROOT)[str(path)]
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            # `from gateway import app` imports the module gateway.app
            found.extend((node.lineno, f"{module}.{alias.name}") for alias in node.names)
    return found


def _modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _top(module: str) -> str:
    return module.split(".")[0]


def _violations() -> list[str]:
    problems = []
    for path in _modules():
        rel = path.relative_to(ROOT).as_posix()
        own = rel.split("/")[0]
        own_layer = _layer(".".join(path.relative_to(ROOT).with_suffix("").parts))
        reported: set[int] = set()
        for line, module in _imports(path):
            if line in reported:
                continue
            top = _top(module)
            why = None
            if own == "router" and top in ("gateway", "hosted", "kernels"):
                why = "router/ imports nothing from gateway/, hosted/ or kernels/"
            elif own in ("hosted", "kernels") and top in ("gateway", "router"):
                why = f"{own}/ imports nothing from gateway/ or router/"
            elif own == "hosted" and top == "kernels" and module != "kernels" \
                    and module.split(".")[1] not in HOSTED_KERNELS:
                why = (f"hosted/ imports only these kernels modules: {', '.join(HOSTED_KERNELS)} "
                       "(the others are reached through kernels.ops)")
            elif own == "kernels" and top == "hosted":
                why = "kernels/ sit below hosted/ and never import it"
            elif own == "openai_wire" and top in ("gateway", "router", "hosted", "kernels"):
                why = "openai_wire/ is shared by both servers and imports neither"
            elif own == "gateway" and top in ("hosted", "kernels") and rel not in CLI_DISPATCH:
                why = "the gateway reaches hosted/ only over HTTP (only gateway/cli.py dispatches `engine …`)"
            elif own == "gateway" and top in ("torch", "triton"):
                why = "the gateway never imports torch (a gateway replica installs without the engine)"
            elif (module == "gateway.app" or module.startswith("gateway.app.")) and rel not in SERVER_ENTRY:
                why = "only the server entry point (gateway/serve.py) imports gateway.app"
            elif rel.startswith("gateway/reports/") and any(module == m or module.startswith(m + ".")
                                                             for m in SERVING):
                why = "gateway/reports/ reads the ledger and never imports the serving path or the dashboard"
            elif own_layer is not None and (_layer(module) or 0) > own_layer:
                why = "the gateway's request path runs app -> proxy -> routing / shadow -> backends / ledger"
            if why:
                reported.add(line)
                problems.append(f"{rel}:{line}: import {module}: {why}")
    return problems


def test_imports_run_downhill() -> None:
    problems = _violations()
    assert not problems, "import rules broken (docs/architecture.md):\n" + "\n".join(problems)


def test_the_checker_sees_relative_and_lazy_imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The walk must catch the forms an upward import can take, or the rule above proves nothing."""
    root = tmp_path
    (root / "router").mkdir()
    (root / "router" / "bad.py").write_text(
        "def f():\n    from gateway import db\n    import hosted.engine\n", encoding="utf-8")
    (root / "gateway").mkdir()
    (root / "gateway" / "rel.py").write_text("from .app import create_app\n", encoding="utf-8")
    (root / "gateway" / "backends").mkdir()
    (root / "gateway" / "backends" / "up.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gateway.routing import Decision\n",
        encoding="utf-8")
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", root)
    problems = _violations()
    assert any("router/bad.py:2: import gateway" in p for p in problems)
    assert any("router/bad.py:3: import hosted.engine" in p for p in problems)
    assert any("gateway/rel.py:1: import gateway.app" in p for p in problems)
    assert any("gateway/backends/up.py:3: import gateway.routing" in p for p in problems)


def test_hosted_kernels_allow_list_is_current_and_documented(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Every module the allow-list names exists and is used, docs/architecture.md names the same ones, and a
    kernels module off the list is refused, however it is imported."""
    used = {module.split(".")[1] for path in _modules() if path.relative_to(ROOT).parts[0] == "hosted"
            for _, module in _imports(path) if _top(module) == "kernels" and module != "kernels"}
    assert used <= set(HOSTED_KERNELS) and set(HOSTED_KERNELS) <= used, "allow-list and hosted/'s imports differ"
    assert all((ROOT / "kernels" / f"{name}.py").is_file() for name in HOSTED_KERNELS)
    rules = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8").split("## Who may import whom")[1]
    row = next(line for line in rules.splitlines() if line.startswith("| `hosted/` |"))
    may_import = row.split("|")[2]
    assert set(re.findall(r"`kernels\.(\w+)`", may_import)) == set(HOSTED_KERNELS), row
    (tmp_path / "hosted").mkdir()
    (tmp_path / "hosted" / "bad.py").write_text(
        "from kernels import ops\nfrom kernels import triton_attention\ndef f():\n    import kernels.triton_ops\n", encoding="utf-8")
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", tmp_path)
    problems = _violations()
    assert any("hosted/bad.py:2: import kernels.triton_attention: hosted/ imports only" in p for p in problems)
    assert any("hosted/bad.py:4: import kernels.triton_ops" in p for p in problems)
    assert not any(p.startswith("hosted/bad.py:1:") for p in problems)


# ---- no import circles -------------------------------------------------------------------------------------


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph(root: Path) -> dict[str, dict[str, int]]:
    """module -> {imported Switchyard module: first line}, lazy and TYPE_CHECKING imports included.

    `from a.b import c` counts as importing the module a.b.c when that is a file, else a.b (its __init__)."""
    paths = {_module_name(p, root): p for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    for name, path in paths.items():
        edges: dict[str, int] = {}
        is_package = path.name == "__init__.py"
        for node in ast.walk(_trees(root)[str(path)]):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                package = name.split(".") if is_package else name.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
                module = ".".join(p for p in (base, node.module or "") if p)
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in paths else module for a in node.names]
            for target in targets:
                if target in paths and target != name:
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def _strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's components of more than one module (an import circle each), iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def _file(module: str, root: Path) -> str:
    path = root / module.replace(".", "/")
    return (path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).relative_to(root).as_posix()


def _circles(root: Path) -> list[str]:
    """One line per circle: its files, then one loop through them with the line of each import."""
    graph = _graph(root)
    lines = []
    for component in _strongly_connected(graph):
        members = set(component)
        # the shortest loop back to the first module: breadth-first inside the component, which always closes
        start = component[0]
        came_from: dict[str, str] = {}
        frontier = [start]
        while start not in came_from:
            reached = []
            for node in frontier:
                for nxt in sorted(graph[node]):
                    if nxt in members and nxt not in came_from:
                        came_from[nxt] = node
                        reached.append(nxt)
            frontier = reached
        loop = [start]
        while len(loop) == 1 or loop[-1] != start:
            loop.append(came_from[loop[-1]])
        loop.reverse()
        steps = "; ".join(f"{_file(a, root)}:{graph[a][b]} imports {_file(b, root)}"
                          for a, b in itertools.pairwise(loop))
        lines.append(f"{', '.join(_file(m, root) for m in component)} ({steps})")
    return lines


def test_no_import_circles() -> None:
    circles = _circles(ROOT)
    assert not circles, "import circles (lazy and TYPE_CHECKING imports count):\n" + "\n".join(circles)


def test_the_circle_finder_sees_lazy_type_only_and_relative_imports(tmp_path: Path) -> None:
    """A circle closed by an in-function import, a `TYPE_CHECKING` import or a relative one is reported with
    its files and the line of each import; a chain that runs one way is not."""
    for package, files in {
        "hosted": {"a.py": "def f():\n    from hosted import b\n",
                   "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hosted.a import X\n"},
        "router": {"x.py": "from .y import z\n", "y.py": "import os\n\nfrom . import x\n"},
        "gateway": {"p.py": "from gateway.q import r\n", "q.py": "import gateway\n", "__init__.py": ""},
    }.items():
        (tmp_path / package).mkdir()
        for name, text in files.items():
            (tmp_path / package / name).write_text(text, encoding="utf-8")
    assert _circles(tmp_path) == [
        "hosted/a.py, hosted/b.py (hosted/a.py:2 imports hosted/b.py; hosted/b.py:3 imports hosted/a.py)",
        "router/x.py, router/y.py (router/x.py:1 imports router/y.py; router/y.py:3 imports router/x.py)",
    ]
