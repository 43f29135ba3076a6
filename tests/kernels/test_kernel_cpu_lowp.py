"""The native bf16 / int8 / int4 projections (kernels/cpu_lowp.py) against the torch reference (the dequantized
matmul) and against a float64 formulation of exactly what they compute (activations rounded per block of 32,
or to bf16), plus their dispatch through Linear.prepack and their fallbacks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_lowp, cpu_native, ops, reference
from tests.kernels.native_setup import native_on, needs_compiler, torch_threads  # noqa: F401 - native_on: autouse

torch.set_num_threads(2)

pytestmark = needs_compiler
SHAPES = [(1, 576, 576), (2, 48, 64), (3, 70, 96), (4, 1536, 576), (5, 576, 1536), (6, 80, 64), (9, 33, 128),
          (13, 50, 160), (64, 200, 576)]




def _need(feature: int) -> None:
    if cpu_lowp.features() & feature != feature:
        pytest.skip("this CPU or compiler lacks the instructions (the engine uses the torch reference)")


def _rounded_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels see it: int8 per block of 32 along K, scale = block max / 127, round half to even."""
    blocks = x.double().reshape(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(scale > 0, torch.round(blocks / torch.where(scale > 0, scale, 1)), 0).clamp(-127, 127)
    return (q * scale).reshape(x.shape)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_matches_float64_of_its_math_and_the_reference(m, n, k, with_bias):
    _need(cpu_lowp.FEATURE_VNNI)
    torch.manual_seed(m * 1000 + n + k)
    w, x = torch.randn(n, k), torch.randn(m, k)
    bias = torch.randn(n) if with_bias else None
    q, s = reference.quantize_int8(w)
    got = cpu_lowp.make_int8(q, s, bias)(x)
    assert got.shape == (m, n) and got.dtype == torch.float32
    exact = _rounded_activations(x) @ reference.dequantize_int8(q, s).double().t()
    if bias is not None:
        exact += bias.double()
    assert _rel(got, exact) < 2e-6  # fp32 sums of exact integer dot products
    # The dequantized matmul (fp32 activations): activation rounding only, ~1/254 of a block's max.
    assert _rel(got, reference.int8_linear(x, q, s, bias)) < 0.02


@pytest.mark.parametrize("m,n,k,group_size", [(*shape, g) for shape in SHAPES for g in (32, 64, 128)
                                               if shape[2] % g == 0])
@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_matches_float64_of_its_math_and_the_reference(m, n, k, group_size, symmetric):
    _need(cpu_lowp.FEATURE_VNNI)
    torch.manual_seed(m * 1000 + n + k + group_size)
    w, x, bias = torch.randn(n, k), torch.randn(m, k), torch.randn(n)
    packed, scales, zeros = reference.quantize_int4(w, group_size, symmetric)
    got = cpu_lowp.make_int4(packed, scales, zeros, group_size, bias)(x)
    # The kernel keeps scales and zero points as fp16 (GGUF's Q4 blocks store them so; here one rounding).
    half = scales.half().float(), zeros.half().float() if zeros is not None else None
    deq = reference.dequantize_int4(packed, *half, group_size).double()
    exact = _rounded_activations(x) @ deq.t() + bias.double()
    assert _rel(got, exact) < 5e-6
    assert _rel(got, reference.int4_linear(x, packed, scales, zeros, group_size, bias)) < 0.02


# bf16 adds: partial groups of 4 strips (N 70, 200), partial 16-row AMX tiles (M 17, 33), K not a multiple of 32
# (AMX leaves it to the strips), more rows than an AMX row chunk (300 > 256)
BF16_SHAPES = [*SHAPES, (17, 70, 96), (33, 200, 64), (20, 40, 50), (300, 100, 96)]


@pytest.fixture(params=[False, True], ids=["strips", "amx"])
def amx(request, kernel_switches):
    """The bf16 kernels with AMX tiles off (the AVX512-BF16 / AVX2 strips) and on (where the CPU has them)."""
    kernel_switches(cpu_amx=request.param)
    cpu_native.reset()
    if request.param:
        _need(cpu_lowp.FEATURE_AMX_BF16)
    else:
        assert not cpu_lowp.features() & cpu_lowp.FEATURE_AMX_BF16
    return request.param


@pytest.mark.parametrize("m,n,k", BF16_SHAPES)
def test_bf16_matches_float64_and_torch(m, n, k, amx):
    _need(cpu_lowp.FEATURE_BF16)
    torch.manual_seed(m + n + k)
    w, x, bias = torch.randn(n, k).bfloat16(), torch.randn(m, k), torch.randn(n)
    strips = cpu_lowp.make_bf16(w, bias)
    exact = x.bfloat16().double() @ w.double().t() + bias.double()
    got = strips(x)  # fp32 in: rounded to bf16, fp32 out
    assert got.dtype == torch.float32 and _rel(got, exact) < 2e-6
    got_bf16 = strips(x.bfloat16())  # a bf16 model: bf16 in and out
    assert got_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(got_bf16, F.linear(x.bfloat16(), w, bias.bfloat16()), rtol=2e-2, atol=2e-2)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


@pytest.mark.parametrize("march,features", [("x86-64-v3", 3), ("x86-64-v2", 0)])
def test_each_instruction_set_build_matches_the_reference(march, features, kernel_switches):
    """Builds for other targets than this machine's -march=native: x86-64-v3 (what a machine without AVX-512
    runs: the AVX2 strip GEMMs, panel tile and attention tiles) and x86-64-v2 (no strip kernels: the torch
    reference serves the low-precision layers)."""
    if "avx2" not in _cpu_flags() or "fma" not in _cpu_flags():
        pytest.skip("this CPU cannot run the x86-64-v3 build")
    kernel_switches(cpu_march=march)
    cpu_native.reset()
    assert cpu_lowp.features() == features
    torch.manual_seed(5)
    for m, n, k in [(1, 576, 576), (5, 70, 96), (13, 50, 160)]:
        w, x, bias = torch.randn(n, k), torch.randn(m, k), torch.randn(n)
        q, s = reference.quantize_int8(w)
        int8 = cpu_lowp.make_int8(q, s, bias)
        packed, scales, zeros = reference.quantize_int4(w, 32)
        int4 = cpu_lowp.make_int4(packed, scales, zeros, 32, bias)
        bf16 = cpu_lowp.make_bf16(w.bfloat16(), bias)
        if not features:
            assert int8 is None and int4 is None and bf16 is None
            continue
        exact8 = _rounded_activations(x) @ reference.dequantize_int8(q, s).double().t() + bias.double()
        assert _rel(int8(x), exact8) < 2e-6
        deq4 = reference.dequantize_int4(packed, scales.half().float(), zeros.half().float(), 32).double()
        assert _rel(int4(x), _rounded_activations(x) @ deq4.t() + bias.double()) < 5e-6
        exact16 = x.bfloat16().double() @ w.bfloat16().double().t() + bias.double()
        assert _rel(bf16(x), exact16) < 2e-6
    # the fp32 panel GEMM and decode / prefill attention, whose register tiles differ per target
    lib = cpu_native.library()
    w, x, bias = torch.randn(100, 96), torch.randn(13, 96), torch.randn(100)
    assert _rel(cpu_native.PackedLinear(w, bias, lib)(x), x.double() @ w.double().t() + bias.double()) < 1e-5
    k_cache, v_cache = torch.randn(12, 16, 2, 64), torch.randn(12, 16, 2, 64)
    tables, lens = torch.tensor([[3, 7, 1, 0], [5, 2, 9, 11]], dtype=torch.int32), torch.tensor([50, 17], dtype=torch.int32)
    q = torch.randn(2, 6, 64)
    want = reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    torch.testing.assert_close(cpu_native.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125), want,
                               rtol=1e-4, atol=1e-5)
    qp, cu = torch.randn(20, 6, 64), torch.tensor([0, 12, 20], dtype=torch.int32)
    want = reference.paged_prefill_attention(qp, k_cache, v_cache, tables, cu, lens, 0.125)
    torch.testing.assert_close(cpu_native.paged_prefill_attention(qp, k_cache, v_cache, tables, cu, lens, 0.125),
                               want, rtol=1e-4, atol=1e-5)


def test_strided_rows_threads_and_empty_input():
    _need(cpu_lowp.FEATURE_VNNI)
    torch.manual_seed(3)
    w = torch.randn(300, 128)
    q, s = reference.quantize_int8(w)
    strips = cpu_lowp.make_int8(q, s)
    base = torch.randn(40, 256)
    x = base[:, :128]  # row stride 256
    want = strips(x.contiguous())
    torch.testing.assert_close(strips(x), want, rtol=0, atol=0)
    with torch_threads(1):
        one = strips(x)
    torch.testing.assert_close(one, want, rtol=0, atol=0)  # each output is one sum, whatever the split
    assert strips(torch.empty(0, 128)).shape == (0, 300)
    with pytest.raises(ValueError, match="128"):
        strips(torch.randn(2, 64))


def test_shapes_the_kernels_do_not_take_fall_back():
    q, s = reference.quantize_int8(torch.randn(16, 40))  # K not a multiple of 32
    assert cpu_lowp.make_int8(q, s) is None
    assert cpu_lowp.make_bf16(torch.randn(16, 41).bfloat16()) is None  # odd K: no bf16 pairs
    packed, scales, zeros = reference.quantize_int4(torch.randn(16, 64), 32)
    assert cpu_lowp.make_int4(packed.to(torch.int16), scales, zeros, 32) is None  # not packed nibbles


def test_disabled_native_library_gives_no_strips(kernel_switches):
    kernel_switches(cpu_native=False)
    cpu_native.reset()
    assert cpu_lowp.features() == 0
    q, s = reference.quantize_int8(torch.randn(32, 64))
    assert cpu_lowp.make_int8(q, s) is None
    assert ops.CPU.prepack_int8(q, s, None) is None
    assert cpu_lowp.make_bf16(torch.randn(32, 64).bfloat16()) is None


def test_linear_layers_pack_each_precision_and_keep_their_results():
    from hosted.layers.linear import Linear, TiedHead

    _need(cpu_lowp.FEATURE_VNNI | cpu_lowp.FEATURE_BF16)
    torch.manual_seed(5)
    x = torch.randn(3, 64)
    for scheme in ("int8", "int4"):
        layer = Linear(64, [40, 24], True, torch.float32, torch.device("cpu"), ops.CPU)
        layer.weight.copy_(torch.randn(64, 64))
        layer.bias.copy_(torch.randn(64))
        layer.quantize_(scheme, 32)
        want = layer.forward(x)  # not packed: the reference int8_linear / int4_linear
        assert layer.prepack() > 0 and layer.packed is not None
        torch.testing.assert_close(layer.forward(x), want, rtol=0, atol=0.03 * float(want.abs().max()))
    dense = Linear(64, 48, False, torch.bfloat16, torch.device("cpu"), ops.CPU)
    dense.weight.copy_(torch.randn(48, 64))
    want = dense.forward(x.bfloat16())
    dense.prepack()
    assert isinstance(dense.packed, cpu_lowp.BF16Strips)
    torch.testing.assert_close(dense.forward(x.bfloat16()), want, rtol=2e-2, atol=2e-2)
    # A tied head packed as an int8 copy: the embedding table itself is untouched.
    table = torch.nn.Embedding(96, 64)
    table.weight.requires_grad_(False)
    head = TiedHead(table, ops.CPU)
    before = table.weight.clone()
    head.prepack(int8_copy=True)
    assert isinstance(head.packed, cpu_lowp.Int8Strips)
    assert torch.equal(table.weight, before)
    want = x @ table.weight.t()
    assert _rel(head(x), want) < 0.02


def test_bf16_projections_of_many_rows_go_to_torch_where_it_has_avx512_bf16(amx):
    """A packed bf16 projection of >= BF16_TORCH_MIN_ROWS rows (AMX_TORCH_MIN_ROWS with AMX tiles) is torch's GEMM
    (oneDNN won from there, measured) on a build with AVX512-BF16; fewer rows, or no AVX512-BF16, run the native
    kernel."""
    _need(cpu_lowp.FEATURE_BF16)
    threshold = cpu_lowp.AMX_TORCH_MIN_ROWS if amx else cpu_lowp.BF16_TORCH_MIN_ROWS
    torch.manual_seed(6)
    w, bias = torch.randn(40, 64).bfloat16(), torch.randn(40).bfloat16()
    strips = cpu_lowp.make_bf16(w, bias)

    class Recording:  # the library, recording the rows of each native bf16 GEMM
        def __init__(self, lib) -> None:
            self.lib, self.rows = lib, []

        def sy_gemm_bf16(self, *args):
            self.rows.append(args[2])
            return self.lib.sy_gemm_bf16(*args)

    strips._lib = recording = Recording(strips._lib)
    few, many = torch.randn(3, 64).bfloat16(), torch.randn(threshold, 64).bfloat16()
    ops.CPU.linear(few, w, bias, strips)
    got = ops.CPU.linear(many, w, bias, strips)
    if cpu_lowp.features() & cpu_lowp.FEATURE_AVX512_BF16:
        assert recording.rows == [3]
        assert torch.equal(got, F.linear(many, w, bias))
    else:
        assert recording.rows == [3, threshold]
