"""Linear layer holding weight [out, in] like HF, and its other forms: weight-only quantized (int8, int4) and
packed for the CPU GEMM.

Quantization lives only here: `quantize_model` converts every Linear of a loaded model (except the ones
named in `skip`, by default the lm_head) in place; the forward then calls the backend's int8_linear /
int4_linear (Triton on CUDA, the torch reference elsewhere), or on CPU the native strips `prepack()` made
(kernels/cpu_lowp.py: VNNI int8/int4, AVX512-BF16). Packing too: `prepack()` keeps a copy of a
full-precision weight in the CPU GEMM's layout (kernels.ops.prepack_linear) that the forward then uses.
`TiedHead` is the same projection over a weight another layer owns (an lm_head tied to the embedding).
"""
from __future__ import annotations

import logging

import torch
from torch import nn
from tqdm import tqdm

from hosted.config import INT4_GROUP_SIZES, QUANTIZATION_SCHEMES, ConfigError
from kernels import ops, reference
from kernels.cpu_lowp import LowpStrips
from kernels.cpu_native import PackedLinear

log = logging.getLogger(__name__)
# An int8 copy of a full-precision head, for its packed GEMM only (the layer itself is not quantized): not
# ops.quantize_int8, which quantizes layers (tests watch that a saved quantized checkpoint is not quantized again).
_int8_copy = reference.quantize_int8


class Linear(nn.Module):
    """y = x @ W.T + b. Several HF projections may be merged into one (qkv, gate_up): `shard_sizes`
    lists the output rows of each part, in order, so the loader can fill them one by one.

    After `quantize_(scheme)` the full-precision `weight` parameter is gone (its memory freed) and the
    layer holds, as non-trainable parameters (so parameter byte counts stay truthful):
      int8: qweight int8 [out, in], scales fp32 [out]                 (w = q * scale, per output row)
      int4: qweight uint8 [out, in/2], scales and zeros fp32 [out, in/g] (w = (nibble - zero) * scale)
    Quantization is per output row, so merged projections quantize exactly as their parts would.

    `kernels` is the backend the forward calls (default: the one for `device`, chosen now).
    """

    def __init__(self, in_features: int, out_features: int | list[int], bias: bool,
                 dtype: torch.dtype, device: torch.device, kernels: ops.Kernels | None = None) -> None:
        super().__init__()
        self.kernels = kernels if kernels is not None else ops.select(device)
        self.packed: PackedLinear | LowpStrips | None = None  # set by prepack()
        self.shard_sizes = list(out_features) if isinstance(out_features, list) else [out_features]
        self.in_features = in_features
        self.out_features = sum(self.shard_sizes)
        self.quantization: str | None = None
        self.group_size = 0  # int4 only
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(self.out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)

    def shard_offset(self, shard: int) -> tuple[int, int]:
        start = sum(self.shard_sizes[:shard])
        return start, start + self.shard_sizes[shard]

    def quantize_(self, scheme: str, group_size: int = 128) -> None:
        """Replace the full-precision weight by its quantized form, in place (the weight is freed)."""
        w = self._release_weight(scheme, group_size)
        if scheme == "int8":
            q, scales = ops.quantize_int8(w)
            zeros = None
        else:
            q, scales, zeros = ops.quantize_int4(w, group_size, symmetric=False)
        del w
        self._hold_quantized(scheme, group_size, q, scales, zeros)

    def init_quantized_(self, scheme: str, group_size: int = 128) -> None:
        """Replace the full-precision weight by empty quantized parameters of `scheme`, for a loader to fill
        (a checkpoint saved quantized, or GGUF 4-bit blocks that are already our int4): no rounding here."""
        device = self._release_weight(scheme, group_size).device
        n, k = self.out_features, self.in_features
        if scheme == "int8":
            q = torch.empty(n, k, dtype=torch.int8, device=device)
            scales, zeros = torch.empty(n, dtype=torch.float32, device=device), None
        else:
            q = torch.empty(n, k // 2, dtype=torch.uint8, device=device)
            scales = torch.empty(n, k // group_size, dtype=torch.float32, device=device)
            zeros = torch.empty(n, k // group_size, dtype=torch.float32, device=device)
        self._hold_quantized(scheme, group_size, q, scales, zeros)

    def _release_weight(self, scheme: str, group_size: int) -> torch.Tensor:
        """Check `scheme` applies, then drop the full-precision parameter; returns its tensor (the last
        reference, so it is freed as soon as the caller lets go of it)."""
        check_quantizable(self.in_features, scheme, group_size)
        if self.quantization is not None:
            raise RuntimeError(f"layer is already quantized ({self.quantization})")
        self.packed = None  # a packed copy of the weight being replaced is stale
        w = self.weight.detach()
        del self.weight
        return w

    def _hold_quantized(self, scheme: str, group_size: int, q: torch.Tensor, scales: torch.Tensor,
                        zeros: torch.Tensor | None) -> None:
        self.qweight = nn.Parameter(q, requires_grad=False)
        self.scales = nn.Parameter(scales, requires_grad=False)
        self.zeros = nn.Parameter(zeros, requires_grad=False) if zeros is not None else None
        if scheme == "int4":
            self.group_size = group_size
        self.quantization = scheme

    def prepack(self, int8_copy: bool = False) -> int:
        """Keep a copy of the weight in the layout of the backend's native GEMM for the forward to use
        (kernels.ops.prepack_linear / prepack_int8 / prepack_int4: fp32 panels, bf16 / int8 / int4 strips);
        returns the bytes it adds (0 where packing does not apply: CUDA, shapes or builds the kernels do not
        take). `int8_copy` packs an int8 quantization of a full-precision weight instead (an lm_head beside
        quantized decoder layers, as llama.cpp's q8_0 does). The weights must not be replaced afterwards."""
        if self.quantization == "int8":
            self.packed = self.kernels.prepack_int8(self.qweight, self.scales, self.bias)
        elif self.quantization == "int4":
            self.packed = self.kernels.prepack_int4(self.qweight, self.scales, self.zeros, self.group_size, self.bias)
        elif int8_copy:
            self.packed = self.kernels.prepack_int8(*_int8_copy(self.weight), self.bias)
        else:
            self.packed = self.kernels.prepack_linear(self.weight, self.bias)
        return self.packed.extra_bytes if self.packed is not None else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantization is None:
            return self.kernels.linear(x, self.weight, self.bias, self.packed)
        x2 = x.reshape(-1, self.in_features)
        if self.packed is not None:
            return self.packed(x2).view(*x.shape[:-1], self.out_features)
        if self.quantization == "int8":
            out = self.kernels.int8_linear(x2, self.qweight, self.scales, self.bias)
        else:
            out = self.kernels.int4_linear(x2, self.qweight, self.scales, self.zeros, self.group_size, self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        q = f", quantization={self.quantization}" if self.quantization else ""
        g = f", group_size={self.group_size}" if self.quantization == "int4" else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}{q}{g}"


class TiedHead:
    """x @ W.T over the weight of another layer (an lm_head tied to the embedding table), packed like a
    Linear's. Not an nn.Module: the weight is registered once, by the layer that owns it."""

    def __init__(self, owner: nn.Module, kernels: ops.Kernels) -> None:
        self.owner = owner  # read `owner.weight` at each call: the runner may move parameters to new storage
        self.kernels = kernels
        self.packed: PackedLinear | LowpStrips | None = None

    def prepack(self, int8_copy: bool = False) -> int:
        """As Linear.prepack (`int8_copy`: an int8 quantization of the table, the table itself stays)."""
        weight = self.owner.weight
        self.packed = (self.kernels.prepack_int8(*_int8_copy(weight), None) if int8_copy
                       else self.kernels.prepack_linear(weight, None))
        return self.packed.extra_bytes if self.packed is not None else 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear(x, self.owner.weight, None, self.packed)


def scheme_key(scheme: str | None, group_size: int) -> tuple[str | None, int]:
    """A quantization scheme as compared: the group size counts for int4 only."""
    return scheme, group_size if scheme == "int4" else 0


def check_quantizable(in_features: int, scheme: str, group_size: int, name: str = "layer") -> None:
    """ConfigError (a ValueError) naming the problem and a fix if `scheme` cannot apply to this layer."""
    if scheme not in QUANTIZATION_SCHEMES:
        raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATION_SCHEMES)}, got {scheme!r}")
    if scheme == "int4":
        if group_size not in INT4_GROUP_SIZES:
            raise ConfigError(f"int4 group size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}, "
                              f"got {group_size!r}")
        if in_features % group_size:
            fits = [g for g in INT4_GROUP_SIZES if in_features % g == 0]
            hint = (f"use a group size that divides it ({', '.join(map(str, fits))})" if fits
                    else "this model cannot be int4-quantized; use int8")
            raise ConfigError(f"int4 quantization with group size {group_size}: {name} has in_features="
                              f"{in_features}, not a multiple of {group_size}; {hint}")


def quantizable_linears(model: nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> list[tuple[str, Linear]]:
    """The (name, layer) pairs `quantize_model` converts: every Linear except those named in `skip`.
    The embedding is an nn.Embedding (a lookup, not a matmul) and is never quantized."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, Linear) and name.rpartition(".")[2] not in skip]


def check_model_quantizable(model: nn.Module, scheme: str, group_size: int,
                            skip: tuple[str, ...] = ("lm_head",)) -> None:
    """Fail before any weight is loaded if some layer cannot take the scheme (e.g. group size vs in_features)."""
    check_quantizable(0, scheme, group_size)  # the scheme and group size themselves
    for name, layer in quantizable_linears(model, skip):
        check_quantizable(layer.in_features, scheme, group_size, name)


def quantize_model(model: nn.Module, scheme: str, group_size: int = 128,
                   skip: tuple[str, ...] = ("lm_head",), progress: bool = False) -> dict[str, int]:
    """Quantize every Linear except `skip` in place, one layer at a time (peak memory: the loaded model
    plus one layer's temporaries). Returns weight bytes of the converted layers before and after.
    `progress` shows a bar over the layers."""
    check_model_quantizable(model, scheme, group_size, skip)
    before = after = 0
    layers = quantizable_linears(model, skip)
    for name, layer in tqdm(layers, desc=f"quantizing to {scheme}", unit="layer", disable=not progress):
        if layer.quantization is not None:  # loaded quantized (init_quantized_): nothing to convert
            if scheme_key(layer.quantization, layer.group_size) != scheme_key(scheme, group_size):
                raise ConfigError(f"{name} is already quantized ({layer.quantization}"
                                  f"{f' g{layer.group_size}' if layer.group_size else ''}), not {scheme}")
            continue
        before += layer.weight.numel() * layer.weight.element_size()
        layer.quantize_(scheme, group_size)
        after += sum(t.numel() * t.element_size() for t in (layer.qweight, layer.scales, layer.zeros)
                     if t is not None)
    log.info("quantized linear weights to %s: %.1f MiB -> %.1f MiB", scheme, before / (1 << 20), after / (1 << 20))
    return {"bytes_before": before, "bytes_after": after}
