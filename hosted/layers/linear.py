"""Dense linear layer holding weight [out, in] like HF, so a quantized variant can replace it later."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x @ W.T + b. Several HF projections may be merged into one (qkv, gate_up): `shard_sizes`
    lists the output rows of each part, in order, so the loader can fill them one by one."""

    def __init__(self, in_features: int, out_features: int | list[int], bias: bool,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.shard_sizes = list(out_features) if isinstance(out_features, list) else [out_features]
        self.in_features = in_features
        self.out_features = sum(self.shard_sizes)
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(self.out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)

    def shard_offset(self, shard: int) -> tuple[int, int]:
        start = sum(self.shard_sizes[:shard])
        return start, start + self.shard_sizes[shard]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
