"""Every CPU kernel path the engine can take gives transformers' greedy continuations, batched.

The paths: the native kernels with prepacked weights (the default: decode-only steps run every layer in one
native call, kernels/cpu_decode.py), the same with the per-op decode loop, the native kernels with plain weights,
no native kernels (cpu_native=False: torch reference attention, oneDNN-only packed linears) and
the plain reference (kernels="reference"): EngineConfig's kernel switches. head_dim 64 takes the register-tiled native decode
attention (query-head groups of 3 per KV head, as in SmolLM); Qwen2's QKV bias goes through the packed
linear with a bias.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from hosted.engine import SamplingParams
from kernels import cpu_native, switches

PROMPTS = [[5, 6, 7, 8, 9], [3], [(i * 37) % 300 + 10 for i in range(45)], list(range(40, 61))]
NEW_TOKENS = 10
PATHS = {
    "native+packed (decode steps in one native call)": {},
    "native+packed, per-op decode loop": {"cpu_decode_step": False},
    "native, unpacked weights": {"cpu_packed_weights": False},
    "no native kernels": {"cpu_native": False},
    "reference": {"kernels": "reference"},
}


@pytest.fixture(scope="module")
def head64_dirs(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    root = tmp_path_factory.mktemp("head64")
    shape = {"hidden_size": 192, "num_hidden_layers": 2, "num_attention_heads": 3, "num_key_value_heads": 1,
             "intermediate_size": 256, "vocab_size": 320, "max_position_embeddings": 256,
             "eos_token_id": None, "bos_token_id": None}
    dirs = {}
    for kind, cls, cfg in (("llama", LlamaForCausalLM, LlamaConfig), ("qwen2", Qwen2ForCausalLM, Qwen2Config)):
        torch.manual_seed(7)
        model = cls(cfg(**shape)).eval()
        with torch.no_grad():  # non-trivial norms and biases, so loading and applying them is checked
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.2 * torch.randn(p.shape))
                elif name.endswith(".bias"):
                    p.copy_(0.1 * torch.randn(p.shape))
        model.save_pretrained(str(root / kind))
        dirs[kind] = (str(root / kind), model)
    return dirs


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_every_cpu_path_matches_transformers(kind, head64_dirs, make_engine, kernel_switches):
    model_dir, hf = head64_dirs[kind]
    want = [_hf_greedy(hf, p) for p in PROMPTS]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for path, fields in PATHS.items():
        kernel_switches(**dataclasses.asdict(switches.Switches()))  # each path from the defaults
        cpu_native.reset()
        # A small token budget: chunked prefill mixed with decodes in the same steps.
        engine = make_engine(model_dir, max_num_batched_tokens=24, **fields)
        assert engine.generate(PROMPTS, params) == want, path
    cpu_native.reset()


def test_bf16_prefill_native_as_close_to_transformers_as_the_reference(head64_dirs, make_engine, monkeypatch,
                                                                       kernel_switches):
    """A bf16 model's prefill on the native path (attention on AMX tiles where the CPU has them; RMSNorm, rotary
    and SiLU-and-multiply in kernels/cpu_bf16_rows.c) against transformers in bf16, next to the torch reference
    path's own distance from it: bf16 rounds differently with every op order, so no closer bound is owed."""
    from transformers import AutoModelForCausalLM

    from kernels import cpu_lowp
    from tests.hosted.test_model_hf_parity import full_prompt_logits

    model_dir, _ = head64_dirs["llama"]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    prompt = PROMPTS[2] + PROMPTS[3]  # 66 tokens: a partial 16-token query block and 64-position key chunk
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    ran_on_tiles = []
    tiles = cpu_native._amx_prefill_attention

    def counted(*args):
        out = tiles(*args)
        ran_on_tiles.append(out is not None)
        return out

    monkeypatch.setattr(cpu_native, "_amx_prefill_attention", counted)
    distance = {}
    for path, fields in (("native", {}), ("reference", {"kernels": "reference"})):
        kernel_switches(**dataclasses.asdict(switches.Switches()))
        cpu_native.reset()
        logits = full_prompt_logits(make_engine(model_dir, dtype="bfloat16", **fields), prompt)
        agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
        distance[path] = ((logits - ref).abs().max().item(), agree)
    cpu_native.reset()
    has_tiles = bool(cpu_lowp.features() & cpu_lowp.FEATURE_AMX_BF16)
    assert ran_on_tiles and all(ran_on_tiles) == has_tiles  # the native path asked the tiles; they ran where present
    (native_err, native_agree), (ref_err, ref_agree) = distance["native"], distance["reference"]
    assert native_err <= 2 * max(ref_err, 1 / 128), distance  # (a bf16 ulp at the logits' size: 1/128)
    assert native_agree >= min(ref_agree, 0.95) - 0.05, distance
