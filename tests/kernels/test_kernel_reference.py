"""The plain-torch references (the engine's CPU path) against naive/dense and Hugging Face formulations."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from kernels import ops, reference
from tests.kernels.paged_cases import cu_seqlens, dense_decode, dense_prefill, make_paged_kv

torch.set_num_threads(2)

# Reference math is fp32; the dense check is float64. Output is rounded to the input dtype.
ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,group", [(2, 1), (2, 4), (1, 8)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_matches_dense(dtype, num_kv_heads, group, block_size):
    lens = [1, 7, 33, 18]
    kv = make_paged_kv(lens, num_kv_heads, 16, block_size, dtype, seed=block_size + group)
    q = torch.randn(len(lens), num_kv_heads * group, 16).to(dtype)
    kv.block_tables[0, 1:] = 12345  # garbage past a sequence's blocks must be ignored
    out = reference.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.25)
    want = dense_decode(q, kv, 0.25)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), want, atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,group", [(2, 1), (1, 4), (2, 8)])
def test_prefill_with_cached_prefix_matches_dense(dtype, num_kv_heads, group):
    # (context_len, new tokens): plain prefill, prefix hits, chunked continuation, a single-token extend.
    cases = [(9, 9), (21, 5), (32, 16), (7, 1)]
    lens = [c for c, _ in cases]
    q_lens = [n for _, n in cases]
    kv = make_paged_kv(lens, num_kv_heads, 8, 4, dtype, seed=group)
    q = torch.randn(sum(q_lens), num_kv_heads * group, 8).to(dtype)
    out = reference.paged_prefill_attention(
        q, kv.k_cache, kv.v_cache, kv.block_tables, cu_seqlens(q_lens), kv.context_lens, 0.3
    )
    torch.testing.assert_close(out.double(), dense_prefill(q, q_lens, kv, 0.3), atol=ATOL[dtype], rtol=0)


def test_store_kv_scatters_and_skips_negative_slots():
    k_cache = torch.zeros(5, 4, 2, 3)
    v_cache = torch.zeros(5, 4, 2, 3)
    key = torch.randn(4, 2, 3)
    value = torch.randn(4, 2, 3)
    slots = torch.tensor([13, -1, 0, 6])
    reference.store_kv(key, value, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache[3, 1], key[0])
    torch.testing.assert_close(v_cache[0, 0], value[2])
    torch.testing.assert_close(k_cache[1, 2], key[3])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 3  # the skipped token wrote nothing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_matches_hf(dtype):
    hf = LlamaRMSNorm(48, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(48))
    hf = hf.to(dtype)
    x = (torch.randn(5, 48) * 3).to(dtype)
    res = torch.randn(5, 48).to(dtype)
    torch.testing.assert_close(reference.rms_norm(x, hf.weight, 1e-5), hf(x), atol=0, rtol=0)
    out, new_res = reference.rms_norm(x, hf.weight, 1e-5, residual=res)
    torch.testing.assert_close(new_res, x + res, atol=0, rtol=0)
    torch.testing.assert_close(out, hf(x + res), atol=0, rtol=0)


ROPE_CASES = [
    (10000.0, None),
    (10000.0, {"rope_type": "default"}),
    (10000.0, {"rope_type": "linear", "factor": 4.0}),
    (500000.0, {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}),
]


@pytest.mark.parametrize("base,scaling", ROPE_CASES)
def test_rotary_matches_hf(base, scaling):
    head_dim, max_pos = 32, 300
    params = {"rope_type": "default"} if scaling is None else {
        "rope_type": scaling.get("rope_type", scaling.get("type")), **scaling}
    params.pop("type", None)
    params["rope_theta"] = base
    cfg = LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                      max_position_embeddings=max_pos, rope_parameters=params)
    rope = LlamaRotaryEmbedding(cfg)
    positions = torch.tensor([0, 1, 17, 63, 64, 200, 299])
    q = torch.randn(len(positions), 4, head_dim)
    k = torch.randn(len(positions), 2, head_dim)
    cos, sin = rope(q, positions[None])
    # HF layout: [batch, heads, seq, dim]; unsqueeze_dim=1 broadcasts over heads.
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    table = reference.rotary_cos_sin(head_dim, max_pos, base, scaling)
    assert table.shape == (max_pos, head_dim) and table.dtype == torch.float32
    got_q, got_k = reference.apply_rotary(q, k, positions, table)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_rotary_rejects_unsupported_scaling():
    with pytest.raises(ValueError, match="unsupported rope scaling"):
        reference.rotary_cos_sin(16, 8, 10000.0, {"rope_type": "yarn", "factor": 2.0})


def test_int8_round_trip_and_linear():
    w = torch.randn(24, 64)
    w_q, scales = reference.quantize_int8(w)
    assert w_q.dtype == torch.int8 and scales.shape == (24,)
    # Round to nearest: error at most half a quantization step per channel.
    err = (reference.dequantize_int8(w_q, scales) - w).abs()
    assert bool((err <= scales[:, None] / 2 + 1e-6).all())
    x = torch.randn(3, 64)
    want = x.double() @ reference.dequantize_int8(w_q, scales).double().t()
    torch.testing.assert_close(reference.int8_linear(x, w_q, scales).double(), want, atol=1e-4, rtol=1e-5)
    bias = torch.randn(24)
    torch.testing.assert_close(ops.int8_linear(x, w_q, scales, bias), reference.int8_linear(x, w_q, scales, bias),
                               atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_round_trip(group_size, symmetric):
    w = torch.randn(8, 256) * torch.linspace(0.1, 3, 8)[:, None]
    packed, scales, zeros = reference.quantize_int4(w, group_size, symmetric)
    assert packed.dtype == torch.uint8 and packed.shape == (8, 128)
    assert scales.shape == (8, 256 // group_size)
    assert (zeros is None) == symmetric
    deq = reference.dequantize_int4(packed, scales, zeros, group_size)
    step = scales.repeat_interleave(group_size, dim=1)
    # Symmetric clamps at +7 steps, so the largest magnitude may be off by up to one step.
    bound = step * (1.0 if symmetric else 0.5) + 1e-6
    assert bool(((deq - w).abs() <= bound).all())


def test_int4_packing_layout():
    w = torch.zeros(1, 32)
    w[0, 0] = -1.0  # group min -> nibble 0
    w[0, 1] = 14.0  # group max -> nibble 15
    w[0, 2] = 4.0
    packed, scales, zeros = reference.quantize_int4(w, 32)
    assert float(scales[0, 0]) == pytest.approx(1.0)
    assert float(zeros[0, 0]) == 1.0
    assert int(packed[0, 0]) == 0x00 | (15 << 4)  # low nibble = k0, high nibble = k1
    assert int(packed[0, 1]) == (4 + 1) | (1 << 4)  # k2 -> 5, k3 (0.0) -> zero point 1
    assert reference.unpack_int4(packed)[0, :4].tolist() == [0, 15, 5, 1]


def test_int4_linear_and_bad_group():
    w = torch.randn(16, 128)
    packed, scales, zeros = reference.quantize_int4(w, 64)
    x = torch.randn(2, 128)
    want = x.double() @ reference.dequantize_int4(packed, scales, zeros, 64).double().t()
    torch.testing.assert_close(ops.int4_linear(x, packed, scales, zeros, 64).double(), want, atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="group_size"):
        reference.quantize_int4(w, 48)


def test_dispatch_modes(kernel_switches):
    x = torch.randn(2, 8)
    assert ops.active_backend(x) == "reference"
    kernel_switches(kernels="reference")
    assert ops.active_backend(x) == "reference"
    with pytest.raises(ValueError, match="SWITCHYARD_KERNELS"):
        kernel_switches(kernels="bogus")
