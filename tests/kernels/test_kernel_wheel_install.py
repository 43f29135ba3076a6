"""The native CPU kernels from an installed wheel: the project is built into a wheel (`pip wheel
--no-build-isolation`, from a copy of the tree so the checkout gets no build/ of its own), the wheel installed into
a fresh virtualenv, and a process of that virtualenv, started away from the checkout, must compile the kernels
from the installed package's sources and headers and select them over the torch reference. A wheel without the
headers (package data `*.c` but not `*.h`) fails here: the compile fails and the engine falls back silently."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from tests.kernels.native_setup import needs_compiler

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gateway", "router", "hosted", "kernels", "openai_wire")  # pyproject's packages.find include
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")

CHECK = r"""
import json, sys
import torch
import kernels
from kernels import cpu_native, ops, reference

lib = cpu_native.library()
x, w = torch.randn(3, 64), torch.rand(64) + 0.5
native = cpu_native.rms_norm(x, w, 1e-6)
packed = ops.prepack_linear(torch.randn(96, 64))
print(json.dumps({
    "package": kernels.__file__,
    "sources": [str(p) for p in (*cpu_native.SOURCES, *cpu_native.HEADERS)],
    "library": getattr(lib, "_name", None),
    "why": cpu_native.unavailable_reason(),
    "backend": ops.select("cpu").name,
    "native_active": ops.native_cpu_active(x),
    "rms_norm_native": native is not None and torch.allclose(native, reference.rms_norm(x, w, 1e-6), atol=1e-5),
    "panels": isinstance(packed, cpu_native.PackedLinear) and packed.panels is not None,
}))
"""


def _copy_tree(dest: Path) -> None:
    """What a wheel is built from (hard links where the file system allows, else copies)."""
    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        link(str(ROOT / name), str(dest / name))
    for package in PACKAGES:
        shutil.copytree(ROOT / package, dest / package, ignore=_IGNORE, copy_function=link)


def _run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(args, check=False, capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@needs_compiler
def test_wheel_install_compiles_and_selects_the_native_kernels(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "SWITCHYARD_CPU_NATIVE", "SWITCHYARD_KERNELS", "SWITCHYARD_CPU_MARCH")}
    env.update(SWITCHYARD_CACHE_DIR=str(tmp_path / "cache"), PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    _copy_tree(tmp_path / "src")
    _run([sys.executable, "-m", "pip", "wheel", str(tmp_path / "src"), "--no-deps", "--no-build-isolation",
          "--no-index", "-w", str(tmp_path / "dist")], cwd=tmp_path, env=env, timeout=300)
    wheel = next((tmp_path / "dist").glob("switchyard-*.whl"))
    shipped = {Path(n).name for n in zipfile.ZipFile(wheel).namelist() if n.startswith("kernels/")}
    needed = {p.name for p in (ROOT / "kernels").iterdir() if p.suffix in (".c", ".h")}
    assert needed <= shipped, f"the wheel lacks {sorted(needed - shipped)}"

    # A fresh virtualenv seeing the project venv's packages (torch...) after its own: the project venv has no
    # system site packages to inherit, so a .pth names its site-packages (its own .pth files, the editable
    # install of the checkout among them, are not read from there).
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], timeout=120)
    python = venv / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=tmp_path, env=env).stdout.strip())
    (site / "project-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "--no-compile",
          str(wheel)], cwd=tmp_path, env=env, timeout=300)

    done = _run([str(python), "-c", CHECK], cwd=tmp_path, env=env, timeout=600)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(found["package"]).is_relative_to(site), f"kernels imported from {found['package']}, not the wheel"
    assert all(Path(p).is_relative_to(site) for p in found["sources"])
    assert found["why"] is None, f"the native kernels did not build from the installed package: {found['why']}"
    assert Path(found["library"]).is_relative_to(tmp_path / "cache")
    assert found["backend"] == "cpu" and found["native_active"]
    assert found["rms_norm_native"] and found["panels"]
