"""The compiled CPU kernels (kernels/cpu_native.py) against float64 dense formulations and torch, plus
their dispatch through kernels.ops and their fallbacks."""

from __future__ import annotations

import ast

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_native, ops, reference
from tests.kernels.native_setup import native_on, needs_compiler, torch_threads  # noqa: F401 - native_on: autouse
from tests.kernels.paged_cases import cu_seqlens, dense_decode, dense_prefill, make_paged_kv

torch.set_num_threads(2)

pytestmark = needs_compiler
ATOL = {torch.float32: 2e-5, torch.bfloat16: 1e-5}  # bf16 caches, fp32 queries and output




_OPENMP_PROBE = """
import torch
from kernels import cpu_native, ops
assert cpu_native.library() is not None, cpu_native.unavailable_reason()
assert ops.native_cpu_active(torch.zeros(1))
with open("/proc/self/maps") as fh:
    print(sorted({line.split()[-1] for line in fh if "libgomp" in line}))
"""


def test_builds_and_shares_torch_openmp_runtime():
    # In a fresh process: other libraries in the test process (scikit-learn) bring their own libgomp.
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _OPENMP_PROBE], capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr
    gomp = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert len(gomp) <= 1, gomp  # one OpenMP runtime: torch's


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
# head_dim 64 and 128 take the register-tiled paths (query-head tiles of 4 and 2, with remainders), others
# the generic one.
@pytest.mark.parametrize("num_kv_heads,group,head_dim",
                         [(2, 1, 16), (1, 4, 32), (1, 8, 16), (3, 3, 64), (1, 5, 64), (1, 8, 64), (2, 3, 128), (1, 2, 80)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_matches_dense(cache_dtype, num_kv_heads, group, head_dim, block_size):
    lens = [1, 7, 33, 18, 64]
    kv = make_paged_kv(lens, num_kv_heads, head_dim, block_size, cache_dtype, seed=block_size + group)
    q = torch.randn(len(lens), num_kv_heads * group, head_dim)
    kv.block_tables[0, 1:] = 12345  # garbage past a sequence's blocks is never read
    out = cpu_native.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.3)
    assert out is not None and out.dtype == torch.float32 and out.shape == q.shape
    torch.testing.assert_close(out.double(), dense_decode(q, kv, 0.3), atol=ATOL[cache_dtype], rtol=0)


def test_decode_sharp_softmax_and_underflow():
    # Large logits: most probabilities underflow to exactly 0 and the max dominates; still the dense answer.
    kv = make_paged_kv([40, 300], 2, 32, 16, torch.float32, seed=5)
    q = 4 * torch.randn(2, 4, 32)
    out = cpu_native.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 2.0)
    torch.testing.assert_close(out.double(), dense_decode(q, kv, 2.0), atol=2e-5, rtol=1e-5)


def test_decode_engine_layout_strided_q_and_zero_length():
    # The engine's caches are slices of one pool [layers, 2, blocks, block, Hkv, D]; q is a view of the
    # fused QKV projection (row stride larger than Hq * D); a sequence with no context gives zeros.
    layers, blocks, bs, hkv, d = 2, 12, 4, 2, 16
    pool = torch.randn(layers, 2, blocks, bs, hkv, d)
    k_cache, v_cache = pool[1, 0], pool[1, 1]
    qkv = torch.randn(3, (4 + 2 * hkv) * d)
    q = qkv[:, : 4 * d].view(3, 4, d)
    tables = torch.tensor([[3, 7, 1], [0, 0, 0], [11, 2, 0]], dtype=torch.int32)
    lens = torch.tensor([10, 0, 5], dtype=torch.int32)
    got = cpu_native.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25)
    want = reference.paged_decode_attention(q.contiguous(), k_cache, v_cache, tables, lens, 0.25)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    assert torch.equal(got[1], torch.zeros(4, d))


def test_decode_rejects_block_ids_outside_the_pool():
    kv = make_paged_kv([9], 1, 16, 4, torch.float32)
    kv.block_tables[0, 1] = kv.k_cache.shape[0]  # one past the end, inside the sequence's blocks
    q = torch.randn(1, 2, 16)
    with pytest.raises(ValueError, match="outside the pool"):
        cpu_native.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.3)
    with pytest.raises(ValueError, match="columns of block_tables"):
        cpu_native.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables[:, :1], kv.context_lens, 0.3)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [2, 4])
@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(1, 4, 32), (3, 3, 64)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_few_sequences_split_across_threads(cache_dtype, threads, num_kv_heads, group, head_dim, block_size):
    # Fewer sequences than threads: each (sequence, kv head) is cut into parts of its blocks, attended on
    # different threads and merged -- including parts with no blocks (short sequences) and a zero length.
    with torch_threads(threads):
        for lens in ([1], [5], [block_size + 1], [300], [200, 3], [0, 77]):
            kv = make_paged_kv(lens, num_kv_heads, head_dim, block_size, cache_dtype, seed=len(lens) + lens[0])
            q = 3 * torch.randn(len(lens), num_kv_heads * group, head_dim)  # sharp: most parts weigh ~0
            out = cpu_native.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.5)
            torch.testing.assert_close(out.double(), dense_decode(q, kv, 0.5), atol=ATOL[cache_dtype] * 2,
                                       rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(2, 1, 16), (1, 4, 32), (3, 3, 64), (2, 3, 128)])
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_matches_dense(cache_dtype, num_kv_heads, group, head_dim, threads):
    # (context length, new tokens): plain prefill, a prefix hit, a chunked continuation, a one-token extend,
    # a sequence with nothing new this step, and a long one.
    cases = [(9, 9), (21, 5), (48, 16), (7, 1), (12, 0), (300, 300)]
    lens, q_lens = [c for c, _ in cases], [n for _, n in cases]
    kv = make_paged_kv(lens, num_kv_heads, head_dim, 16, cache_dtype, seed=head_dim + group)
    q = 2 * torch.randn(sum(q_lens), num_kv_heads * group, head_dim)
    with torch_threads(threads):
        args = (q, kv.k_cache, kv.v_cache, kv.block_tables, cu_seqlens(q_lens), kv.context_lens, 0.3)
        out = cpu_native.paged_prefill_attention(*args)
        via_ops = ops.select("cpu").paged_prefill_attention(*args)  # the engine's CPU backend takes it
    assert out is not None and out.shape == q.shape and torch.equal(via_ops, out)
    torch.testing.assert_close(out.double(), dense_prefill(q, q_lens, kv, 0.3), atol=ATOL[cache_dtype] * 2,
                               rtol=1e-5)


def _amx_tiles(on: bool, kernel_switches) -> None:
    """AMX tiles on (skips where the CPU or the OS has none) or off, for the kernels built next."""
    from kernels import cpu_lowp

    kernel_switches(cpu_amx=on)
    cpu_native.reset()
    if on and not cpu_lowp.features() & cpu_lowp.FEATURE_AMX_BF16:
        pytest.skip("no AMX-BF16 tiles on this CPU / OS")


@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(3, 3, 64), (1, 4, 32), (2, 2, 128), (1, 1, 96)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_bf16_on_amx_tiles_matches_dense(num_kv_heads, group, head_dim, block_size, threads, monkeypatch,
                                                 kernel_switches):
    # bf16 q over a bf16 cache goes to the tile kernel (bf16 out). Cases as above plus chunk edges (64, 65
    # positions), a prefix longer than a key chunk, and NaN in the slots past every sequence's length: they
    # share blocks with real rows and must never reach an output.
    _amx_tiles(True, kernel_switches)
    cases = [(9, 9), (21, 5), (48, 16), (7, 1), (12, 0), (300, 300), (64, 64), (65, 33), (200, 17)]
    lens, q_lens = [c for c, _ in cases], [n for _, n in cases]
    kv = make_paged_kv(lens, num_kv_heads, head_dim, block_size, torch.bfloat16, seed=head_dim + block_size)
    for b, n in enumerate(lens):
        last = int(kv.block_tables[b, (n - 1) // block_size])
        kv.k_cache[last, (n - 1) % block_size + 1:] = float("nan")
        kv.v_cache[last, (n - 1) % block_size + 1:] = float("nan")
    q = (2 * torch.randn(sum(q_lens), num_kv_heads * group, head_dim)).bfloat16()
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, cu_seqlens(q_lens), kv.context_lens, 0.3)
    with torch_threads(threads):
        out = cpu_native.paged_prefill_attention(*args)
        via_ops = ops.select("cpu").paged_prefill_attention(*args)
    assert out is not None and out.dtype == torch.bfloat16 and out.shape == q.shape and torch.equal(via_ops, out)
    dense = dense_prefill(q.float(), q_lens, kv, 0.3)
    # the probabilities meet V rounded to bf16 (as torch's bf16 flash attention rounds them), the output is bf16
    torch.testing.assert_close(out.double(), dense, atol=1e-2, rtol=1e-2)
    monkeypatch.setattr(cpu_native, "AMX_PREFILL_SCRATCH_BYTES", 300 * num_kv_heads * head_dim * 2)
    with torch_threads(threads):  # V^T scratch for ~one sequence: the batch goes through in several calls
        assert torch.equal(cpu_native.paged_prefill_attention(*args), out)
    _amx_tiles(False, kernel_switches)  # the fp32 kernel on the same inputs: the same answer within that rounding
    plain = cpu_native.paged_prefill_attention(*args)
    assert plain is not None and torch.isfinite(plain.float()).all()
    torch.testing.assert_close(out.float(), plain.float(), atol=1e-2, rtol=1e-2)


def test_prefill_bf16_on_amx_tiles_rejects_bad_tables_and_leaves_other_shapes(kernel_switches):
    _amx_tiles(True, kernel_switches)
    kv = make_paged_kv([40, 20], 1, 32, 16, torch.bfloat16)
    q = torch.randn(60, 2, 32).bfloat16()
    tables = kv.block_tables.clone()
    tables[0, 2] = kv.k_cache.shape[0]
    with pytest.raises(ValueError, match="outside the pool"):
        cpu_native.paged_prefill_attention(q, kv.k_cache, kv.v_cache, tables, cu_seqlens([40, 20]), kv.context_lens,
                                           0.3)
    # block_size 4 holds fewer rows than a tile: the fp32 kernel serves it (fp32 out, cast back to bf16)
    small = make_paged_kv([10], 1, 32, 4, torch.bfloat16)
    q10 = torch.randn(10, 2, 32).bfloat16()
    out = cpu_native.paged_prefill_attention(q10, small.k_cache, small.v_cache, small.block_tables,
                                             cu_seqlens([10]), small.context_lens, 0.3)
    torch.testing.assert_close(out.double(), dense_prefill(q10.float(), [10], small, 0.3), atol=1e-2, rtol=1e-2)


def test_prefill_rejects_bad_tables_and_lengths():
    kv = make_paged_kv([9, 5], 1, 16, 4, torch.float32)
    q = torch.randn(6, 2, 16)
    cu = cu_seqlens([3, 3])
    tables = kv.block_tables.clone()
    tables[1, 0] = kv.k_cache.shape[0]
    with pytest.raises(ValueError, match="outside the pool"):
        cpu_native.paged_prefill_attention(q, kv.k_cache, kv.v_cache, tables, cu, kv.context_lens, 0.3)
    with pytest.raises(ValueError, match="more new tokens"):
        cpu_native.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, cu_seqlens([3, 3]),
                                           torch.tensor([9, 2], dtype=torch.int32), 0.3)
    with pytest.raises(ValueError, match="spans"):
        cpu_native.paged_prefill_attention(q[:5], kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.context_lens, 0.3)


def test_decode_same_result_on_one_and_two_threads():
    kv = make_paged_kv([50, 3, 120, 17], 2, 32, 16, torch.float32, seed=2)
    q = torch.randn(4, 4, 32)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.2)
    with torch_threads(1):
        one = cpu_native.paged_decode_attention(*args)
    with torch_threads(2):
        two = cpu_native.paged_decode_attention(*args)
    assert torch.equal(one, two)


def test_unsupported_shapes_fall_back_to_the_reference():
    kv = make_paged_kv([5, 9], 1, 8, 4, torch.float32)  # head_dim 8: not a multiple of 16
    q = torch.randn(2, 2, 8)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.3)
    assert cpu_native.paged_decode_attention(*args) is None
    torch.testing.assert_close(ops.paged_decode_attention(*args).double(), dense_decode(q, kv, 0.3), atol=2e-5,
                               rtol=0)
    kv16 = make_paged_kv([5, 9], 1, 16, 4, torch.float16)  # fp16 caches: reference only
    q16 = torch.randn(2, 2, 16).half()
    assert cpu_native.paged_decode_attention(q16, kv16.k_cache, kv16.v_cache, kv16.block_tables,
                                             kv16.context_lens, 0.3) is None


def test_rotary_and_store_kv_match_the_reference():
    # q/k/v as the engine makes them: views of one fused projection (row stride > heads * head_dim).
    tokens, hq, hkv, d = 5, 4, 2, 16
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d)
    q = qkv[:, : hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d: (hq + hkv) * d].view(tokens, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(tokens, hkv, d)
    cos_sin = reference.rotary_cos_sin(d, 64, 10000.0, None)
    positions = torch.tensor([0, 3, 63, 7, 7])
    got = cpu_native.apply_rotary(q, k, positions, cos_sin)
    want = reference.apply_rotary(q, k, positions, cos_sin)
    assert got is not None
    torch.testing.assert_close(got[0], want[0], atol=0, rtol=0)  # same fp32 operations, no FMA contraction
    torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)
    with pytest.raises(IndexError):
        cpu_native.apply_rotary(q, k, torch.tensor([0, 1, 64, 2, 3]), cos_sin)
    qb, kb = qkv.bfloat16()[:, : hq * d].view(tokens, hq, d), qkv.bfloat16()[:, hq * d: (hq + hkv) * d].view(tokens, hkv, d)
    got_bf16 = cpu_native.apply_rotary(qb, kb, positions, cos_sin)  # bf16: fp32 math, rounded once at the end
    want_bf16 = reference.apply_rotary(qb, kb, positions, cos_sin)
    assert got_bf16 is not None and got_bf16[0].dtype == torch.bfloat16
    assert torch.equal(got_bf16[0], want_bf16[0]) and torch.equal(got_bf16[1], want_bf16[1])

    pool = torch.zeros(2, 2, 6, 4, hkv, d)  # [layers, k/v, blocks, block, Hkv, D]
    want_k, want_v = pool[1, 0].clone(), pool[1, 1].clone()
    slots = torch.tensor([9, -1, 0, 23, 5])
    assert cpu_native.store_kv(k, v, pool[1, 0], pool[1, 1], slots)
    reference.store_kv(k, v, want_k, want_v, slots)
    assert torch.equal(pool[1, 0], want_k) and torch.equal(pool[1, 1], want_v)
    assert not pool[0].any()  # the other layer is untouched
    rotated_k = got[1]  # as in the engine: k is the rotary output (contiguous), v still a view of the QKV row
    assert rotated_k.stride() != v.stride()
    assert cpu_native.store_kv(rotated_k, v, pool[1, 0], pool[1, 1], slots)
    reference.store_kv(rotated_k, v, want_k, want_v, slots)
    assert torch.equal(pool[1, 0], want_k) and torch.equal(pool[1, 1], want_v)
    with pytest.raises(IndexError):
        cpu_native.store_kv(k, v, pool[1, 0], pool[1, 1], torch.tensor([0, 1, 24, 2, 3]))
    assert not cpu_native.store_kv(k.bfloat16(), v.bfloat16(), pool[1, 0].bfloat16(), pool[1, 1].bfloat16(), slots)


@pytest.mark.parametrize("tokens,hidden", [(1, 576), (5, 100), (64, 64)])
def test_rms_norm_matches_the_reference(tokens, hidden):
    wide = torch.randn(tokens, hidden + 8) * 3
    x = wide[:, :hidden]  # strided rows
    residual, weight = torch.randn(tokens, hidden), torch.randn(hidden)
    torch.testing.assert_close(cpu_native.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5),
                               atol=1e-6, rtol=1e-6)  # summation order of the mean only
    out, new_residual = cpu_native.rms_norm(x, weight, 1e-5, residual)
    want, want_residual = reference.rms_norm(x, weight, 1e-5, residual)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
    assert torch.equal(new_residual, want_residual)
    # bf16: rounded where the reference rounds (the sum, the normalised row, the product with the weight)
    xb, rb, wb = x.bfloat16(), residual.bfloat16(), weight.bfloat16()
    _assert_bf16_close(cpu_native.rms_norm(xb, wb, 1e-5), reference.rms_norm(xb, wb, 1e-5))
    out, new_residual = cpu_native.rms_norm(xb, wb, 1e-5, rb)
    want, want_residual = reference.rms_norm(xb, wb, 1e-5, rb)
    _assert_bf16_close(out, want)
    assert torch.equal(new_residual, want_residual) and new_residual.dtype == torch.bfloat16
    assert cpu_native.rms_norm(xb, weight, 1e-5) is None  # mixed dtypes: the reference


def _assert_bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 results the reference's but for rare one-ulp flips (an fp32 intermediate a last bit apart)."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    apart = got != want
    assert int(apart.sum()) <= max(1, want.numel() // 1000)
    ulp = want.float().abs().clamp(min=1e-30) * 2.0 ** -7
    assert bool(((got.float() - want.float()).abs() <= ulp)[apart].all())


def test_packed_linear_paths_match_torch():
    w, b = torch.randn(70, 48), torch.randn(70)
    packed = ops.prepack_linear(w, b)
    assert packed is not None
    for rows in (1, 2, 3, 9, 300):
        x = torch.randn(rows, 48)
        torch.testing.assert_close(ops.linear(x, w, b, packed), F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    x = torch.randn(48, 3).t()  # column-major input: copied for oneDNN
    torch.testing.assert_close(ops.linear(x, w, b, packed), F.linear(x, w, b), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("n", [1, 47, 48, 49, 130])
@pytest.mark.parametrize("k", [1, 33, 576])
@pytest.mark.parametrize("with_bias", [False, True])
def test_panel_gemm_matches_float64(n, k, with_bias):
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if with_bias else None
    packed = cpu_native.pack_linear(w, b)
    assert packed is not None and packed.panels is not None  # the native path, not oneDNN
    assert packed.extra_bytes == -(-n // cpu_native.PANEL_N) * cpu_native.PANEL_N * k * 4
    for rows in (1, 2, 7, 8, 9, 10, 64, 131, 1103):  # partial and whole 8-row tiles (1, 2: one pass); 1103: split rows
        x = torch.randn(rows, k, generator=gen)
        want = x.double() @ w.double().t() + (b.double() if b is not None else 0)
        got = packed.panel_gemm(x)  # the panels at every row count (an AVX2 build's packed(x) hands wide x to torch)
        assert got.shape == (rows, n) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, atol=1e-4 * max(1.0, k ** 0.5), rtol=1e-5)


def test_wide_inputs_take_torchs_gemm_where_the_panels_are_the_avx2_build():
    w, b = torch.randn(100, 64), torch.randn(100)
    packed = cpu_native.pack_linear(w, b)
    avx2 = cpu_native.library().sy_panel_vector_bits() == 256
    wide = torch.randn(cpu_native.AVX2_TORCH_MIN_ROWS, 64)
    narrow = wide[:cpu_native.AVX2_TORCH_MIN_ROWS - 1]
    torch.testing.assert_close(packed(wide), F.linear(wide, w, b), atol=1e-4, rtol=1e-5)
    # from the threshold: torch's own GEMM on an AVX2 build, the panels on any other
    assert torch.equal(packed(wide), F.linear(wide, w, b) if avx2 else packed.panel_gemm(wide))
    assert torch.equal(packed(narrow), packed.panel_gemm(narrow))  # below it: the panels, every build


def test_panel_gemm_strided_inputs_and_threads():
    w = torch.randn(200, 96)
    packed = cpu_native.pack_linear(w)
    wide = torch.randn(70, 300)
    x = wide[:, 100:196]  # row stride 300
    want = F.linear(x, w)
    torch.testing.assert_close(packed(x), want, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(packed(x.t().contiguous().t()), want, atol=1e-4, rtol=1e-5)  # column-major: copied
    with torch_threads(1):
        one = packed(x)
    assert torch.equal(one, packed(x))  # the thread split changes which panels a thread does, not the sums
    weight_t = torch.randn(96, 200).t()  # a column-major weight cannot be packed
    assert cpu_native.pack_linear(weight_t) is None


@pytest.mark.parametrize("tokens,inter", [(1, 1536), (5, 40), (300, 64)])
def test_silu_and_mul_matches_the_reference(tokens, inter):
    gen = torch.Generator().manual_seed(tokens + inter)
    wide = torch.randn(tokens, 2 * inter + 8, generator=gen) * 6
    wide[0, :6] = torch.tensor([0.0, -0.0, -100.0, 100.0, 1e-30, -1e-30])  # underflow, overflow, signed zero
    gate_up = wide[:, : 2 * inter]  # strided rows, as a view of a wider tensor
    got = cpu_native.silu_and_mul(gate_up)
    want = reference.silu_and_mul(gate_up)
    assert got is not None and got.shape == (tokens, inter)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=4e-7)  # a few ulp
    exact = reference.silu_and_mul(gate_up.double())
    torch.testing.assert_close(got.double(), exact, atol=1e-6, rtol=4e-7)
    assert torch.equal(ops.silu_and_mul(gate_up), got)
    gate_up_bf16 = gate_up.bfloat16()  # bf16: silu rounded, then the product rounded, as F.silu(gate) * up
    got_bf16 = cpu_native.silu_and_mul(gate_up_bf16)
    _assert_bf16_close(got_bf16, reference.silu_and_mul(gate_up_bf16))
    assert torch.equal(ops.silu_and_mul(gate_up_bf16), got_bf16)


def test_ops_dispatch_and_switches(kernel_switches):
    kv = make_paged_kv([21, 6], 1, 16, 4, torch.float32, seed=1)
    q = torch.randn(2, 2, 16)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.3)
    native = cpu_native.paged_decode_attention(*args)
    assert torch.equal(ops.paged_decode_attention(*args), native)
    kernel_switches(kernels="reference")  # forces the plain-torch reference
    assert not ops.native_cpu_active(q)
    assert torch.equal(ops.paged_decode_attention(*args), reference.paged_decode_attention(*args))
    kernel_switches(kernels="auto", cpu_native=False)
    cpu_native.reset()
    assert cpu_native.library() is None and not ops.native_cpu_active(q)
    assert cpu_native.paged_decode_attention(*args) is None
    torch.testing.assert_close(ops.paged_decode_attention(*args), native, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("k", [576, 100, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_torch(rows, k, with_bias):
    gen = torch.Generator().manual_seed(rows * k)
    w = torch.randn(130, k, generator=gen)
    b = torch.randn(130, generator=gen) if with_bias else None
    x = torch.randn(rows, k, generator=gen)
    got = cpu_native.linear(x, w, b)
    want = x.double() @ w.double().t() + (b.double() if b is not None else 0)
    assert got is not None and got.shape == (rows, 130)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ops.linear(x, w, b), got, atol=0, rtol=0)


def test_linear_strided_rows_and_fallbacks():
    w = torch.randn(64, 96)
    wide = torch.randn(2, 200)
    x = wide[:, 10:106]  # row stride 200, unit column stride
    torch.testing.assert_close(cpu_native.linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-5)
    assert cpu_native.linear(torch.randn(cpu_native.LINEAR_MAX_ROWS + 1, 96), w) is None  # MKL's GEMM wins
    assert cpu_native.linear(torch.randn(1, 96).bfloat16(), w.bfloat16()) is None
    assert cpu_native.linear(torch.randn(1, 96), w.t().contiguous().t()) is None  # column-major weight
    x5 = torch.randn(5, 96)
    torch.testing.assert_close(ops.linear(x5, w), F.linear(x5, w))


def test_builds_into_an_empty_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("SWITCHYARD_CACHE_DIR", str(tmp_path))
    cpu_native.reset()
    assert cpu_native.library() is not None, cpu_native.unavailable_reason()
    built = list((tmp_path / "kernels").glob("cpu_native-*.so"))
    assert len(built) == 1 and not list((tmp_path / "kernels").glob("*.so.*"))  # no temp file left behind


def test_without_a_compiler_everything_falls_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("SWITCHYARD_CACHE_DIR", str(tmp_path))
    cpu_native.reset()
    assert cpu_native.library() is None and "no-such-cc" in cpu_native.unavailable_reason()
    assert "native CPU kernels unavailable" in caplog.text
    kv = make_paged_kv([21, 6], 1, 16, 4, torch.float32, seed=1)
    q = torch.randn(2, 2, 16)
    got = ops.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.3)
    torch.testing.assert_close(got.double(), dense_decode(q, kv, 0.3), atol=2e-5, rtol=0)
    w, b = torch.randn(40, 32), torch.randn(40)
    packed = ops.prepack_linear(w, b)  # oneDNN only (or None without oneDNN)
    for rows in (1, 5):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(ops.linear(x, w, b, packed), F.linear(x, w, b), atol=1e-4, rtol=1e-5)
