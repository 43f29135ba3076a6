"""The demo-model trainer (tiny runs) and the committed checkpoint under hosted/models/demo/."""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
import torch

from hosted.tools import demo_corpus as corpus
from hosted.tools import train_demo

DEMO_DIR = Path(__file__).resolve().parents[2] / "hosted" / "models" / "demo"


def _tiny_config(**overrides: object) -> train_demo.TrainConfig:
    cfg = train_demo.TrainConfig(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        max_position_embeddings=128, seq_len=32, batch_size=8, lr=6e-3, warmup_steps=5, steps=32,
        log_every=4, eval_every=8, eval_windows=4, checkpoint_every_s=1e9, seed=1)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


@pytest.fixture(scope="module")
def tiny_sources() -> list[Path]:
    # A slice of the stdlib that holds a few held-out (validation) documents.
    root = corpus.stdlib_dir()
    paths = [root / "json" / "decoder.py", root / "json" / "encoder.py", root / "textwrap.py",
             root / "argparse.py", root / "difflib.py", root / "random.py"]
    return [p for p in paths if p.is_file()]


@pytest.fixture(autouse=True)
def _threads() -> None:
    torch.set_num_threads(1)


def _weights(work_dir: Path) -> dict[str, torch.Tensor]:
    ckpt = train_demo.load_checkpoint(work_dir)
    assert ckpt is not None
    return ckpt["model"]


def test_tiny_run_learns_exports_and_resumes_exactly(tmp_path: Path, tiny_sources: list[Path],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _tiny_config()
    # Uninterrupted reference run.
    whole = train_demo.train(cfg, tmp_path / "whole", tmp_path / "out", sources=tiny_sources, progress=False,
                             log=lambda *_: None)
    assert whole.finished and whole.step == cfg.steps
    losses = [r["train_loss"] for r in whole.history]
    assert losses[-1] < losses[0] - 1.0, losses           # it learns, clearly
    assert (tmp_path / "whole" / train_demo.LOG_CSV).read_text().count("\n") == len(whole.history) + 1
    vals = [r["val_loss"] for r in whole.history if r.get("val_loss") not in (None, "")]
    assert len(vals) >= 3 and vals[-1] < vals[0]

    # Same run, interrupted (Ctrl-C) after 10 steps, then resumed: identical history and weights.
    real_next = train_demo.WindowSampler.next_batch
    calls = {"n": 0}

    def interrupting(self: train_demo.WindowSampler) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 11:
            raise KeyboardInterrupt
        return real_next(self)

    monkeypatch.setattr(train_demo.WindowSampler, "next_batch", interrupting)
    first = train_demo.train(cfg, tmp_path / "split", tmp_path / "out2", sources=tiny_sources, progress=False,
                             log=lambda *_: None)
    assert not first.finished and first.step == 10 and first.exported_to is None
    assert not (tmp_path / "out2").exists()
    assert train_demo.load_checkpoint(tmp_path / "split")["step"] == 10
    monkeypatch.setattr(train_demo.WindowSampler, "next_batch", real_next)
    messages: list[str] = []
    second = train_demo.train(cfg, tmp_path / "split", tmp_path / "out2", sources=tiny_sources, progress=False,
                              log=messages.append)
    assert any("resumed at step 10" in m for m in messages)
    assert second.finished and second.step == cfg.steps
    assert [r["train_loss"] for r in second.history] == losses
    a, b = _weights(tmp_path / "whole"), _weights(tmp_path / "split")
    assert all(torch.equal(a[k], b[k]) for k in a)

    # The export is an HF checkpoint in bf16 that transformers loads, and it is the trained model.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    ref = {k: v.to(torch.bfloat16).float() for k, v in a.items()}
    got = model.state_dict()
    assert all(torch.equal(got[k], ref[k]) for k in ref if k in got)


def test_resume_refuses_a_checkpoint_of_another_model(tmp_path: Path, tiny_sources: list[Path]) -> None:
    train_demo.train(_tiny_config(steps=2), tmp_path, None, sources=tiny_sources, progress=False,
                     log=lambda *_: None)
    with pytest.raises(SystemExit, match="model settings"):
        train_demo.train(_tiny_config(steps=4, hidden_size=32), tmp_path, None, sources=tiny_sources,
                         progress=False, log=lambda *_: None)


def test_cli_rejects_bad_budget_and_missing_checkpoint(tmp_path: Path) -> None:
    args = argparse.Namespace(out=str(tmp_path / "o"), work_dir=str(tmp_path / "w"), steps=0, minutes=None,
                              resume=True, threads=None, seed=0, export_only=False)
    assert train_demo.cli_train_demo(args) == 2
    assert not (tmp_path / "w").exists() and not (tmp_path / "o").exists()
    args.steps, args.export_only = None, True
    with pytest.raises(SystemExit, match="nothing to export"):
        train_demo.cli_train_demo(args)
    assert not (tmp_path / "o").exists()


def test_corpus_is_deterministic_and_split_by_content() -> None:
    sources = corpus.stdlib_sources()
    assert sources == corpus.stdlib_sources()
    json_files = [p.name for p in sources if p.parent.name == "json"]
    assert json_files == sorted(json_files) and "decoder.py" in json_files
    assert not any("site-packages" in p.parts or "test" in p.parts for p in sources)
    first = [d.digest for d in corpus.iter_documents(paths=sources[:40])]
    again = [d.digest for d in corpus.iter_documents(paths=sources[:40])]
    assert first == again and len(first) == len(set(first))
    doc = corpus.Document("function", "m.f", "m.f(x)", "Return x unchanged, always.")
    assert doc.is_validation == corpus.Document("class", "other", "class other", doc.body).is_validation


# --------------------------------------------------------------------------- the committed demo model

def _held_out_documents(count: int) -> list[corpus.Document]:
    found: list[corpus.Document] = []
    for doc in corpus.iter_documents():
        if doc.is_validation and doc.kind != "topic":
            found.append(doc)
            if len(found) == count:
                break
    return found


@pytest.fixture(scope="module")
def demo() -> tuple[object, object]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert (DEMO_DIR / "model.safetensors").is_file(), "the demo checkpoint is missing"
    tok = AutoTokenizer.from_pretrained(DEMO_DIR)
    model = AutoModelForCausalLM.from_pretrained(DEMO_DIR, dtype=torch.float32)
    return tok, model.eval()


def test_demo_checkpoint_layout_and_size() -> None:
    from safetensors import safe_open

    config = json.loads((DEMO_DIR / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    total = sum(f.stat().st_size for f in DEMO_DIR.iterdir())
    assert total < 60 * 1024 * 1024
    with safe_open(str(DEMO_DIR / "model.safetensors"), "pt") as f:
        params = 0
        for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            t = f.get_tensor(key)
            assert t.dtype == torch.bfloat16, key
            params += t.numel()
    assert 15e6 < params < 40e6   # "a few tens of millions": big enough that CPU decode is memory-bound
    tok_cfg = json.loads((DEMO_DIR / "tokenizer_config.json").read_text())
    gen_cfg = json.loads((DEMO_DIR / "generation_config.json").read_text())
    assert tok_cfg["chat_template"] == corpus.CHAT_TEMPLATE
    assert set(gen_cfg["eos_token_id"]) == {0, 2}


def test_demo_tokenizer_round_trips_and_renders_the_chat_template(demo: tuple) -> None:
    tok, _ = demo
    text = "def f(x):\n    \"\"\"Return x²  — unchanged.\"\"\"\n\treturn x  # 終わり 🚀\n"
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id == 0
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(ids[1:]) == text
    messages = [{"role": "system", "content": corpus.SYSTEM_PROMPT},
                {"role": "user", "content": "What does json.dumps do?"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == corpus.render_chat(messages, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids.count(tok.bos_token_id) == 1 and ids.count(tok.convert_tokens_to_ids("<|im_end|>")) == 2


def test_demo_model_is_trained_on_held_out_docstrings(demo: tuple) -> None:
    tok, model = demo
    docs = _held_out_documents(8)
    assert len(docs) == 8
    total, count = 0.0, 0
    with torch.no_grad():
        for doc in docs:
            ids = torch.tensor([tok(corpus.render(doc), add_special_tokens=False).input_ids[:512]])
            logits = model(input_ids=ids).logits[0, :-1]
            total += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
            count += ids.shape[1] - 1
    loss = total / count
    uniform = math.log(model.config.vocab_size)
    assert loss < 0.6 * uniform, f"held-out loss {loss:.2f} vs ln(vocab) {uniform:.2f}: not trained"
