"""Tiny random-weight HF checkpoints (built with transformers, saved with save_pretrained) and an engine
factory whose engines are checked, after every test, to have handed every KV block back."""
from __future__ import annotations

import pytest
import torch

TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 128, "vocab_size": 320, "max_position_embeddings": 512}


EOS_PROMPT = [21, 22, 23, 24, 25, 26]


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """HF initialises norms to 1 and biases to 0, which would hide bugs in how we load and apply them."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def _build(kind: str, out_dir, seed: int = 0, eos_from_greedy: list[int] | None = None, **overrides):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(seed)
    kw = {**TINY, "eos_token_id": None, "bos_token_id": None, **overrides}
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kw))
    elif kind == "qwen2":
        kw.setdefault("tie_word_embeddings", True)
        kw.setdefault("rope_theta", 1_000_000.0)
        model = Qwen2ForCausalLM(Qwen2Config(**kw))
    elif kind == "mistral":
        kw.setdefault("sliding_window", 256)
        model = MistralForCausalLM(MistralConfig(**kw))
    else:
        raise ValueError(kind)
    _perturb(model, seed)
    model.eval()
    if eos_from_greedy is not None:
        # Declare as EOS a token the model really emits greedily (the 4th after this prompt), so EOS
        # handling is exercised without searching for a prompt that happens to end.
        with torch.no_grad():
            out = model.generate(torch.tensor([eos_from_greedy]), max_new_tokens=4, do_sample=False,
                                 attention_mask=torch.ones(1, len(eos_from_greedy), dtype=torch.long))
        eos = int(out[0, -1])
        model.config.eos_token_id = eos
        model.generation_config.eos_token_id = eos
    model.save_pretrained(str(out_dir))
    return str(out_dir)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {
        "llama": _build("llama", root / "llama", seed=1),
        "qwen2": _build("qwen2", root / "qwen2", seed=2, eos_from_greedy=EOS_PROMPT),
        "mistral": _build("mistral", root / "mistral", seed=3),
        # Llama 3.1-style rope scaling with a short original context so positions in the tests are scaled.
        "llama3": _build("llama", root / "llama3", seed=4, rope_theta=500_000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    }


@pytest.fixture(scope="session")
def hf_models(tiny_model_dirs):
    """Lazily loaded transformers models, one per tiny checkpoint, fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    cache: dict[str, torch.nn.Module] = {}

    def get(kind: str, dtype: torch.dtype = torch.float32):
        key = f"{kind}:{dtype}"
        if key not in cache:
            cache[key] = AutoModelForCausalLM.from_pretrained(tiny_model_dirs[kind], dtype=dtype).eval()
        return cache[key]

    return get


# Test modules of the engine core; the pool check below is applied to every engine their tests build.
_ENGINE_CORE_TESTS = ("test_model_", "test_engine_", "test_block_manager", "test_scheduler", "test_sampler")


@pytest.fixture(autouse=True)
def _kv_pool_back_to_free(request, monkeypatch):
    """After every engine-core test, each LLMEngine it created has no requests left and every KV block free."""
    if not request.module.__name__.rpartition(".")[2].startswith(_ENGINE_CORE_TESTS):
        yield
        return
    from hosted.engine import LLMEngine

    created: list[LLMEngine] = []
    original = LLMEngine.__init__

    def tracking_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        created.append(self)

    monkeypatch.setattr(LLMEngine, "__init__", tracking_init)
    yield
    for engine in created:
        assert not engine.has_unfinished(), "test left requests in the engine"
        engine.block_manager.check_all_free()


@pytest.fixture
def make_engine():
    """Build an LLMEngine on a checkpoint dir (small default pool)."""
    from hosted.engine import EngineConfig, LLMEngine

    def make(model_dir: str, **kw) -> LLMEngine:
        kw.setdefault("num_kv_blocks", 128)
        return LLMEngine(EngineConfig(model_dir=model_dir, **kw))

    return make
