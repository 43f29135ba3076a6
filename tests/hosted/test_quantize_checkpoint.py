"""`switchyard engine quantize` (hosted/tools/quantize.py): quantize -> save -> load.

The reference is the engine quantizing at load (`EngineConfig.quantization`), itself tested against
transformers in tests/hosted/test_quantization.py: a saved checkpoint must give bit-identical logits and load
without quantizing anything again. Bad checkpoints fail naming the field or the file.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QT

import kernels.ops
from hosted.config import ConfigError, ModelConfig
from hosted.engine import EngineConfig, LLMEngine
from hosted.layers.linear import quantizable_linears
from hosted.tokenizer import Tokenizer
from hosted.tools.quantize import quantize_checkpoint
from tests.hosted.serving_helpers import build_tiny_chat_model, byte_level_bpe
from tests.hosted.test_gguf import PROMPT, SHAPE, write_gguf
from tests.hosted.test_model_hf_parity import full_prompt_logits


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("chat") / "chat", seed=3)


@pytest.fixture(scope="module")
def tiny_q4_gguf(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = byte_level_bpe(320)
    torch.manual_seed(11)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE, vocab_size=tok.get_vocab_size())).eval()
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-q4_1.gguf", model, tok, QT.Q4_1, tie=True)


def _engine(model, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=str(model), max_num_seqs=2, num_kv_blocks=16, **kw))


def _logits(model, **kw) -> torch.Tensor:
    return full_prompt_logits(_engine(model, **kw), PROMPT)


def _no_quantizing(monkeypatch) -> None:
    def refuse(*_a, **_k):
        raise AssertionError("a saved checkpoint was quantized again at load")

    monkeypatch.setattr(kernels.ops, "quantize_int8", refuse)
    monkeypatch.setattr(kernels.ops, "quantize_int4", refuse)


@pytest.mark.parametrize(("bits", "group", "scheme"), [(8, None, "int8"), (4, 32, "int4"), (4, 64, "int4")])
def test_round_trip_equals_quantizing_at_load(bits, group, scheme, chat_dir, tmp_path, monkeypatch):
    out = tmp_path / "q"
    result = quantize_checkpoint(chat_dir, bits, out, group, progress=False)
    at_load = _logits(chat_dir, quantization=scheme, quantization_group_size=group or 128)
    _no_quantizing(monkeypatch)
    cfg = ModelConfig.from_dir(out)
    assert (cfg.quantization, cfg.quantization_group_size) == (scheme, group or 0)
    engine = _engine(out)
    for name, layer in quantizable_linears(engine.runner.model):
        assert (layer.quantization, layer.group_size) == (scheme, group or 0), name
    torch.testing.assert_close(full_prompt_logits(engine, PROMPT), at_load, rtol=0, atol=0)
    # `--quantization` of the same scheme at load is accepted (nothing to do), another one is refused.
    _engine(out, quantization=scheme, quantization_group_size=group or 128)
    other = "int4" if scheme == "int8" else "int8"
    with pytest.raises(ConfigError, match=r"already quantized \(int"):
        _engine(out, quantization=other)
    # Self-contained: tokenizer, chat template and EOS come along.
    src, got = Tokenizer.from_dir(chat_dir), Tokenizer.from_dir(out)
    messages = [{"role": "user", "content": "hi"}]
    assert got.encode_chat(messages) == src.encode_chat(messages) and got.eos_token_ids == src.eos_token_ids
    assert result["safetensors_bytes"] == (out / "model.safetensors").stat().st_size
    assert not (tmp_path / "q.partial").exists()


def test_gguf_round_trip_keeps_q4_blocks_and_the_tokenizer(tiny_q4_gguf, tmp_path, monkeypatch):
    out = tmp_path / "q"
    result = quantize_checkpoint(tiny_q4_gguf, 4, out, progress=False)  # default group size for GGUF: 32
    assert result["group_size"] == 32
    at_load = _logits(tiny_q4_gguf, quantization="int4", quantization_group_size=32)
    _no_quantizing(monkeypatch)
    torch.testing.assert_close(_logits(out), at_load, rtol=0, atol=0)
    src, got = Tokenizer.from_gguf(tiny_q4_gguf), Tokenizer.from_dir(out)
    for text in ("The quick brown fox", "Café 你好 😀"):
        assert got.encode(text) == src.encode(text)
    assert got.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        src.apply_chat_template([{"role": "user", "content": "hi"}])
    assert got.eos_token_ids == src.eos_token_ids and ModelConfig.from_dir(out).tie_word_embeddings


def test_cli_writes_the_checkpoint(chat_dir, tmp_path, capsys):
    from hosted.cli import register

    parser = argparse.ArgumentParser(prog="switchyard")
    register(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "q"
    args = parser.parse_args(["engine", "quantize", "--model", str(chat_dir), "--bits", "4", "--out", str(out)])
    assert args.func(args) == 0
    assert "int4 group size 64" in capsys.readouterr().out  # largest of 128/64/32 dividing hidden 64
    args = parser.parse_args(["engine", "quantize", "--model", str(chat_dir), "--bits", "8", "--out", str(out)])
    assert args.func(args) == 1
    assert "already exists and is not an empty directory" in capsys.readouterr().err
    args = parser.parse_args(["engine", "quantize", "--model", str(out), "--bits", "8", "--out", str(tmp_path / "r")])
    assert args.func(args) == 1
    assert "already quantized (int4)" in capsys.readouterr().err


# ----------------------------------------------------------------------------------- bad checkpoints
@pytest.fixture(scope="module")
def int4_dir(chat_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("int4") / "q"
    quantize_checkpoint(chat_dir, 4, out, 32, progress=False)
    return out


def _variant(src: Path, dst: Path, **quantization_config) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {**cfg["quantization_config"], **quantization_config}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(("change", "message"), [
    ({"quant_method": "gptq"}, r"quantization_config.quant_method 'gptq' is not supported"),
    ({"quant_method": "awq"}, r"quantization_config.quant_method 'awq' is not supported"),
    ({"bits": 3}, r"quantization_config.bits 3 is not supported \(8 or 4\)"),
    ({"group_size": 48}, r"quantization_config.group_size 48 is not supported for bits 4"),
])
def test_another_scheme_names_the_field(change, message, int4_dir, tmp_path):
    with pytest.raises(ConfigError, match=message):
        _engine(_variant(int4_dir, tmp_path / "v", **change))


def test_corrupt_or_truncated_safetensors_names_the_file(int4_dir, tmp_path):
    bad = shutil.copytree(int4_dir, tmp_path / "bad")
    weights = bad / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ConfigError, match=rf"'{weights}' is not a readable safetensors file"):
        _engine(bad)
    weights.write_bytes(b"\x00" * 64)
    with pytest.raises(ConfigError, match=rf"'{weights}' is not a readable safetensors file"):
        _engine(bad)


def test_missing_or_full_precision_parts_name_the_tensor(int4_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(int4_dir / "model.safetensors"))
    gap = shutil.copytree(int4_dir, tmp_path / "gap")
    save_file({k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.zeros"},
              str(gap / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"lacks weights for: model.layers.1.mlp.up_proj.zeros"):
        _engine(gap)
    wrong = shutil.copytree(int4_dir, tmp_path / "wrong")
    name = "model.layers.0.self_attn.q_proj.qweight"
    save_file({**tensors, name: tensors[name].float()}, str(wrong / "model.safetensors"))
    with pytest.raises(ConfigError, match=rf"tensor '{name}' has dtype torch.float32, the quantized layer holds "
                                          r"torch.uint8"):
        _engine(wrong)
