"""A KV cache in another element type than the weights (EngineConfig.kv_cache_dtype, `--kv-cache-dtype`):
bf16 K/V beside fp32 weights holds twice the tokens in the same memory, and the model's outputs stay close to
the fp32 cache's. (Bit-equality of the native decode step and the per-op loop over a bf16 cache is in
test_engine_decode_step.py.)"""
from __future__ import annotations

import pytest
import torch

from hosted.engine import EngineConfig, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], list(range(40, 90))]


def _decode_logits(engine) -> list[torch.Tensor]:
    """Greedy continuations of PROMPTS; the logits of the first decode-only step, one row per prompt."""
    runner, seen = engine.runner, []
    execute = runner.execute

    def recording(batch, *args):
        logits, seqs = execute(batch, *args)
        if batch.num_decodes == len(batch.items) == len(PROMPTS) and not seen:
            seen.append(logits.clone())
        return logits, seqs

    runner.execute = recording
    tokens = engine.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    return tokens, seen[0]


def test_bf16_cache_holds_twice_the_blocks_in_the_same_memory(tiny_model_dirs, make_engine):
    fp32 = make_engine(tiny_model_dirs["llama"], num_kv_blocks=None, kv_cache_gb=0.002)
    bf16 = make_engine(tiny_model_dirs["llama"], num_kv_blocks=None, kv_cache_gb=0.002, kv_cache_dtype="bfloat16")
    assert fp32.runner.kv_cache.dtype == torch.float32 and bf16.runner.kv_cache.dtype == torch.bfloat16
    assert bf16.runner.num_blocks == 2 * fp32.runner.num_blocks
    assert bf16.runner.kv_cache.numel() * 2 == fp32.runner.kv_cache.numel() * 4
    # "auto" and the weights' own type are the default cache
    same = make_engine(tiny_model_dirs["llama"], kv_cache_dtype="float32")
    assert same.runner.kv_cache.dtype == torch.float32


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_bf16_cache_outputs_stay_close_to_the_fp32_cache(quantization, tiny_model_dirs, make_engine):
    kw = {"dtype": "float32", "quantization": quantization}
    want_tokens, want = _decode_logits(make_engine(tiny_model_dirs["llama"], **kw))
    tokens, got = _decode_logits(make_engine(tiny_model_dirs["llama"], kv_cache_dtype="bfloat16", **kw))
    # bf16 keeps 8 bits of mantissa: the cached K/V move by <= 2^-9 relatively, the logits by about as much
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert 0 < err < 0.02  # not bit-equal (the cache really is bf16), and close
    assert [t[0] for t in tokens] == [t[0] for t in want_tokens]  # the prefill's greedy token of each prompt


def test_kv_cache_dtype_is_checked():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, bfloat16"):
        EngineConfig(model_dir="x", kv_cache_dtype="fp8").validate()


def test_cli_passes_the_kv_cache_dtype():
    import argparse

    from hosted import cli
    from hosted.models import DEMO_MODEL_DIR

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["engine", "serve", "--model", DEMO_MODEL_DIR, "--kv-cache-dtype", "bfloat16",
                              "--num-kv-blocks", "8", "--device", "cpu"])
    engine, _ = cli.load_model(args)
    assert engine.engine.runner.kv_cache.dtype == torch.bfloat16
    with pytest.raises(SystemExit):
        parser.parse_args(["engine", "serve", "--model", "m", "--kv-cache-dtype", "int8"])
