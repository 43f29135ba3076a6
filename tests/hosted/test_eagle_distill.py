"""`switchyard engine distill --method eagle`: the captured features are the engine's own layer streams, a run
interrupted by a real SIGINT resumes to exactly the weights of an uninterrupted one, the exported draft serves
with greedy output unchanged, and the command line dispatches --method eagle (the default stays the draft)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hosted.distill.eagle_data import load_shard
from hosted.distill.eagle_run import distill_eagle
from hosted.distill.run import DistillSettings
from hosted.engine import EngineConfig, LLMEngine, SamplingParams
from tests.hosted.serving_helpers import build_tiny_chat_model

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [f"Tell me about item number {i} in the list, briefly." for i in range(40)]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("teacher") / "teacher", seed=5)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def _settings(teacher: Path, prompts: Path, out: Path, **kw) -> DistillSettings:
    base = {"teacher": str(teacher), "out": str(out), "head_vocab": 96, "prompts": str(prompts), "tokens": 150,
            "max_new_tokens": 10, "epochs": 2.0, "batch_size": 4, "lr": 3e-3, "bf16": False,
            "checkpoint_every": 1, "held_out_percent": 15, "eval_prompts": 3, "eval_tokens": 8, "shard_prompts": 8,
            "progress": False}
    base.update(kw)
    return DistillSettings(**base)


_CHILD = """
import sys, time
import hosted.distill.eagle_train as eagle_train
from hosted.distill.eagle_run import distill_eagle
from hosted.distill.run import DistillSettings
save = eagle_train._save
def slow_save(*args):  # slow steps down so that the signal surely lands mid-run
    save(*args)
    time.sleep(0.3)
eagle_train._save = slow_save
settings = DistillSettings(**__import__("json").loads(sys.argv[1]))
sys.exit(0 if distill_eagle(settings, log=lambda m: print(m, flush=True)) is not None else 130)
"""


def test_interrupted_eagle_run_resumes_to_the_uninterrupted_result(teacher_dir, prompts_file, tmp_path):
    torch.set_num_threads(1)
    straight = distill_eagle(_settings(teacher_dir, prompts_file, tmp_path / "a" / "draft"), log=lambda m: None)
    assert straight is not None and straight["steps"] >= 6
    assert straight["acceptance"]["verifications"] > 0

    settings = _settings(teacher_dir, prompts_file, tmp_path / "b" / "draft")
    payload = json.dumps({k: getattr(settings, k) for k in settings.__slots__})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    child = [sys.executable, "-c", "import torch; torch.set_num_threads(1)\n" + _CHILD, payload]
    proc = subprocess.Popen(child, cwd=str(ROOT), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    ckpt = settings.work_path() / "eagle-checkpoint.pt"
    deadline = time.monotonic() + 180
    while not ckpt.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=180)
    assert proc.returncode == 130, output
    stopped_at = torch.load(ckpt, weights_only=False)["step"]
    assert 1 <= stopped_at < straight["steps"], output
    assert not Path(settings.out).exists()

    resumed = distill_eagle(settings, log=lambda m: None)
    assert resumed is not None and resumed["steps"] == straight["steps"]
    a = load_file(str(tmp_path / "a" / "draft" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "draft" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert resumed["acceptance"] == straight["acceptance"]
    assert "Acceptance" in (tmp_path / "b" / "draft" / "README.md").read_text()

    # The captured features are the engine's streams: the last feature layer's row at the last prompt position,
    # through the teacher's final norm and head, gives the teacher's first output token.
    example = load_shard(settings.work_path() / "eagle" / "shard-00000.pt")[0]
    engine = LLMEngine(EngineConfig(model_dir=str(teacher_dir), speculative="eagle", draft_model_dir=settings.out))
    draft = engine.spec.draft.draft
    last = example.feats[example.prompt_len - 1, -draft.shape.hidden_size:].float()
    full = torch.full((draft.shape.vocab_size,), float("-inf"))
    full[draft.vocab_ids] = draft.logits(last[None])[0]
    first = example.tokens[example.prompt_len].item()
    if first in draft.vocab_ids.tolist():
        assert int(full.argmax()) == first

    # Served as --speculative eagle, greedy output is the teacher's own.
    prompts = [example.tokens[:example.prompt_len].tolist()]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    plain = LLMEngine(EngineConfig(model_dir=str(teacher_dir))).generate(prompts, params)
    assert engine.generate(prompts, params) == plain

    with pytest.raises(ValueError, match="other settings"):
        distill_eagle(_settings(teacher_dir, prompts_file, tmp_path / "b" / "draft", lr=1e-2), log=lambda m: None)


def test_cli_dispatches_the_eagle_method(tmp_path):
    import argparse

    from hosted.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["engine", "distill", "--teacher", "x", "--out", str(tmp_path / "o")])
    assert args.method == "draft"
    args = parser.parse_args(["engine", "distill", "--method", "eagle", "--teacher", "x", "--out", "o",
                              "--shard-prompts", "8"])
    assert args.method == "eagle" and args.shard_prompts == 8


def _random_draft(seed: int = 0):
    from hosted.spec.eagle_model import EagleDraft, EagleShape
    from kernels.reference import rotary_cos_sin

    torch.manual_seed(seed)
    shape = EagleShape(vocab_size=50, hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=2,
                       head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                       max_position_embeddings=64, feature_layers=[0, 1, 2], head_vocab=50)
    draft = EagleDraft(shape)
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0, 0.3 if p.dim() == 2 else 1.0)
    draft.attach_target(torch.randn(50, 32), torch.ones(32), torch.randn(50, 32), rotary_cos_sin(8, 64, 10000.0, None))
    return draft.eval()


def test_unrolled_training_steps_are_what_serving_computes():
    """Step k of the training-time unroll at row i is the k-th drafting step when the target's features reach row
    i - k + 1: the serving path (`extend` over a cache, chain drafts fed their own output) gives the same streams."""
    from hosted.spec.eagle_model import DraftCache

    draft = _random_draft()
    t, steps = 12, 4
    g = torch.randn(1, t, 32)
    tokens = torch.randint(0, 50, (1, t))
    with torch.no_grad():
        outs = draft.unroll(g, tokens, steps)
    for fed in (3, 7):  # the target's features reached rows 0..fed - 1
        cache = DraftCache.empty(draft.shape)
        h = draft.extend(cache, g[0, :fed], tokens[0, :fed], 0)[-1:]
        torch.testing.assert_close(h[0], outs[0][0, fed - 1], rtol=1e-4, atol=1e-4)
        for k in range(2, steps + 1):
            row = fed - 1 + k - 1
            h = draft.extend(cache, h, tokens[0, row:row + 1], row)
            torch.testing.assert_close(h[0], outs[k - 1][0, row], rtol=1e-4, atol=1e-4)
