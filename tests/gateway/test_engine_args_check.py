"""A policy's `engine_args` are checked against `switchyard engine serve`'s own argument parser (one definition:
hosted/engine_args.py), by `policy check` and at every load (start and hot reload), as file:line:col errors with
"did you mean"; what passes is an argument line the engine's parser accepts."""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gateway import engine_args
from gateway.policy import PolicyError, parse_policy
from gateway.policy_store import PolicyStore
from hosted.engine_args import serve_parser

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway.cli", *args], capture_output=True, text=True,
                          timeout=timeout, check=False)

POLICY = """\
backends:
  local:
    kind: engine
    launch: embedded
    model: demo
    engine_args: {args}
routes:
  demo:
    backend: local
"""


def _problems(args: str) -> list[str]:
    with pytest.raises(PolicyError) as caught:
        parse_policy(POLICY.format(args=args), "p.yaml")
    return [str(issue) for issue in caught.value.issues]


def test_the_readme_example_is_refused_with_its_place_and_the_flag_meant():
    """policies/README.md's example, `{max-batch-size: 64}`, used to pass: the engine then exited 2 at every start."""
    [problem] = _problems("{max-batch-size: 64}")
    assert problem.startswith("p.yaml:6:19: backends.local.engine_args.max-batch-size:"), problem
    assert "--max-batch-size is not an option of `switchyard engine serve`" in problem
    assert "did you mean --max-num-seqs" in problem


def test_a_misspelt_flag_gets_the_closest_real_ones():
    [problem] = _problems("\n      threads: 1\n      max_num_seq: 8")
    assert "p.yaml:8:7:" in problem and "did you mean --max-num-seqs" in problem


@pytest.mark.parametrize(("args", "said"), [
    ("{max-num-seqs: lots}", "invalid int value: 'lots'"),
    ("{kv-cache-gb: half}", "invalid float value: 'half'"),
    ("{max-num-seqs: 8.5}", "invalid int value: '8.5'"),
    ("{dtype: float64}", "invalid choice: 'float64' (choose from float32, bfloat16, float16)"),
    ("{quantization-group-size: 48}", "invalid choice: '48' (choose from 32, 64, 128)"),
    ("{no-prefix-caching: 1}", "is a switch: write true or false"),
    ("{threads: true}", "needs a value"),
])
def test_a_bad_value_is_refused_as_the_engine_parser_would(args, said):
    [problem] = _problems(args)
    assert said in problem and problem.startswith("p.yaml:6:"), problem


@pytest.mark.parametrize(("flag", "instead"), [("port", "engine_port"), ("model", "engine_model_path"),
                                               ("served-model-name", "`model:`"), ("host", "127.0.0.1")])
def test_flags_the_gateway_sets_itself_are_refused(flag, instead):
    [problem] = _problems(f"{{{flag}: x}}")
    assert f"--{flag} is set by the gateway" in problem and instead in problem


def test_good_args_become_an_argument_line_the_engine_parser_accepts():
    policy = parse_policy(POLICY.format(args="{threads: 1, max_num_seqs: 8, kv-cache-gb: 0.5, dtype: bfloat16, "
                                             "no-prefix-caching: true, quantize-head: false, speculative: ngram}"),
                          "p.yaml")
    argv = engine_args.argv(policy.backends["local"].engine_args)
    parsed = serve_parser().parse_args(["--model", "m", *argv])
    assert (parsed.threads, parsed.max_num_seqs, parsed.kv_cache_gb, parsed.dtype) == (1, 8, 0.5, "bfloat16")
    assert (parsed.no_prefix_caching, parsed.quantize_head, parsed.speculative) == (True, False, "ngram")
    # a switch set to false is left out (the engine's default), never passed as a value
    argv = engine_args.argv({"no-prefix-caching": False, "threads": 2})
    assert argv == ["--threads", "2"]


def test_every_option_of_the_engine_parser_is_accepted_no_second_list():
    """Walk the real parser: each option the gateway does not set passes the check with a value the parser takes."""
    checked = 0
    for action in serve_parser()._actions:
        long = [o for o in action.option_strings if o.startswith("--") and not o.startswith("--no-")] or \
            [o for o in action.option_strings if o.startswith("--")]
        if not long or isinstance(action, argparse._HelpAction):
            continue
        name = long[0][2:]
        if name in engine_args.GATEWAY_SET:
            assert engine_args.check({name: "x"})[0].problem.endswith("is set by the gateway")
            continue
        value = True if action.nargs == 0 else (action.choices[0] if action.choices else
                                                 (action.default if action.default is not None else "7"))
        assert engine_args.check({name: value}) == [], name
        serve_parser().parse_args(["--model", "m", *engine_args.argv({name: value})])
        checked += 1
    assert checked >= 18


@pytest.mark.parametrize(("theirs", "ours"), [("max-batch-size", "--max-num-seqs"), ("ctx-size", "--max-model-len"),
                                           ("max-concurrent-requests", "--max-waiting")])
def test_another_servers_name_gets_ours_from_the_engine_help(theirs, ours):
    """The engine's --help names other servers' flags beside ours; the check's "did you mean" reads it there."""
    [problem] = engine_args.check({theirs: 1})
    assert problem.fix.startswith(f"did you mean {ours}"), problem.fix


async def test_a_hot_reload_with_bad_engine_args_is_refused_and_the_old_policy_serves(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(POLICY.format(args="{threads: 1}"))
    store = PolicyStore(path, settle_s=0)
    first = await store.start()
    try:
        path.write_text(POLICY.format(args="{threads: 1, max-batch-size: 64}"))
        assert await store.check_now() is False
        assert store.current is first
        error = store.status()["last_reload_error"]
        assert "p.yaml:6:" in error["message"] and "did you mean --max-num-seqs" in error["message"]
    finally:
        await store.stop()


def test_policy_check_cli_names_the_place_and_the_fix(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(POLICY.format(args="{max-batch-size: 64}"))
    result = run_cli("policy", "check", str(bad), timeout=60)
    assert result.returncode == 1
    assert re.search(rf"{re.escape(str(bad))}:6:19: .*did you mean --max-num-seqs", result.stderr), result.stderr


def test_policy_check_of_a_missing_file_does_not_suggest_a_flag_it_lacks(tmp_path):
    missing = tmp_path / "nope.yaml"
    result = run_cli("policy", "check", str(missing), timeout=60)
    assert result.returncode == 1
    assert "--policy" not in result.stderr, result.stderr
    assert str(missing) in result.stderr and "no such file" in result.stderr.lower()
    assert "relative paths are read from" in result.stderr  # the fix: where a relative path is looked for


def test_checking_engine_args_imports_no_torch(tmp_path):
    """The check reads the engine's parser definition only: no torch (a gateway-only install has none)."""
    code = ("import sys\nfrom gateway.policy import parse_policy\n"
            f"parse_policy({POLICY.format(args='{threads: 1}')!r}, 'p.yaml')\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_readme_example_now_passes_the_check():
    row = next(line for line in (ROOT / "policies" / "README.md").read_text().splitlines()
               if line.startswith("| `engine_args` |"))
    example = re.search(r"e\.g\. `(\{[^`]*\})`", row).group(1)
    import yaml

    assert engine_args.check(yaml.safe_load(example)) == []
