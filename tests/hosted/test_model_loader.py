"""Checkpoint loading: sharded safetensors, and clear errors for what is missing or unsupported."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from hosted.config import ConfigError, ModelConfig
from hosted.engine import EngineConfig, LLMEngine, SamplingParams


def test_sharded_checkpoint_loads_identically(tiny_model_dirs, hf_models, tmp_path, make_engine):
    hf_models("llama").save_pretrained(str(tmp_path), max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    sharded = make_engine(str(tmp_path))
    single = make_engine(tiny_model_dirs["llama"])
    for a, b in zip(sharded.runner.model.state_dict().values(), single.runner.model.state_dict().values()):
        assert torch.equal(a, b)
    params = SamplingParams(max_tokens=5, temperature=0.0)
    assert sharded.generate([[1, 2, 3]], params) == single.generate([[1, 2, 3]], params)


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def test_missing_config(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        LLMEngine(EngineConfig(model_dir=str(tmp_path)))
    with pytest.raises(ConfigError, match="does not exist"):
        LLMEngine(EngineConfig(model_dir=str(tmp_path / "nowhere")))


def test_missing_weights_and_missing_shard(tiny_model_dirs, hf_models, tmp_path):
    d = _copy(tiny_model_dirs["llama"], tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="no model.safetensors"):
        LLMEngine(EngineConfig(model_dir=d))
    shard_dir = tmp_path / "sharded"
    hf_models("llama").save_pretrained(str(shard_dir), max_shard_size="100KB")
    victim = sorted(shard_dir.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ConfigError, match=victim.name):
        LLMEngine(EngineConfig(model_dir=str(shard_dir)))


def test_missing_tensor_is_named(tiny_model_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    d = _copy(tiny_model_dirs["qwen2"], tmp_path / "m")
    path = tmp_path / "m" / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        LLMEngine(EngineConfig(model_dir=d))


@pytest.mark.parametrize("edit,match", [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "unsupported architecture.*GPT2LMHeadModel"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "yarn"),
    ({"vocab_size": None}, "vocab_size"),
])
def test_unsupported_configs_fail_clearly(tiny_model_dirs, tmp_path, edit, match):
    d = _copy(tiny_model_dirs["llama"], tmp_path / "m")
    cfg_path = tmp_path / "m" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(edit)
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=match):
        LLMEngine(EngineConfig(model_dir=d))


def test_parses_old_and_new_rope_layouts():
    base = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
            "intermediate_size": 128, "num_hidden_layers": 1, "vocab_size": 10, "eos_token_id": [1, 2]}
    old = ModelConfig.from_dict({**base, "rope_theta": 5e5, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    new = ModelConfig.from_dict({**base, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    assert old.rope_theta == new.rope_theta == 5e5
    assert old.rope_scaling["factor"] == new.rope_scaling["factor"] == 8.0
    assert old.eos_token_ids == [1, 2] and old.num_key_value_heads == 4 and old.head_dim == 16
    assert ModelConfig.from_dict({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}).rope_scaling is None


def test_mistral_sliding_window_caps_context(tiny_model_dirs, make_engine):
    engine = make_engine(tiny_model_dirs["mistral"])
    assert engine.max_model_len == 256
    with pytest.raises(ValueError, match="max_model_len"):
        LLMEngine(EngineConfig(model_dir=tiny_model_dirs["mistral"], max_model_len=1024, num_kv_blocks=8))
