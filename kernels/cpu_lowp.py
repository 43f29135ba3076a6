"""bf16 / int8 / int4 projections on CPU through the native kernels of cpu_lowp.c (AVX512-BF16 and VNNI dot
products), with weights packed once into the 16-row strips those kernels read.

  Int8Strips   int8 weights per output row (kernels.reference.quantize_int8), activations quantized per
               block of 32 per token on the fly, u8 x s8 VNNI dot products (llama.cpp's q8_0 x q8_0 idea)
  Int4Strips   4-bit weights per group with scale and zero point (kernels.reference.quantize_int4, GGUF Q4
               blocks), nibbles widened inside the dot-product loop: nothing is dequantized to memory; the
               scales and zero points are kept as fp16 (as GGUF's Q4 blocks store them)
  BF16Strips   bf16 weights, bf16 activations (fp32 inputs are rounded to bf16 first), fp32 accumulation;
               through AMX tiles where the CPU has them (cpu_amx.c: the strips are AMX's B layout); from
               BF16_TORCH_MIN_ROWS rows (AMX_TORCH_MIN_ROWS with AMX) torch's GEMM instead, where this build has
               AVX512-BF16

Each packs at construction (`make_*` return None where the kernel cannot take the layer: no such
instructions in this build, or K not a multiple of 32 for int8/int4) and is then called like a layer:
strips(x [M, K]) -> [M, N] in x's dtype. The packed copy is what the forward reads; the layer keeps its own
tensors (checkpoint saving, other backends). Outputs match the dequantized matmul up to the activation
rounding (int8 per block of 32, or bf16) and fp32 summation order; tests/test_kernels_lowp.py checks both.
"""
from __future__ import annotations

import ctypes
import threading

import torch
import torch.nn.functional as F

from kernels import cpu_native

_F32, _BF16 = torch.float32, torch.bfloat16
QBLOCK = 32  # activation block of sy_quantize_rows_q8 (as in cpu_lowp.c)
GROUP_Q8, GROUP_BF16 = 2, 4  # strips per tile group, interleaved step by step (as in cpu_lowp.c; int4: none)
FEATURE_VNNI, FEATURE_BF16, FEATURE_AVX512_BF16, FEATURE_AMX_BF16 = 1, 2, 4, 8
# bf16 projections of at least this many rows are torch's GEMM (oneDNN) when the build has AVX512-BF16 (oneDNN's
# bf16 uses the same instructions): on Zen 5 (2 threads, SmolLM2's shapes) ours led at 64 rows, tied at 128-192
# and trailed by 15-40% from 256 (a prefill's rows). Without them (the AVX2 build) the strips take every size.
BF16_TORCH_MIN_ROWS = 192
# With AMX tiles (cpu_amx.c; oneDNN uses them too) ours ran 1.9-2.2 TFLOP/s at 16-512 rows on a 2-core Xeon, 1.1-1.9x
# oneDNN up to 256 rows (10x the AVX512-BF16 strips at 64), level at 512, and oneDNN 1.2-1.7x ahead at 2048.
AMX_TORCH_MIN_ROWS = 512


def features() -> int:
    """Bit set of the low-precision kernels this build has (0 without the native library)."""
    lib = cpu_native.library()
    return 0 if lib is None else int(lib.sy_lowp_features())


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    pad = torch.zeros((rows - t.shape[0], *t.shape[1:]), dtype=t.dtype)
    return torch.cat([t, pad])


def _interleave(strips: torch.Tensor, width: int) -> torch.Tensor:
    """[S, steps, line] per-strip k-steps -> groups of `width` strips (the last may be narrower) with their
    steps interleaved, [steps][strip in group][line] within each group: one sequential stream per group."""
    count, full = strips.shape[0], strips.shape[0] // width * width
    grouped = strips[:full].view(full // width, width, *strips.shape[1:]).transpose(1, 2).reshape(-1)
    rest = strips[full:].transpose(0, 1).reshape(-1)
    return torch.cat([grouped, rest]) if count > full else grouped.contiguous()


def _padded_bias(bias: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    return None if bias is None else _pad_rows(bias.detach().float().reshape(-1), rows).contiguous()


class ThreadScratch(threading.local):
    """Per-thread bytes for one native call's temporaries (used before the call returns)."""

    def __init__(self) -> None:
        self.buf = torch.empty(1 << 16, dtype=torch.uint8)
        self.ptr = self.buf.data_ptr()

    def get(self, nbytes: int) -> int:
        if self.buf.numel() < nbytes:
            self.buf = torch.empty(nbytes, dtype=torch.uint8)
            self.ptr = self.buf.data_ptr()
        return self.ptr


_scratch = ThreadScratch()  # the int8-rounded activations of one projection


def data_ptr(t: torch.Tensor | None) -> int | None:
    """The address a kernel argument takes (None for an absent bias)."""
    return None if t is None else t.data_ptr()


class _Strips:
    """What the three packed forms share: shapes, bias, the tensors the kernel reads, the call's checks."""

    __slots__ = ("_lib", "bias", "k", "n", "packed")
    # Attributes holding the tensors the kernel reads (a subclass adds its own): what owned_tensors lists and
    # rebind moves.
    KERNEL_TENSORS: tuple[str, ...] = ("packed", "bias")

    def __init__(self, n: int, k: int, packed: torch.Tensor, bias: torch.Tensor | None, lib: ctypes.CDLL) -> None:
        self.n, self.k, self.packed, self._lib = n, k, packed, lib
        self.bias = _padded_bias(bias, -(-n // 16) * 16)

    @property
    def extra_bytes(self) -> int:
        """Memory the packed copy takes."""
        return sum(t.numel() * t.element_size() for t in self.owned_tensors())

    def owned_tensors(self) -> list[torch.Tensor]:
        """The tensors the kernel reads (what kernels.huge_pages moves)."""
        return [t for name in self.KERNEL_TENSORS if (t := getattr(self, name)) is not None]

    def rebind(self, take) -> None:
        """Point at copies of the packed tensors (kernels.huge_pages.move_to_huge_pages)."""
        for name in self.KERNEL_TENSORS:
            if (t := getattr(self, name)) is not None:
                setattr(self, name, take(t))

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[-1] != self.k:
            raise ValueError(f"linear: input has {x2.shape[-1]} features, the layer takes {self.k}")
        return x2


class _QuantStrips(_Strips):
    __slots__ = ()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x if x.dim() == 2 and x.shape[1] == self.k else self._rows(x)
        rows = x2.shape[0]
        y = torch.empty(rows, self.n, dtype=_F32)
        if rows:
            if x2.dtype != _F32 or x2.stride(1) != 1:
                x2 = x2.float().contiguous()
            # int8 rows, then fp32 block scales and sums, 64-byte aligned (q8_split in cpu_lowp.c)
            scratch = _scratch.get(rows * self.k + 8 * rows * (self.k // QBLOCK) + 64)
            rc = self._linear(x2, rows, scratch, y)
            if rc:
                raise RuntimeError(f"native low-precision GEMM failed (rc={rc})")
        return y if x.dtype == _F32 else y.to(x.dtype)


class Int8Strips(_QuantStrips):
    __slots__ = ("scales",)
    KERNEL_TENSORS = (*_Strips.KERNEL_TENSORS, "scales")

    def __init__(self, w_q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 lib: ctypes.CDLL) -> None:
        n, k = w_q.shape
        strips = -(-n // 16)
        q = _pad_rows(w_q.detach(), strips * 16)
        # + 128 as unsigned (the u8 operand of vpdpbusd); the kernel takes 128 * sum(x) back per block
        unsigned = (q.to(torch.int16) + 128).to(torch.uint8)
        packed = _interleave(unsigned.view(strips, 16, k // 4, 4).permute(0, 2, 1, 3).reshape(strips, k // 4, 64),
                             GROUP_Q8)
        super().__init__(n, k, packed, bias, lib)
        self.scales = _pad_rows(scales.detach().float().reshape(-1), strips * 16).contiguous()

    def _linear(self, x: torch.Tensor, rows: int, scratch: int, y: torch.Tensor) -> int:
        return self._lib.sy_linear_q8(x.data_ptr(), x.stride(0), rows, self.k, scratch, self.packed.data_ptr(),
                                      self.scales.data_ptr(), data_ptr(self.bias), y.data_ptr(), self.n, self.n,
                                      torch.get_num_threads())


class Int4Strips(_QuantStrips):
    __slots__ = ("group_size", "sz")
    KERNEL_TENSORS = (*_Strips.KERNEL_TENSORS, "sz")

    def __init__(self, w_packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
                 bias: torch.Tensor | None, lib: ctypes.CDLL) -> None:
        n, half = w_packed.shape
        k, strips = half * 2, -(-n // 16)
        q = torch.empty(n, k, dtype=torch.uint8)
        q[:, 0::2] = w_packed & 0x0F
        q[:, 1::2] = w_packed >> 4
        q = _pad_rows(q, strips * 16).view(strips, 16, k // 8, 2, 4)
        packed = (q[:, :, :, 0, :] | (q[:, :, :, 1, :] << 4)).permute(0, 2, 1, 3).contiguous()
        super().__init__(n, k, packed, bias, lib)
        groups = k // group_size
        s = _pad_rows(scales.detach().float().reshape(n, groups), strips * 16)
        z = (_pad_rows(zeros.detach().float().reshape(n, groups), strips * 16) if zeros is not None
             else torch.full_like(s, 8.0))
        per_strip = lambda t: t.view(strips, 16, groups).permute(0, 2, 1)
        # [strips, groups, 2, 16] fp16 (scale, zero): one cache line per strip and group, 1/4 of the nibbles'
        # bytes at g32 (fp32 scale and scale * zero took half)
        self.sz = torch.stack([per_strip(s), per_strip(z)], dim=2).to(torch.float16).contiguous()
        self.group_size = group_size

    def _linear(self, x: torch.Tensor, rows: int, scratch: int, y: torch.Tensor) -> int:
        return self._lib.sy_linear_q4(x.data_ptr(), x.stride(0), rows, self.k, scratch, self.packed.data_ptr(),
                                      self.sz.data_ptr(), self.group_size, data_ptr(self.bias), y.data_ptr(), self.n,
                                      self.n, torch.get_num_threads())


class BF16Strips(_Strips):
    __slots__ = ("_dense", "_torch_min_rows")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, lib: ctypes.CDLL) -> None:
        n, k = weight.shape
        strips = -(-n // 16)
        w = _pad_rows(weight.detach().to(_BF16), strips * 16)
        packed = _interleave(w.view(strips, 16, k // 2, 2).permute(0, 2, 1, 3).reshape(strips, k // 2, 32), GROUP_BF16)
        super().__init__(n, k, packed, bias, lib)
        # (weight, bias) as given, for torch's GEMM at many rows; decided once: None where this build lacks
        # AVX512-BF16 or the weight is not bf16. References only (the layer keeps them), as PackedLinear does.
        features = lib.sy_lowp_features()
        use_torch = (weight.dtype == _BF16 and (bias is None or bias.dtype == _BF16) and features & FEATURE_AVX512_BF16)
        self._dense = (weight, bias) if use_torch else None
        self._torch_min_rows = AMX_TORCH_MIN_ROWS if features & FEATURE_AMX_BF16 else BF16_TORCH_MIN_ROWS

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = self._rows(x)
        rows = x2.shape[0]
        if self._dense is not None and rows >= self._torch_min_rows and x2.dtype == _BF16:
            return F.linear(x2, *self._dense)
        y = torch.empty(rows, self.n, dtype=_F32)
        if rows:
            xb = x2 if x2.dtype == _BF16 and x2.stride(1) == 1 else x2.to(_BF16).contiguous()
            rc = self._lib.sy_gemm_bf16(xb.data_ptr(), xb.stride(0), rows, self.k, self.packed.data_ptr(),
                                        data_ptr(self.bias), y.data_ptr(), y.stride(0), self.n, torch.get_num_threads())
            if rc:
                raise RuntimeError(f"native bf16 GEMM failed (rc={rc})")
        return y if x.dtype == _F32 else y.to(x.dtype)


def _usable(tensor: torch.Tensor, feature: int) -> ctypes.CDLL | None:
    if tensor.device.type != "cpu":
        return None
    lib = cpu_native.library()
    return lib if lib is not None and lib.sy_lowp_features() & feature else None


LowpStrips = Int8Strips | Int4Strips | BF16Strips


def make_int8(w_q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Strips | None:
    lib = _usable(w_q, FEATURE_VNNI)
    if lib is None or w_q.dim() != 2 or w_q.shape[1] % QBLOCK or w_q.dtype != torch.int8:
        return None
    return Int8Strips(w_q, scales, bias, lib)


def make_int4(w_packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
              bias: torch.Tensor | None = None) -> Int4Strips | None:
    lib = _usable(w_packed, FEATURE_VNNI)
    k = w_packed.shape[1] * 2 if w_packed.dim() == 2 else 0
    if lib is None or not k or group_size % QBLOCK or k % group_size or w_packed.dtype != torch.uint8:
        return None
    return Int4Strips(w_packed, scales, zeros, group_size, bias, lib)


def make_bf16(weight: torch.Tensor, bias: torch.Tensor | None = None) -> BF16Strips | None:
    lib = _usable(weight, FEATURE_BF16)
    if lib is None or weight.dim() != 2 or weight.shape[1] % 2:
        return None
    return BF16Strips(weight, bias, lib)
