"""Every Triton kernel against its plain-torch reference (and attention against a float64 dense formulation).

On CPU the kernels run under TRITON_INTERPRET=1 (set in conftest.py); shapes are kept small because the
interpreter is slow. Tolerances per dtype (absolute + relative, on outputs of magnitude ~1):
  fp32: kernel and reference both accumulate in fp32, differing only in summation order.
  fp16 / bf16: both round the same fp32 result to the output dtype, so they may differ by a rounding
  step (2^-11 resp. 2^-8 relative) where the fp32 values straddle a rounding boundary. (The interpreter
  converts fp32 -> bf16 by truncation rather than round-to-nearest: also within one step.)
  GPU attention in fp16/bf16 also rounds the softmax probabilities to the input dtype for tl.dot.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels import ops, reference, triton_common
from kernels import triton_ops as tk
from tests.kernels.conftest import KERNEL_TEST_DEVICE as DEV
from tests.kernels.paged_cases import cu_seqlens, dense_decode, dense_prefill, make_paged_kv

torch.set_num_threads(2)

TOL = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
GQA = [(2, 1), (1, 4), (1, 8)]  # (num_kv_heads, query heads per kv head)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(got.double().cpu(), want.double().cpu(), **TOL[dtype])


def _to_dev(*ts):
    return [t.to(DEV) for t in ts]


# --------------------------------------------------------------------------- decode attention


def check_decode(dtype, num_kv_heads, group, block_size, lens, num_splits=None, seed=0):
    head_dim = 16
    kv = make_paged_kv(lens, num_kv_heads, head_dim, block_size, dtype, seed=seed)
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=torch.Generator().manual_seed(seed))
    q = q.to(dtype)
    scale = 1 / math.sqrt(head_dim)
    args = _to_dev(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens)
    got = tk.paged_decode_attention(*args, scale, num_splits=num_splits)
    want = reference.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, scale)
    assert got.dtype == dtype and got.shape == q.shape
    _close(got, want, dtype)
    _close(got, dense_decode(q, kv, scale), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_kv_heads,group", GQA)
def test_decode_attention(dtype, num_kv_heads, group):
    # Odd lengths, one 1-token sequence, shuffled non-contiguous blocks; block size varies with the case.
    block_size = {1: 16, 4: 4, 8: 8}[group]
    check_decode(dtype, num_kv_heads, group, block_size, [1, 7, 37, 18], seed=group)


@pytest.mark.parametrize("num_splits", [1, 3, 7])
def test_decode_attention_split_counts(num_splits):
    # 1 = the single-pass path (no merge kernel); 7 leaves some splits empty for the short sequences.
    check_decode(torch.bfloat16, 2, 4, 2, [5, 61, 33], num_splits=num_splits, seed=num_splits)


# --------------------------------------------------------------------------- prefill / extend attention

# (context_len incl. new tokens, new tokens): plain prefill, prefix hit, chunk continuation, 1-token extend.
PREFILL_CASES = [(9, 9), (21, 5), (32, 16), (7, 1)]


def check_prefill(dtype, num_kv_heads, group, block_size, cases, seed=0):
    head_dim = 8
    lens = [c for c, _ in cases]
    q_lens = [n for _, n in cases]
    kv = make_paged_kv(lens, num_kv_heads, head_dim, block_size, dtype, seed=seed)
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=torch.Generator().manual_seed(seed))
    q = q.to(dtype)
    cu = cu_seqlens(q_lens)
    args = _to_dev(q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.context_lens)
    got = tk.paged_prefill_attention(*args, 0.35)
    want = reference.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.context_lens, 0.35)
    assert got.dtype == dtype and got.shape == q.shape
    _close(got, want, dtype)
    _close(got, dense_prefill(q, q_lens, kv, 0.35), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_kv_heads,group", GQA)
def test_prefill_attention(dtype, num_kv_heads, group):
    check_prefill(dtype, num_kv_heads, group, {1: 4, 4: 8, 8: 16}[group], PREFILL_CASES, seed=group)


def test_prefill_attention_long_and_empty_sequences():
    # A sequence with zero new tokens in the batch, and one whose new tokens span several query tiles.
    check_prefill(torch.float32, 1, 2, 4, [(5, 0), (40, 37), (3, 3)], seed=7)


# --------------------------------------------------------------------------- int32 overflow in addressing


def _huge_cache_factory(tmp_path):
    """Caches whose high block ids put block_id * block_stride above 2^31 elements, without the memory.

    CPU: the caches are views into a sparse file mapped with torch.from_file: only the few blocks the
    test writes occupy memory. The views start 2^32 elements into the mapping, so an offset that wraps
    in int32 lands in the zero-filled pad (a wrong result) instead of unmapped memory (a crash).
    CUDA: a plain device allocation of the same size (~17 GB fp16).
    """

    def factory(num_blocks, shape_tail, dtype, gen):
        block_elems = math.prod(shape_tail)
        total_blocks = 2**31 // block_elems + 64
        pad = 2**32
        numel = pad + 2 * total_blocks * block_elems
        if DEV == "cpu":
            path = tmp_path / "huge_kv_cache.bin"
            with open(path, "wb") as fh:
                fh.truncate(numel * torch.empty(0, dtype=dtype).element_size())
            storage = torch.from_file(str(path), shared=True, size=numel, dtype=dtype)
        else:
            storage = torch.empty(numel, dtype=dtype, device=DEV)
        span = total_blocks * block_elems
        k_cache = storage[pad:pad + span].view(total_blocks, *shape_tail)
        v_cache = storage[pad + span:pad + 2 * span].view(total_blocks, *shape_tail)
        high = torch.randperm(60, generator=gen)[: num_blocks - 2] + (total_blocks - 60)
        order = [*high.tolist()[:3], 0, 1, *high.tolist()[3:]]  # high ids mixed with low ones
        assert max(order) * block_elems > 2**31
        for block in order:
            k_cache[block] = torch.randn(shape_tail, generator=gen).to(dtype)
            v_cache[block] = torch.randn(shape_tail, generator=gen).to(dtype)
        return k_cache, v_cache, order

    return factory


def test_addressing_beyond_int32(tmp_path):
    dtype = torch.float16
    lens, q_lens = [13, 22], [13, 4]
    kv = make_paged_kv(lens, 2, 8, 4, dtype, seed=3, cache_factory=_huge_cache_factory(tmp_path))
    assert kv.k_cache.shape[0] * kv.k_cache.stride(0) > 2**31
    q = torch.randn(len(lens), 4, 8).to(dtype)
    args = _to_dev(q, kv.block_tables, kv.context_lens)
    got = tk.paged_decode_attention(args[0], kv.k_cache, kv.v_cache, args[1], args[2], 0.3)
    _close(got, dense_decode(q, kv, 0.3), dtype)

    qp = torch.randn(sum(q_lens), 4, 8).to(dtype)
    cu = cu_seqlens(q_lens)
    got = tk.paged_prefill_attention(qp.to(DEV), kv.k_cache, kv.v_cache, args[1], cu.to(DEV), args[2], 0.3)
    _close(got, dense_prefill(qp, q_lens, kv, 0.3), dtype)

    # KV write into the highest blocks.
    block_size = kv.k_cache.shape[1]
    top = kv.k_cache.shape[0] - 1
    slots = torch.tensor([top * block_size + 3, (top - 5) * block_size, -1], dtype=torch.int64)
    key = torch.randn(3, 2, 8).to(dtype)
    value = torch.randn(3, 2, 8).to(dtype)
    tk.store_kv(key.to(DEV), value.to(DEV), kv.k_cache, kv.v_cache, slots.to(DEV))
    assert torch.equal(kv.k_cache[top, 3].cpu(), key[0])
    assert torch.equal(kv.v_cache[top - 5, 0].cpu(), value[1])


# --------------------------------------------------------------------------- KV-cache write


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv(dtype):
    num_blocks, block_size, heads, head_dim = 6, 4, 3, 8
    k_cache = torch.zeros(num_blocks, block_size, heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    # key/value as strided views of a fused qkv projection, as the engine produces them.
    qkv = torch.randn(5, 4 * heads, head_dim).to(dtype)
    key, value = qkv[:, 2 * heads:3 * heads], qkv[:, 3 * heads:]
    slots = torch.tensor([23, -1, 0, 9, 14])
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, want_k, want_v, slots)
    k_dev, v_dev = _to_dev(k_cache, v_cache)
    tk.store_kv(*_to_dev(key, value), k_dev, v_dev, slots.to(DEV))
    assert torch.equal(k_dev.cpu(), want_k) and torch.equal(v_dev.cpu(), want_v)
    assert int((want_k != 0).any(-1).any(-1).sum()) == 4


# --------------------------------------------------------------------------- RMSNorm / rotary


RMS_HIDDEN = 1024


def check_rms_norm(dtype, with_residual):
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(5, RMS_HIDDEN, generator=gen) * 2).to(dtype)
    res = torch.randn(5, RMS_HIDDEN, generator=gen).to(dtype)
    w = torch.randn(RMS_HIDDEN, generator=gen).to(dtype)
    if with_residual:
        got_out, got_res = tk.rms_norm(*_to_dev(x, w), 1e-5, residual=res.to(DEV))
        want_out, want_res = reference.rms_norm(x, w, 1e-5, residual=res)
        if DEV == "cpu" and dtype == torch.bfloat16:
            # The interpreter converts fp32 -> bf16 by truncation (compiled Triton rounds to nearest).
            _close(got_res, want_res, dtype)
        else:
            assert torch.equal(got_res.cpu(), want_res)  # x + residual rounded once, same as torch
        _close(got_out, want_out, dtype)
    else:
        got = tk.rms_norm(*_to_dev(x, w), 1e-5)
        assert got.dtype == dtype
        _close(got, reference.rms_norm(x, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, with_residual):
    check_rms_norm(dtype, with_residual)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}


def check_rotary(dtype, scaling):
    gen = torch.Generator().manual_seed(2)
    table = reference.rotary_cos_sin(32, 128, 500000.0, scaling)
    positions = torch.tensor([0, 3, 127, 31, 64, 5])
    q = torch.randn(6, 8, 32, generator=gen).to(dtype)
    k = torch.randn(6, 2, 32, generator=gen).to(dtype)
    got_q, got_k = tk.apply_rotary(*_to_dev(q, k, positions, table))
    want_q, want_k = reference.apply_rotary(q, k, positions, table)
    _close(got_q, want_q, dtype)
    _close(got_k, want_k, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["default", "llama3"])
def test_rotary(dtype, scaling):
    check_rotary(dtype, scaling)


# --------------------------------------------------------------------------- quantized matmuls


def check_int8(dtype, rows, with_bias=True):
    gen = torch.Generator().manual_seed(rows)
    w_q, scales = reference.quantize_int8(torch.randn(72, 192, generator=gen) * 0.05)
    x = torch.randn(rows, 192, generator=gen).to(dtype)
    bias = torch.randn(72, generator=gen).to(dtype) if with_bias else None
    got = tk.int8_linear(*_to_dev(x, w_q, scales), bias.to(DEV) if with_bias else None)
    assert got.dtype == dtype and got.shape == (rows, 72)
    _close(got, reference.int8_linear(x, w_q, scales, bias), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 37, 130])  # GEMV path (<= 4 rows), tiled 64- and 128-row tiles
def test_int8_linear(dtype, rows):
    check_int8(dtype, rows, with_bias=rows != 3)


def check_int4(dtype, rows, group_size, symmetric):
    gen = torch.Generator().manual_seed(group_size + rows)
    w = torch.randn(40, 256, generator=gen) * 0.05
    packed, scales, zeros = reference.quantize_int4(w, group_size, symmetric)
    x = torch.randn(rows, 256, generator=gen).to(dtype)
    bias = torch.randn(40, generator=gen).to(dtype)
    got = tk.int4_linear(*_to_dev(x, packed, scales), None if zeros is None else zeros.to(DEV), group_size,
                         bias.to(DEV))
    assert got.dtype == dtype and got.shape == (rows, 40)
    _close(got, reference.int4_linear(x, packed, scales, zeros, group_size, bias), dtype)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("rows", [1, 20])
def test_int4_linear(group_size, symmetric, rows):
    check_int4(torch.bfloat16, rows, group_size, symmetric)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_int4_linear_other_dtypes(dtype):
    check_int4(dtype, 1, 64, False)
    check_int4(dtype, 9, 32, True)


def test_int4_linear_many_rows():
    check_int4(torch.bfloat16, 130, 128, False)


# --------------------------------------------------------------------------- bf16 upcast guard

# The interpreter computes bf16 arithmetic wrongly. With the kernels' fp32 upcast switched off, the same
# checks that pass above must fail: proof that the tests would catch a kernel doing math in bf16.
NO_UPCAST_CASES = {
    "rms_norm": lambda: check_rms_norm(torch.bfloat16, True),
    "rotary": lambda: check_rotary(torch.bfloat16, LLAMA3),
    "decode": lambda: check_decode(torch.bfloat16, 1, 4, 4, [7, 37]),
    "prefill": lambda: check_prefill(torch.bfloat16, 1, 4, 4, PREFILL_CASES[:2]),
    "int8_gemv": lambda: check_int8(torch.bfloat16, 1),
    "int8_mm": lambda: check_int8(torch.bfloat16, 37),
    "int4_gemv": lambda: check_int4(torch.bfloat16, 1, 32, False),
    "int4_mm": lambda: check_int4(torch.bfloat16, 20, 64, True),
}


@pytest.mark.skipif(DEV != "cpu", reason="the bf16 miscomputation is a property of the CPU interpreter")
@pytest.mark.parametrize("case", sorted(NO_UPCAST_CASES))
def test_non_upcasting_kernels_fail_the_bf16_checks(case, monkeypatch):
    monkeypatch.setattr(triton_common, "UPCAST", False)
    with pytest.raises(AssertionError):
        NO_UPCAST_CASES[case]()


def test_bf16_tolerance_rejects_bf16_accumulation():
    # On a GPU a kernel that accumulated in bf16 would compute "correctly" but imprecisely; the bf16
    # tolerance above is tight enough to reject that too. Emulate bf16 accumulation for the int8 GEMV
    # (K=192) and the RMSNorm sum of squares (H=1024) on the same data as the tests, and show it fails.
    gen = torch.Generator().manual_seed(1)
    w_q, scales = reference.quantize_int8(torch.randn(72, 192, generator=gen) * 0.05)
    x = torch.randn(1, 192, generator=gen).to(torch.bfloat16)
    acc = torch.zeros(72, dtype=torch.bfloat16)
    for k in range(192):
        acc = acc + x[0, k] * w_q[:, k].to(torch.bfloat16)
    emulated = (acc.float() * scales).to(torch.bfloat16)[None]
    with pytest.raises(AssertionError):
        _close(emulated, reference.int8_linear(x, w_q, scales), torch.bfloat16)

    x = (torch.randn(5, RMS_HIDDEN, generator=gen) * 2).to(torch.bfloat16)
    w = torch.randn(RMS_HIDDEN, generator=gen).to(torch.bfloat16)
    acc = torch.zeros(5, dtype=torch.bfloat16)
    for k in range(RMS_HIDDEN):
        acc = acc + x[:, k] * x[:, k]
    emulated = w * (x * torch.rsqrt(acc / RMS_HIDDEN + 1e-5)[:, None])
    with pytest.raises(AssertionError):
        _close(emulated, reference.rms_norm(x, w, 1e-5), torch.bfloat16)


# --------------------------------------------------------------------------- dispatch


def test_ops_forced_to_triton_runs_the_kernels(monkeypatch, kernel_switches):
    kernel_switches(kernels="triton")
    x = torch.randn(3, 64).to(DEV)
    assert ops.active_backend(x) == "triton"
    w = torch.randn(64).to(DEV)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6).cpu(), reference.rms_norm(x.cpu(), w.cpu(), 1e-6),
                               atol=2e-5, rtol=2e-5)
    # With the upcast off, the forced path visibly changes bf16 results: the call really went to Triton.
    monkeypatch.setattr(triton_common, "UPCAST", False)
    xb, wb = x.bfloat16(), w.bfloat16()
    if DEV == "cpu":
        assert not torch.allclose(ops.rms_norm(xb, wb, 1e-6).float(), reference.rms_norm(xb, wb, 1e-6).float(),
                                  atol=0.1)
