"""The native decode step (kernels/cpu_decode.py: every layer of a decode-only step in one native call) against
the per-op layer loop it replaces, at every precision, batched, and its errors.

fp32 / int8 / int4 call the same kernels as the per-op loop, so their logits must be bit-identical; bf16 runs
fp32 activations over the bf16 weights and cache (the per-op loop keeps bf16 activations), so it is checked
against the fp32 model instead, and must be at least about as close to it as the per-op bf16 loop is.
"""
from __future__ import annotations

import pytest
import torch

from hosted.engine import SamplingParams
from kernels import cpu_lowp
from tests.kernels.native_setup import native_on, needs_compiler  # noqa: F401 (native_on: autouse fixture)

pytestmark = needs_compiler

PROMPTS = [[5, 6, 7, 8, 9], [3], [(i * 37) % 300 + 10 for i in range(45)], list(range(40, 61))]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PRECISIONS = {
    "fp32": {"dtype": "float32"},
    "int8": {"dtype": "float32", "quantization": "int8"},
    "int4": {"dtype": "float32", "quantization": "int4", "quantization_group_size": 32},
    # fp32 activations over a bf16 KV cache (--kv-cache-dtype bfloat16): the step rounds K/V as the per-op
    # loop's store does, and both read the cache through the same attention kernels
    "fp32-kv-bf16": {"dtype": "float32", "kv_cache_dtype": "bfloat16"},
    "int8-kv-bf16": {"dtype": "float32", "quantization": "int8", "kv_cache_dtype": "bfloat16"},
}
# What each precision's strips need from the CPU (AVX-512 VNNI / BF16, or AVX2 + FMA); fp32 panels need nothing.
NEEDS = {"fp32": 0, "int8": cpu_lowp.FEATURE_VNNI, "int4": cpu_lowp.FEATURE_VNNI, "bf16": cpu_lowp.FEATURE_BF16}


def _need(precision: str) -> None:
    precision = precision.removesuffix("-kv-bf16")
    if cpu_lowp.features() & NEEDS[precision] != NEEDS[precision]:
        pytest.skip(f"this CPU or compiler has no native {precision} kernels (the engine uses the torch reference)")


def _small_llama(directory, tied: bool) -> str:
    """SmolLM's attention shape in small: head_dim 64, three query heads per KV head, non-trivial norms."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(11)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=192, num_hidden_layers=3, num_attention_heads=6,
                                         num_key_value_heads=2, intermediate_size=320, vocab_size=320,
                                         max_position_embeddings=256, eos_token_id=None, bos_token_id=None,
                                         tie_word_embeddings=tied))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape))
    path = directory / "llama"
    model.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def head64_dir(tmp_path_factory):
    return _small_llama(tmp_path_factory.mktemp("decode_step"), tied=False)


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    """As head64_dir with the head tied to the embedding table (SmolLM2's)."""
    return _small_llama(tmp_path_factory.mktemp("decode_step_tied"), tied=True)


def _run(make_engine, model_dir: str, monkeypatch, native: bool, **kw):
    """Greedy continuations of PROMPTS and the logits of every decode-only step, in step order."""
    engine = make_engine(model_dir, max_num_batched_tokens=256, cpu_decode_step=native, **kw)
    assert (engine.runner.model.decode_step is not None) == native
    if native:  # the step runs the final norm and the head too, at every precision here
        assert engine.runner.model.decode_step.has_head
    runner, decode_logits = engine.runner, []
    execute = runner.execute

    def recording(batch, *args):
        logits, seqs = execute(batch, *args)
        if batch.num_decodes == len(batch.items) and logits is not None:
            decode_logits.append(logits.clone())
        return logits, seqs

    monkeypatch.setattr(runner, "execute", recording)
    return engine.generate(PROMPTS, PARAMS), decode_logits


@pytest.mark.parametrize("tied", [False, True], ids=["lm_head", "tied_head"])
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_native_step_equals_the_per_op_loop(precision, tied, head64_dir, tied_dir, make_engine, monkeypatch):
    """Layers, final norm and head (an lm_head, or the embedding table: int8 copies beside int8/int4 layers)."""
    _need(precision)
    model_dir = tied_dir if tied else head64_dir
    tokens, logits = _run(make_engine, model_dir, monkeypatch, True, **PRECISIONS[precision])
    want_tokens, want_logits = _run(make_engine, model_dir, monkeypatch, False, **PRECISIONS[precision])
    assert tokens == want_tokens
    assert len(logits) == len(want_logits) >= PARAMS.max_tokens - 1
    for got, want in zip(logits, want_logits):
        assert torch.equal(got, want)


def test_native_step_bf16_is_as_close_to_fp32_as_the_per_op_loop(head64_dir, make_engine, monkeypatch):
    _need("bf16")
    _, fp32 = _run(make_engine, head64_dir, monkeypatch, True, dtype="float32")
    _, native = _run(make_engine, head64_dir, monkeypatch, True, dtype="bfloat16")
    _, per_op = _run(make_engine, head64_dir, monkeypatch, False, dtype="bfloat16")
    # The first decode step sees the same (bf16 prefill) cache in both bf16 runs; later steps may diverge
    # in tokens, so compare that step only.
    scale = fp32[0].abs().max()
    native_err = (native[0] - fp32[0]).abs().max() / scale
    per_op_err = (per_op[0] - fp32[0]).abs().max() / scale
    assert native_err < 0.05
    assert native_err <= 1.5 * per_op_err + 1e-3


def test_native_step_is_off_without_packed_weights(head64_dir, make_engine, monkeypatch):
    engine = make_engine(head64_dir, cpu_packed_weights=False)
    assert engine.runner.model.decode_step is None  # the per-op loop serves it (checked by test_engine_cpu_paths)


def test_native_step_rejects_bad_inputs_before_writing(head64_dir, make_engine, monkeypatch):
    engine = make_engine(head64_dir, num_kv_blocks=8, cpu_decode_step=True)
    runner = engine.runner
    step = runner.model.decode_step
    hidden = torch.randn(2, 192)
    positions = torch.tensor([3, 4])
    slots = torch.tensor([3, 20])
    tables = torch.tensor([[0, 0], [1, 0]], dtype=torch.int32)
    lens = torch.tensor([4, 5], dtype=torch.int32)
    before = runner.kv_cache.clone()
    with pytest.raises(IndexError, match="rotary table"):
        step(hidden, torch.tensor([3, 10**6]), slots, tables, lens)
    with pytest.raises(IndexError, match="slot"):
        step(hidden, positions, torch.tensor([3, 8 * runner.block_size]), tables, lens)
    assert torch.equal(runner.kv_cache, before)
    with pytest.raises(ValueError, match="outside the pool"):
        step(hidden, positions, slots, torch.tensor([[0, 0], [99, 0]], dtype=torch.int32), lens)
    with pytest.raises(ValueError, match="more blocks"):
        step(hidden, positions, slots, tables, torch.tensor([4, 10 * runner.block_size], dtype=torch.int32))
    with pytest.raises(ValueError, match="do not match"):
        step(hidden, positions.int(), slots, tables, lens)
    with pytest.raises(IndexError, match="rotary table"):  # the same checks before the head's path writes
        step.logits(hidden, torch.tensor([3, 10**6]), slots, tables, lens)
    assert torch.equal(runner.kv_cache, before)
    out, residual = step(hidden, positions, slots, tables, lens)
    assert out.shape == residual.shape == (2, 192) and torch.isfinite(out).all()
    logits = step.logits(hidden, positions, slots, tables, lens)
    assert logits.shape == (2, 320) and torch.isfinite(logits).all()


def test_native_step_without_a_head_refuses_logits(head64_dir, make_engine, monkeypatch):
    """A head the kernels cannot take (here: left unpacked) leaves the plan without one: the layers still run
    natively, the model projects in Python, and asking the step for logits is refused."""
    engine = make_engine(head64_dir, max_num_batched_tokens=256, cpu_decode_step=True)
    model = engine.runner.model
    full = model.decode_step
    want = engine.generate(PROMPTS, PARAMS)
    model.lm_head.packed = None
    assert model.bind_decode_step(engine.runner.cos_sin)
    layers_only = model.decode_step
    assert full.has_head and not layers_only.has_head
    args = (torch.randn(1, 192), torch.tensor([0]), torch.tensor([0]), torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([1], dtype=torch.int32))
    with pytest.raises(ValueError, match="no head"):
        layers_only.logits(*args)
    assert torch.equal(layers_only(*args)[0], full(*args)[0])
    assert engine.generate(PROMPTS, PARAMS) == want  # fp32: the unpacked head gives the same greedy tokens


def test_native_step_on_an_engine_thread_beside_another_openmp_pool(head64_dir, make_engine, monkeypatch):
    """As a server runs it: the step on its own thread with 2 threads while another live thread keeps an OpenMP
    pool (libgomp then counts more threads than a 2-core machine has, and its own barriers stop spinning; the
    step's barriers are cpu_team.c's). Its logits must still equal the per-op loop's, step for step."""
    import threading

    want_tokens, want_logits = _run(make_engine, head64_dir, monkeypatch, False, **PRECISIONS["fp32"])
    release, pooled, got = threading.Event(), threading.Event(), {}

    def other_pool() -> None:
        torch.set_num_threads(2)
        a = torch.randn(512, 512)
        (a @ a).sum()  # a parallel region: this thread now owns a pool of its own
        pooled.set()
        release.wait(60)

    def engine_thread() -> None:
        torch.set_num_threads(2)
        got["run"] = _run(make_engine, head64_dir, monkeypatch, True, **PRECISIONS["fp32"])

    holder = threading.Thread(target=other_pool)
    holder.start()
    try:
        assert pooled.wait(60)
        worker = threading.Thread(target=engine_thread)
        worker.start()
        worker.join(120)
    finally:
        release.set()
        holder.join()
    tokens, logits = got["run"]
    assert tokens == want_tokens
    assert len(logits) == len(want_logits)
    for step_logits, want in zip(logits, want_logits):
        assert torch.equal(step_logits, want)
