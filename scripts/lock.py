"""The hashed dependency locks: regenerate them, check them against pyproject.toml, audit them.

    python3 scripts/lock.py             # re-resolve: rewrite requirements.lock and requirements-nodeps.lock
    python3 scripts/lock.py --check     # offline, fast: were the locks compiled from today's pyproject.toml?
    python3 scripts/lock.py --audit     # pip-audit of the locked set (skips, saying why, when offline)

`requirements.lock` is pip-compile's `--generate-hashes` output for pyproject.toml's dependencies, its
`engine` and `dev` extras and its build requirements (setuptools, so the editable install needs no
unhashed build environment), for this host's Python and platform, resolved through this host's pip
configuration (its find-links hold the CPU build of torch, so `torch==2.13.0` locks to `2.13.0+cpu`).
`requirements-nodeps.lock` holds the packages `make install` adds without their dependencies
(`requirements-nodeps.in` says why each). The tools (pip-tools, pip-audit) live in their own venv,
never in the project's: `--tools-venv` (default `.venv-tools`), installed from `requirements-tools.lock`.

Each lock's header records the requirements it was compiled from (`# input: …` lines, normalised);
`--check` and tests/test_supply_chain.py compare them with what pyproject.toml and requirements-nodeps.in say now.
"""
from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements.lock"
NODEPS_IN = ROOT / "requirements-nodeps.in"
NODEPS_LOCK = ROOT / "requirements-nodeps.lock"
TOOLS_LOCK = ROOT / "requirements-tools.lock"
TOOLS = ("pip-tools==7.7.0", "pip-audit==2.10.1")
EXTRAS = ("engine", "dev")
# Locked beside pyproject's requirements so the installer itself is pinned and hashed too.
INSTALLER = ("pip>=24",)
INPUT_PREFIX = "# input: "
REGENERATE = "python3 scripts/lock.py"


def _normalise(requirement: str) -> str:
    """One spelling per requirement (`Requirement` reorders specifiers and extras, lowercases nothing)."""
    from packaging.requirements import Requirement

    req = Requirement(requirement)
    req.name = re.sub(r"[-_.]+", "-", req.name).lower()
    return str(req)


def project_inputs(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """Every requirement the main lock must cover: dependencies, the engine and dev extras, the build system
    (setuptools: the editable install runs without build isolation) and the installer (pip)."""
    data = tomllib.loads(pyproject.read_text())
    project = data["project"]
    reqs = list(project.get("dependencies", []))
    for extra in EXTRAS:
        reqs += project.get("optional-dependencies", {}).get(extra, [])
    reqs += data.get("build-system", {}).get("requires", [])
    reqs += INSTALLER
    return sorted({_normalise(r) for r in reqs})


def nodeps_inputs(path: Path = NODEPS_IN) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return sorted({_normalise(line) for line in lines if line})


def recorded_inputs(lock: Path) -> list[str]:
    return sorted(line.removeprefix(INPUT_PREFIX).strip() for line in lock.read_text().splitlines()
                  if line.startswith(INPUT_PREFIX))


def locked_pins(lock: Path) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, hashes) of every `name==version --hash=…` entry (continuation lines joined)."""
    text = re.sub(r"\\\n\s*", " ", lock.read_text())
    pins: dict[str, tuple[str, list[str]]] = {}
    for line in text.splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith(("#", "-")):
            continue
        spec, *options = line.split()
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s;]+)", spec)
        if match is None:
            raise ValueError(f"{lock.name}: not an exact pin: {line!r}")
        name = re.sub(r"[-_.]+", "-", match.group(1)).lower()
        pins[name] = (match.group(3), [o.removeprefix("--hash=") for o in options if o.startswith("--hash=")])
    return pins


def check() -> list[str]:
    """Problems that mean a lock is stale (empty when both match their inputs)."""
    problems = []
    tools = sorted(_normalise(t) for t in TOOLS)
    for lock, want in ((LOCK, project_inputs()), (NODEPS_LOCK, nodeps_inputs()), (TOOLS_LOCK, tools)):
        if not lock.exists():
            problems.append(f"{lock.name} is missing")
            continue
        have = recorded_inputs(lock)
        for r in sorted(set(want) - set(have)):
            problems.append(f"{lock.name}: compiled without {r!r}")
        for r in sorted(set(have) - set(want)):
            problems.append(f"{lock.name}: compiled with {r!r}, which its source no longer has")
    return problems


# ---- regenerating (needs the package index)


def ensure_tools(venv: Path) -> Path:
    """The tools venv, created on first use from requirements-tools.lock (hashes required)."""
    bin_dir = venv / "bin"
    if not (bin_dir / "pip-compile").exists() or not (bin_dir / "pip-audit").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        source = ["--require-hashes", "-r", str(TOOLS_LOCK)] if TOOLS_LOCK.exists() else list(TOOLS)
        subprocess.run([str(bin_dir / "pip"), "install", "--quiet", *source], check=True)
    return bin_dir


def _header(inputs: list[str], what: str) -> str:
    lines = [f"# {what}", f"# Regenerate: {REGENERATE}   (README: Installing). Do not edit by hand.",
             (f"# Compiled for Python {sys.version_info.major}.{sys.version_info.minor} on "
              f"{sys.platform} {_machine()}, through this host's pip configuration."),
             "# The requirements it was compiled from (tests/test_supply_chain.py compares them with the source):"]
    return "\n".join(lines + [INPUT_PREFIX + r for r in inputs]) + "\n"


def _machine() -> str:
    import platform

    return platform.machine()


def _pip_compile(bin_dir: Path, inputs: list[str], out: Path, upgrade: bool, label: str) -> str:
    with tempfile.TemporaryDirectory(prefix="sy-lock-") as tmp:
        source = Path(tmp) / "requirements.in"
        source.write_text("\n".join(inputs) + "\n")
        target = Path(tmp) / "out.txt"
        if out.exists() and not upgrade:  # keep earlier pins where they still satisfy the inputs
            target.write_text(out.read_text())
        subprocess.run([str(bin_dir / "pip-compile"), "--quiet", "--generate-hashes", "--allow-unsafe",
                        "--strip-extras", "--no-header", "--no-emit-index-url", "--no-emit-find-links",
                        "--resolver", "backtracking", "-o", str(target), str(source)], check=True, cwd=tmp)
        return target.read_text().replace(str(source), label)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _nodeps_lock(bin_dir: Path, inputs: list[str]) -> str:
    """Each no-deps pin with the hash of the file pip fetches here (`pip download --no-deps`)."""
    out = []
    with tempfile.TemporaryDirectory(prefix="sy-lock-") as tmp:
        for req in inputs:
            dest = Path(tmp) / re.sub(r"\W", "_", req)
            subprocess.run([str(bin_dir / "pip"), "download", "--quiet", "--no-deps", "-d", str(dest), req],
                           check=True)
            hashes = " ".join(f"--hash=sha256:{_sha256(f)}" for f in sorted(dest.iterdir()))
            out.append(f"{req} {hashes}")
    return "\n".join(out) + "\n"


def regenerate(tools_venv: Path, upgrade: bool) -> None:
    bin_dir = ensure_tools(tools_venv)
    inputs = project_inputs()
    body = _pip_compile(bin_dir, inputs, LOCK, upgrade, "pyproject.toml")
    LOCK.write_text(_header(inputs, "Hashed lock of pyproject.toml [engine,dev] + build requirements + pip") + body)
    nodeps = nodeps_inputs()
    NODEPS_LOCK.write_text(_header(nodeps, "Hashed lock of requirements-nodeps.in (installed --no-deps)")
                           + _nodeps_lock(bin_dir, nodeps))
    tools = sorted(_normalise(t) for t in TOOLS)
    TOOLS_LOCK.write_text(_header(tools, "Hashed lock of the tools venv (pip-tools, pip-audit), never the project's")
                          + _pip_compile(bin_dir, tools, TOOLS_LOCK, upgrade, "scripts/lock.py"))
    for lock in (LOCK, NODEPS_LOCK, TOOLS_LOCK):
        print(f"wrote {lock.name}: {len(locked_pins(lock))} pins")


def _reachable(url: str, data: bytes | None = None) -> str | None:
    """None if `url` answers 200, else why not."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(request, timeout=10).close()
    except urllib.error.HTTPError as e:
        return f"{url} answers {e.code}"
    except OSError as e:
        return f"{url} unreachable ({e})"
    return None


def audit_service() -> tuple[str | None, str]:
    """The vulnerability service pip-audit can use from here, or None and why neither can be.

    pip-audit's `pypi` service reads PyPI's per-release JSON (/pypi/NAME/VERSION/json); a registry that
    serves only the per-project JSON answers 404 there, and pip-audit then reports every pin "not found on
    PyPI" and prints "No known vulnerabilities found": a green that audited nothing. So probe first."""
    version = locked_pins(LOCK)["pip"][0]
    pypi = _reachable(f"https://pypi.org/pypi/pip/{version}/json")
    if pypi is None:
        return "pypi", ""
    osv = _reachable("https://api.osv.dev/v1/query", b'{"package": {"name": "pip", "ecosystem": "PyPI"}}')
    if osv is None:
        return "osv", ""
    return None, f"{pypi}; {osv}"


def audit(tools_venv: Path) -> int:
    """pip-audit of the locks; 0 with a SKIPPED line when no vulnerability service can be reached."""
    service, why = audit_service()
    if service is None:
        print(f"SKIPPED: pip-audit cannot query a vulnerability service from here: {why}. "
              f"Run `{REGENERATE} --audit` on a machine that reaches pypi.org's per-release JSON or api.osv.dev.")
        return 0
    bin_dir = ensure_tools(tools_venv)
    code = 0
    for lock in (LOCK, NODEPS_LOCK):
        # --no-deps: every pin is already in the lock; --disable-pip: audit the pins, install nothing.
        done = subprocess.run([str(bin_dir / "pip-audit"), "--progress-spinner", "off", "--no-deps",
                               "--disable-pip", "--vulnerability-service", service, "-r", str(lock),
                               *_ignored_args()], check=False)
        code = code or done.returncode
    return code


# Advisories reviewed and accepted, each with why (docs/threat-model.md, "Supply chain").
IGNORED_VULNS: dict[str, str] = {}


def _ignored_args() -> list[str]:
    return [arg for vuln in IGNORED_VULNS for arg in ("--ignore-vuln", vuln)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="compare the locks' inputs with their sources")
    mode.add_argument("--audit", action="store_true", help="pip-audit the locked set")
    parser.add_argument("--upgrade", action="store_true", help="re-resolve every pin to its newest release")
    parser.add_argument("--tools-venv", type=Path, default=ROOT / ".venv-tools")
    args = parser.parse_args(argv)
    if args.check:
        problems = check()
        for p in problems:
            print(p)
        if problems:
            print(f"the locks are stale: run `{REGENERATE}`")
            return 1
        print("locks match pyproject.toml and requirements-nodeps.in")
        return 0
    if args.audit:
        return audit(args.tools_venv)
    regenerate(args.tools_venv, args.upgrade)
    return 0


if __name__ == "__main__":
    sys.exit(main())
