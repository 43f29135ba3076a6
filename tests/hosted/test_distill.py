"""`switchyard engine distill` (hosted/distill/): the student's math against the engine, the narrow-head draft
checkpoint the engine serves, the divergences, and a run interrupted by a real SIGINT that resumes to exactly
the weights of an uninterrupted run."""
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

from hosted.config import ConfigError, ModelConfig
from hosted.distill import prompts as prompt_sets
from hosted.distill.losses import divergence, head_index, teacher_targets
from hosted.distill.run import DistillSettings, choose_head, distill
from hosted.distill.student import export_draft, new_student, student_shape
from hosted.distill.trainer import TrainSettings, batch_for_step
from hosted.engine import EngineConfig, LLMEngine, SamplingParams
from hosted.loader import dequantize_int8_storage, int8_storage
from hosted.models import DEMO_MODEL_DIR
from tests.hosted.serving_helpers import build_tiny_chat_model

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [f"Tell me about item number {i} in the list, briefly." for i in range(48)]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("teacher") / "teacher", seed=5)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def _settings(teacher: Path, prompts: Path, out: Path, **kw) -> DistillSettings:
    base = {"teacher": str(teacher), "out": str(out), "layers": 1, "head_vocab": 96, "prompts": str(prompts), "tokens": 200,
                "max_new_tokens": 12, "temperature": 1.0, "epochs": 1.0, "batch_size": 4, "lr": 3e-3, "bf16": False,
                "checkpoint_every": 1, "held_out_percent": 15, "eval_prompts": 3, "eval_tokens": 8, "shard_prompts": 16,
                "progress": False}
    base.update(kw)
    return DistillSettings(**base)


def _engine_last_logprobs(model_dir: str, ids: list[int]) -> list[tuple[int, float]]:
    engine = LLMEngine(EngineConfig(model_dir=model_dir))
    engine.add_request("r", ids, SamplingParams(max_tokens=1, temperature=0.0, top_logprobs=5))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs[-1].logprobs[0].top


def test_student_with_every_teacher_layer_reproduces_the_engine():
    """The trainable student (padded batches, SDPA) does the engine's math: with all of the teacher's layers
    and a full head its next-token distribution is the engine's to fp32 rounding."""
    cfg = ModelConfig.from_dir(DEMO_MODEL_DIR)
    shape = student_shape(cfg, cfg.num_hidden_layers, None, cfg.vocab_size)
    student = new_student(shape, DEMO_MODEL_DIR, cfg, list(range(cfg.vocab_size)), seed=0).eval()
    ids = list(range(5, 60))
    with torch.no_grad():
        ours = torch.log_softmax(student(torch.tensor([ids]))[0, -1], dim=-1)
    for token, logprob in _engine_last_logprobs(DEMO_MODEL_DIR, ids):
        assert ours[token].item() == pytest.approx(logprob, abs=2e-4)
    assert [t for t, _ in _engine_last_logprobs(DEMO_MODEL_DIR, ids)] == ours.topk(5).indices.tolist()


def test_layer_choice_spans_the_teacher_and_bad_shapes_are_refused():
    cfg = ModelConfig.from_dir(DEMO_MODEL_DIR)
    assert student_shape(cfg, 3, None, 100).teacher_layers == [0, 4, 7]  # first, middle, last of 8
    assert student_shape(cfg, 1, None, 100).teacher_layers == [0]
    narrow = student_shape(cfg, 2, 256, 100)
    assert (narrow.hidden_size, narrow.num_heads, narrow.teacher_layers) == (256, 4, [])
    for bad in ({"num_layers": 0}, {"num_layers": 9}, {"hidden": 100}, {"hidden": 1024}, {"head_vocab": 0}):
        args = {"num_layers": 2, "hidden": None, "head_vocab": 100, **bad}
        with pytest.raises(ValueError):
            student_shape(cfg, args["num_layers"], args["hidden"], args["head_vocab"])


def test_narrow_head_draft_checkpoint_serves_and_keeps_greedy_output(tmp_path):
    """The exported draft (int8 storage, head over a subset) loads in the engine: logits are -inf outside
    the head and the student's (up to storage rounding) inside; as a --draft, greedy output is unchanged
    and no proposed token lies outside the head."""
    cfg = ModelConfig.from_dir(DEMO_MODEL_DIR)
    head = sorted(set(range(0, cfg.vocab_size, 7)) | set(cfg.eos_token_ids))
    shape = student_shape(cfg, 2, None, len(head))
    student = new_student(shape, DEMO_MODEL_DIR, cfg, head, seed=0).eval()
    out = tmp_path / "draft"
    size = export_draft(student, out, DEMO_MODEL_DIR, cfg, "# card\n", {})
    assert size == (out / "model.safetensors").stat().st_size
    assert load_file(str(out / "model.safetensors"))["model.embed_tokens.weight"].dtype == torch.int8
    draft_cfg = ModelConfig.from_dir(out)
    assert (draft_cfg.head_vocab_size, draft_cfg.num_hidden_layers, draft_cfg.vocab_size) == (len(head), 2,
                                                                                              cfg.vocab_size)
    ids = list(range(3, 40))
    top = _engine_last_logprobs(str(out), ids)
    assert {t for t, _ in top} <= set(head)
    with torch.no_grad():
        ours = torch.log_softmax(student(torch.tensor([ids]))[0, -1], dim=-1)
    for token, logprob in top:
        assert ours[head.index(token)].item() == pytest.approx(logprob, abs=0.05)  # int8 storage of the weights

    prompts = [list(range(10, 30)), list(range(100, 112))]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = LLMEngine(EngineConfig(model_dir=DEMO_MODEL_DIR)).generate(prompts, params)
    spec = LLMEngine(EngineConfig(model_dir=DEMO_MODEL_DIR, draft_model_dir=str(out), num_speculative_tokens=3,
                                  spec_adaptive=False))
    proposed: list[int] = []
    original = spec.spec.draft.propose

    def spy(seqs, ks):
        original(seqs, ks)
        proposed.extend(t for s in seqs for t in s.spec_token_ids)

    spec.spec.draft.propose = spy
    assert spec.generate(prompts, params) == plain
    assert proposed and set(proposed) <= set(head)


def test_int8_storage_round_trip_and_broken_pairs():
    torch.manual_seed(0)
    w = torch.randn(6, 64) * torch.linspace(0.01, 3, 64)
    q, scale = int8_storage(w, 32)
    assert q.dtype == torch.int8 and scale.shape == (6, 2)
    (name, back), = dequantize_int8_storage([("x.weight", q), ("x.weight_scale", scale)], 32)
    assert name == "x.weight"
    step = scale.float().repeat_interleave(32, dim=1)
    assert ((back - w).abs() <= step / 2 + 1e-3 * step).all()
    norm = w[0]
    assert next(iter(dequantize_int8_storage([("n.weight", norm)], 32)))[1] is norm
    with pytest.raises(ConfigError, match="without their value/scale pair"):
        list(dequantize_int8_storage([("x.weight", q)], 32))
    with pytest.raises(ConfigError, match="does not match its scales"):
        list(dequantize_int8_storage([("x.weight", q), ("x.weight_scale", scale[:, :1])], 32))


def test_draft_config_fields_are_validated(tmp_path):
    raw = json.loads((Path(DEMO_MODEL_DIR) / "config.json").read_text())
    for patch, message in (({"head_vocab_size": 0}, "head_vocab_size"),
                           ({"head_vocab_size": 10 ** 6}, "head_vocab_size"),
                           ({"head_vocab_size": 10, "tie_word_embeddings": True}, "untied"),
                           ({"switchyard_storage": {"int8_block_size": "x"}}, "switchyard_storage")):
        with pytest.raises(ConfigError, match=message):
            ModelConfig.from_dict({**raw, "tie_word_embeddings": False, **patch})


def test_teacher_targets_and_divergences():
    index = head_index(torch.tensor([2, 5, 7, 9]), 12)
    assert index.tolist() == [-1, -1, 0, -1, -1, 1, -1, 2, -1, 3, -1, -1]
    top_ids = torch.tensor([[5, 3, 9]])  # token 3 is outside the head
    top_lp = torch.tensor([[0.6, 0.2, 0.1]]).log()  # 0.1 of the mass lies beyond the top 3
    target = teacher_targets(top_ids, top_lp, index, 4)
    expected = torch.tensor([0.025, 0.625, 0.025, 0.125]) / 0.8
    assert torch.allclose(target[0], expected, atol=1e-6)
    same = target.log()
    for name in ("fkl", "rkl", "jsd"):
        assert divergence(name, same, target).item() == pytest.approx(0.0, abs=1e-6)
        worse = divergence(name, torch.zeros(1, 4), target).item()
        assert worse > 0.01
    with pytest.raises(ValueError, match="--divergence"):
        divergence("tvd", same, target)


def test_batches_depend_only_on_the_step():
    settings = TrainSettings("fkl", 3.0, 4, 1e-3, seed=1, bf16=False, checkpoint_every=1)
    first = [batch_for_step(settings, 10, s) for s in range(6)]
    assert first == [batch_for_step(settings, 10, s) for s in range(6)]
    epoch = first[0] + first[1]
    assert len(set(epoch)) == len(epoch) == 8  # no repeats within an epoch
    assert first[:2] != first[2:4]  # each epoch reshuffled


def test_head_takes_eos_then_the_most_frequent_outputs():
    from hosted.distill.teacher import Example

    cfg = ModelConfig.from_dir(DEMO_MODEL_DIR)
    ex = [Example([1], [50, 50, 50, 60, 60, 70], torch.zeros(6, 1), torch.zeros(6, 1))]
    head = choose_head(ex, len(cfg.eos_token_ids) + 2, cfg)
    assert set(head) == set(cfg.eos_token_ids) | {50, 60}
    assert choose_head(ex, cfg.vocab_size, cfg) == list(range(cfg.vocab_size))


def test_prompt_files(tmp_path):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "hi"}\n\n{"messages": [{"role": "user", "content": "yo"}]}\n')
    assert prompt_sets.load_prompts(jsonl) == [[{"role": "user", "content": "hi"}], [{"role": "user",
                                                                                      "content": "yo"}]]
    text = tmp_path / "p.txt"
    text.write_text("one\ntwo\n")
    assert len(prompt_sets.load_prompts(text)) == 2
    for content, message in (('{"prompt": 3}\n', "needs"), ("{not json\n", "not valid JSON"), ("\n", "no prompts"),
                             ('{"messages": []}\n', "non-empty")):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(content)
        with pytest.raises(ValueError, match=message):
            prompt_sets.load_prompts(bad)
    defaults = prompt_sets.default_prompts(60)
    assert len(defaults) == 60 and len({json.dumps(c) for c in defaults}) == 60
    held = [m for c in defaults for m in c if any(f"`{mod}." in m["content"] for mod in prompt_sets.HELD_OUT_MODULES)]
    assert held == []


_CHILD = """
import sys, time
import hosted.distill.trainer as trainer
from hosted.distill.run import DistillSettings, distill
save = trainer.save_checkpoint
def slow_save(*args):  # slow steps down so that the signal surely lands mid-run
    save(*args)
    time.sleep(0.3)
trainer.save_checkpoint = slow_save
settings = DistillSettings(**__import__("json").loads(sys.argv[1]))
sys.exit(0 if distill(settings, log=lambda m: print(m, flush=True)) is not None else 130)
"""


def test_interrupted_run_resumes_to_the_uninterrupted_result(teacher_dir, prompts_file, tmp_path):
    """A real SIGINT during training stops the run cleanly (exit 130, checkpoint kept, no OUT); rerunning the
    same settings finishes with bit-identical weights to a run that was never interrupted."""
    torch.set_num_threads(1)
    straight = distill(_settings(teacher_dir, prompts_file, tmp_path / "a" / "draft"), log=lambda m: None)
    assert straight is not None and straight["steps"] >= 6

    settings = _settings(teacher_dir, prompts_file, tmp_path / "b" / "draft")
    payload = json.dumps({k: getattr(settings, k) for k in settings.__slots__})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    # One torch thread in the child too, so its arithmetic matches this process's.
    child = [sys.executable, "-c", "import torch; torch.set_num_threads(1)\n" + _CHILD, payload]
    proc = subprocess.Popen(child, cwd=str(ROOT), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    ckpt = settings.work_path() / "checkpoint.pt"
    deadline = time.monotonic() + 120
    while not ckpt.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output
    stopped_at = torch.load(ckpt, weights_only=False)["step"]
    assert 1 <= stopped_at < straight["steps"], output
    assert not Path(settings.out).exists()

    resumed = distill(settings, log=lambda m: None)
    assert resumed is not None and resumed["steps"] == straight["steps"]
    a = load_file(str(tmp_path / "a" / "draft" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "draft" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert resumed["acceptance_after"] == straight["acceptance_after"]

    with pytest.raises(ValueError, match="other settings"):
        distill(_settings(teacher_dir, prompts_file, tmp_path / "b" / "draft", lr=1e-2), log=lambda m: None)


def test_bad_input_fails_before_anything_is_written(tmp_path):
    one = tmp_path / "one.txt"
    one.write_text("just one prompt\n")
    settings = DistillSettings(teacher=DEMO_MODEL_DIR, out=str(tmp_path / "draft"), prompts=str(one),
                               held_out_percent=50, progress=False)
    with pytest.raises(ValueError, match="give more prompts"):
        distill(settings, log=lambda m: None)
    with pytest.raises(ValueError, match="--layers"):
        distill(DistillSettings(teacher=DEMO_MODEL_DIR, out=str(tmp_path / "draft"), layers=99), log=lambda m: None)
    assert list(tmp_path.iterdir()) == [one]
