"""The gateway's commands run where torch cannot be imported (a gateway-only install): building the `switchyard`
parser imports nothing of hosted/, and `switchyard engine …` still gets hosted's full parser."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, *args: str, code: str | None = None) -> subprocess.CompletedProcess:
    """`python -m gateway.cli ARGS` (or `python -c CODE`) with a `torch` package first on the path that refuses
    to import, the way a missing torch fails."""
    blocked = tmp_path / "blocked" / "torch"
    blocked.mkdir(parents=True, exist_ok=True)
    (blocked / "__init__.py").write_text('raise ImportError("torch is not installed (blocked by the test)")\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocked.parent), str(ROOT)])}
    argv = ["-c", code] if code is not None else ["-m", "gateway.cli", *args]
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=120, check=False)


def test_keys_help_and_policy_check_run_without_torch(tmp_path):
    help_ = _run(tmp_path, "keys", "--help")
    assert help_.returncode == 0, help_.stderr
    assert "revoke" in help_.stdout and "Traceback" not in help_.stderr
    check = _run(tmp_path, "policy", "check", str(ROOT / "policies" / "default.yaml"))
    assert check.returncode == 0, check.stderr
    assert check.stdout.startswith("OK:")


def test_building_the_parser_imports_neither_torch_nor_hosted(tmp_path):
    code = ("import sys\n"
            "from gateway.cli import build_parser\n"
            "for argv in (['keys', 'list'], ['policy', 'check', 'x.yaml'], ['serve'], ['report', 'ladder'], []):\n"
            "    build_parser(argv)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'hosted')))\n")
    done = _run(tmp_path, code=code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_engine_group_is_still_whole_when_it_is_the_command():
    from gateway.cli import build_parser

    args = build_parser(["engine", "distill", "--teacher", "t", "--out", "o"]).parse_args(
        ["engine", "distill", "--teacher", "t", "--out", "o", "--divergence", "jsd"])
    assert (args.command, args.engine_command, args.divergence) == ("engine", "distill", "jsd")
    listed = subprocess.run([sys.executable, "-m", "gateway.cli", "--help"], capture_output=True, text=True,
                            cwd=ROOT, timeout=120, check=True)
    assert "engine" in listed.stdout and "the in-house inference engine" in listed.stdout
