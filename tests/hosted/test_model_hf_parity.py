"""Our Llama-family implementation against transformers on tiny random checkpoints.

Tolerances: fp32 logits within atol 1e-4 (the difference is summation order only); greedy
continuations equal transformers' generate(do_sample=False) token for token.
"""
from __future__ import annotations

import pytest
import torch

from hosted.engine import SamplingParams
from hosted.layers.attention import AttentionMetadata
from tests.hosted.conftest import EOS_PROMPT

KINDS = ["llama", "qwen2", "mistral", "llama3"]
PROMPTS = [
    [11, 12, 13, 14, 15],
    [3],
    list(range(40, 77)),  # crosses two 16-token blocks
    [(i * 37) % 300 + 10 for i in range(70)],  # positions past llama3's original 32-token context
]


def full_prompt_logits(engine, prompt: list[int]) -> torch.Tensor:
    """Every position's logits from one prefill of `prompt` through our model (blocks 0..n-1)."""
    runner = engine.runner
    n = len(prompt)
    nblk = -(-n // engine.config.block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, dtype=torch.int64),
        num_decode_tokens=0,
        decode_block_tables=None,
        decode_context_lens=None,
        prefill_block_tables=torch.arange(nblk, dtype=torch.int32)[None, :],
        prefill_cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        prefill_context_lens=torch.tensor([n], dtype=torch.int32),
    )
    with torch.inference_mode():
        return runner.model(torch.tensor(prompt), torch.arange(n), runner.cos_sin, meta, torch.arange(n))


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_logits_match_hf(kind, tiny_model_dirs, hf_models, make_engine):
    engine = make_engine(tiny_model_dirs[kind])
    hf = hf_models(kind)
    for prompt in PROMPTS:
        ours = full_prompt_logits(engine, prompt)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        assert ours.shape == ref.shape
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_matches_hf_generate(kind, tiny_model_dirs, hf_models, make_engine):
    engine = make_engine(tiny_model_dirs[kind])
    hf = hf_models(kind)
    max_new = 10
    ours = engine.generate(PROMPTS, SamplingParams(max_tokens=max_new, temperature=0.0))
    for prompt, got in zip(PROMPTS, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        ref_new = ref[0, len(prompt):].tolist()
        assert got == ref_new, f"{kind}: prompt of {len(prompt)} tokens diverged"


def test_qwen2_eos_stops_like_hf(tiny_model_dirs, hf_models, make_engine):
    """The Qwen2 checkpoint's EOS is the 4th greedy token after EOS_PROMPT; both stop there."""
    engine = make_engine(tiny_model_dirs["qwen2"])
    hf = hf_models("qwen2")
    assert engine.eos_token_ids == [hf.config.eos_token_id]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([EOS_PROMPT]), max_new_tokens=10, do_sample=False,
                          attention_mask=torch.ones(1, len(EOS_PROMPT), dtype=torch.long))
    ref_new = ref[0, len(EOS_PROMPT):].tolist()
    assert len(ref_new) <= 4 and ref_new[-1] == engine.eos_token_ids[0]
    # Our output includes the EOS token as its last token, exactly like transformers' generate.
    engine.add_request("r", EOS_PROMPT, SamplingParams(max_tokens=10, temperature=0.0))
    got, last = [], None
    while engine.has_unfinished():
        for out in engine.step():
            got += out.new_token_ids
            last = out
    assert got == ref_new
    assert last.finished and last.finish_reason == "stop"
    # ignore_eos runs on to max_tokens.
    assert len(engine.generate([EOS_PROMPT], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]) == 10


def test_bfloat16_cpu_close_to_hf(tiny_model_dirs, hf_models, make_engine):
    """bf16 rounds differently per op order, so only a loose bound and top-1 agreement on most rows."""
    engine = make_engine(tiny_model_dirs["llama"], dtype="bfloat16")
    hf = hf_models("llama", torch.bfloat16)
    prompt = PROMPTS[2]
    ours = full_prompt_logits(engine, prompt)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    assert (ours - ref).abs().max().item() < 0.1
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.9
