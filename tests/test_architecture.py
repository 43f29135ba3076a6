"""The import rules of docs/architecture.md, checked by walking every module's imports with `ast`.

Lazy imports inside functions count the same as top-level ones: a rule is about what a package may
depend on, not about when the import runs.
"""
from __future__ import annotations

import ast
import functools
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "router", "hosted", "kernels", "openai_wire")
CLI_DISPATCH = {"gateway/cli.py"}  # the one gateway module that may reach hosted/ (`switchyard engine …`)
SERVER_ENTRY = {"gateway/serve.py"}  # the one module that may import gateway.app
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
