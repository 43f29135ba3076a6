"""Plain-torch references for every kernel in kernels/ops.py (same signatures, same layouts).

These are the CPU path of the engine as well as the ground truth the Triton kernels are tested
against, so they are written to be both exact (fp32 math) and reasonably fast on CPU: batched
gathers via index_select and one matmul/SDPA per call instead of Python loops where possible.

KV cache layout per layer: [num_blocks, block_size, num_kv_heads, head_dim];
slot = block_id * block_size + offset_in_block.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

INT4_GROUP_SIZES = (32, 64, 128)


# --------------------------------------------------------------------------- KV cache write


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter key/value [T, Hkv, D] into the caches at slot_mapping [T]; slots < 0 are skipped."""
    block_size = k_cache.shape[1]
    slots = slot_mapping.to(torch.int64)
    if bool((slots < 0).any()):
        keep = slots >= 0
        key, value, slots = key[keep], value[keep], slots[keep]
    if slots.numel() == 0:
        return
    block_ids = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots - block_ids * block_size
    # Advanced-index assignment works on any strided cache (no flattening view needed).
    k_cache[block_ids, offsets] = key.to(k_cache.dtype)
    v_cache[block_ids, offsets] = value.to(v_cache.dtype)


# --------------------------------------------------------------------------- attention


def _gather_kv(
    cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """Gather the blocks in block_ids [..., nblk] -> [..., nblk * block_size, Hkv, D] (first num_tokens)."""
    _, block_size, num_kv_heads, head_dim = cache.shape
    flat = cache.index_select(0, block_ids.reshape(-1))
    out = flat.view(*block_ids.shape[:-1], block_ids.shape[-1] * block_size, num_kv_heads, head_dim)
    return out[..., :num_tokens, :, :]


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    tree_masks: torch.Tensor | None = None,
    tree_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence: q [B, Hq, D] attends to positions 0..context_lens[b]-1 -> [B, Hq, D].
    With tree_masks / tree_starts ([B] each, see tree_allowed) a row sees only the positions its mask allows.

    fp32 math. Sequences are grouped into buckets of similar length (see _decode_plan), so a batch is
    not padded to its longest sequence; per bucket the K/V rows in use are gathered head-major into a
    reused scratch buffer and each query-head group attends with two batched matmuls (GQA without
    repeating K/V). The plan depends only on block_tables/context_lens, which every layer of a step
    shares, so it is built once per step."""
    batch, num_q_heads, head_dim = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    plan = _decode_plan(block_tables, context_lens, k_cache)
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    if plan.zero_rows is not None:
        out.index_fill_(0, plan.zero_rows, 0.0)
    k_rows, v_rows = _cache_rows(k_cache), _cache_rows(v_cache)
    qs = q.float() * scale
    tree = _live_tree(tree_masks, tree_starts)
    for chunk in plan.chunks:
        n, length = chunk.num_seqs, chunk.length
        k = _gather_rows(k_rows, k_cache, chunk.kv_rows, 0).view(n * num_kv_heads, length, head_dim)
        v = _gather_rows(v_rows, v_cache, chunk.kv_rows, 1).view(n * num_kv_heads, length, head_dim)
        qb = qs if chunk.rows is None else qs.index_select(0, chunk.rows)
        scores = torch.bmm(qb.view(n * num_kv_heads, group, head_dim), k.transpose(1, 2))
        if chunk.mask is not None:
            scores.view(n, num_q_heads, length).add_(chunk.mask)
        if tree is not None:
            rows = torch.arange(n, device=q.device) if chunk.rows is None else chunk.rows
            allowed = tree_allowed(tree[0][rows], tree[1][rows], torch.arange(length, device=q.device))
            scores.view(n, num_q_heads, length).masked_fill_(~allowed[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if tree is not None:
            probs.nan_to_num_(0.0)  # a row its mask leaves nothing to see: zeros, like a zero-length context
        ob = torch.bmm(probs, v).view(n, num_q_heads, head_dim)
        if chunk.rows is None:
            out.copy_(ob)
        else:
            out.index_copy_(0, chunk.rows, ob.to(q.dtype))
    return out


def tree_allowed(masks: torch.Tensor, starts: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """bool [R, L]: whether each row (tree mask int64 [R], group start [R]) may see each table position
    ([L], or [R, L]) by its mask alone (the context length bounds it as well). -1: a plain row, sees all;
    otherwise p < start, or bit (p - start) set (bit j: the verify group's j-th row; no bit past 63)."""
    masks = masks.to(torch.int64)[:, None]
    index = positions.to(torch.int64) - starts.to(torch.int64)[:, None]
    bits = (masks >> index.clamp(0, 63)) & 1
    return (masks == -1) | (index < 0) | ((index < 64) & (bits == 1))


def _live_tree(masks: torch.Tensor | None, starts: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(masks, starts) as int64 when some row is masked, else None (every row plain)."""
    if masks is None:
        return None
    if starts is None or starts.shape != masks.shape:
        raise ValueError("tree_masks and tree_starts must both be given, one entry per row")
    if not bool((masks != -1).any()):
        return None
    return masks.to(torch.int64), starts.to(torch.int64)


@dataclass(slots=True, frozen=True)
class _DecodeChunk:
    rows: torch.Tensor | None  # int64 [n]: batch rows served; None = every row, in order
    kv_rows: torch.Tensor  # int64 [n * Hkv * L]: cache row (slot * Hkv + kv head) per (seq, head, position)
    num_seqs: int
    length: int  # L: positions gathered per sequence (the chunk's longest context)
    mask: torch.Tensor | None  # fp32 [n, 1, L], 0 or -inf; None when every sequence fills L


@dataclass(slots=True, frozen=True)
class _DecodePlan:
    chunks: list[_DecodeChunk]
    zero_rows: torch.Tensor | None  # rows with context_len <= 0: output zeros


# Buckets: a new bucket costs about as much as this many gathered (token x kv-head-row) elements, so a
# short sequence joins a longer one's bucket only while its padding is cheaper than a separate bucket.
_BUCKET_OVERHEAD_ELEMS = 32_768
# Gathered K (or V) elements per chunk: big enough to amortise per-call overhead, small enough that the
# freshly gathered K/V are still in cache when the matmuls read them.
_CHUNK_ELEMS = 1 << 19


class _PlanCache(threading.local):
    def __init__(self) -> None:
        self.key: tuple | None = None
        self.tables: torch.Tensor | None = None
        self.lens: torch.Tensor | None = None
        self.plan: _DecodePlan | None = None
        self.scratch: dict[tuple, torch.Tensor] = {}


_local = _PlanCache()


def _decode_plan(block_tables: torch.Tensor, context_lens: torch.Tensor, k_cache: torch.Tensor) -> _DecodePlan:
    """The plan for these block tables / lengths, reused while the same values come back (every layer of
    one step passes the same ones). Compared by value: inference tensors carry no version counter."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    key = (num_blocks, block_size, num_kv_heads, head_dim, k_cache.device)
    c = _local
    if (c.key == key and c.tables is not None and c.tables.shape == block_tables.shape
            and c.lens.shape == context_lens.shape and torch.equal(c.tables, block_tables)
            and torch.equal(c.lens, context_lens)):
        return c.plan
    plan = _build_decode_plan(block_tables, context_lens, num_blocks, block_size, num_kv_heads, head_dim)
    c.key, c.tables, c.lens, c.plan = key, block_tables.clone(), context_lens.clone(), plan
    return plan


def _build_decode_plan(block_tables, context_lens, num_blocks, block_size, num_kv_heads, head_dim) -> _DecodePlan:
    device = block_tables.device
    lens = context_lens.tolist()
    live = sorted((b for b, n in enumerate(lens) if n > 0), key=lambda b: -lens[b])
    dead = [b for b, n in enumerate(lens) if n <= 0]
    zero_rows = torch.tensor(dead, dtype=torch.int64, device=device) if dead else None
    row_elems = num_kv_heads * head_dim
    # Optimal split of the length-sorted sequences into buckets (padding vs per-bucket overhead).
    overhead = max(1, _BUCKET_OVERHEAD_ELEMS // row_elems)
    count = len(live)
    best = [0] + [0] * count
    cut = [0] * (count + 1)
    for j in range(1, count + 1):
        best_cost, best_i = None, 0
        for i in range(j):
            cost = best[i] + overhead + (j - i) * lens[live[i]]
            if best_cost is None or cost < best_cost:
                best_cost, best_i = cost, i
        best[j], cut[j] = best_cost, best_i
    buckets: list[tuple[int, int]] = []
    j = count
    while j > 0:
        buckets.append((cut[j], j))
        j = cut[j]
    buckets.reverse()

    tables = block_tables.to(torch.int64)
    chunks: list[_DecodeChunk] = []
    in_order = not dead and count == len(lens)
    for i, j in buckets:
        length = lens[live[i]]
        per_chunk = max(1, _CHUNK_ELEMS // (length * row_elems))
        for s in range(i, j, per_chunk):
            members = live[s:min(j, s + per_chunk)]
            n = len(members)
            rows = torch.tensor(members, dtype=torch.int64, device=device)
            seq_lens = torch.tensor([lens[b] for b in members], dtype=torch.int64, device=device)
            pos = torch.arange(length, device=device)
            # Positions past a sequence's end read its last valid slot (masked), never a garbage table entry.
            clamped = torch.minimum(pos[None, :], seq_lens[:, None] - 1)
            blocks = tables.index_select(0, rows).gather(1, clamped // block_size).clamp_(0, num_blocks - 1)
            slots = blocks * block_size + clamped % block_size  # [n, L]
            heads = torch.arange(num_kv_heads, device=device)
            kv_rows = (slots[:, None, :] * num_kv_heads + heads[None, :, None]).reshape(-1)
            mask = None
            if min(lens[b] for b in members) < length:
                mask = torch.zeros(n, 1, length, device=device)
                mask.masked_fill_(pos[None, None, :] >= seq_lens[:, None, None], float("-inf"))
            whole = in_order and n == len(lens) and members == list(range(n))
            chunks.append(_DecodeChunk(None if whole else rows, kv_rows, n, length, mask))
    return _DecodePlan(chunks, zero_rows)


def _cache_rows(cache: torch.Tensor) -> torch.Tensor | None:
    """The cache as rows of head_dim ([num_blocks * block_size * Hkv, D]) when it is laid out densely."""
    if cache.is_contiguous():
        return cache.view(-1, cache.shape[-1])
    return None


def _gather_rows(rows: torch.Tensor | None, cache: torch.Tensor, index: torch.Tensor, slot: int) -> torch.Tensor:
    """fp32 copy of cache rows `index` in a reused per-thread scratch buffer (valid until the next call
    with the same slot)."""
    head_dim = cache.shape[-1]
    numel = index.numel() * head_dim
    dst = _scratch(slot, numel, torch.float32, cache.device).view(-1, head_dim)
    if rows is None:  # strided cache view: address (block, offset, head) explicitly
        _, block_size, num_kv_heads, _ = cache.shape
        slots = torch.div(index, num_kv_heads, rounding_mode="floor")
        blocks = torch.div(slots, block_size, rounding_mode="floor")
        src = cache[blocks, slots - blocks * block_size, index - slots * num_kv_heads]
        return dst.copy_(src)
    if cache.dtype == torch.float32:
        return torch.index_select(rows, 0, index, out=dst)
    raw = _scratch(slot + 2, numel, cache.dtype, cache.device).view(-1, head_dim)
    return dst.copy_(torch.index_select(rows, 0, index, out=raw))


def _scratch(slot: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat buffer of at least numel elements, reused across calls (fresh large allocations page-fault
    on every call on CPU, which cost more than the attention itself)."""
    # Inference tensors cannot be written outside inference mode (and vice versa for autograd): keep apart.
    key = (slot, dtype, device, torch.is_inference_mode_enabled())
    buf = _local.scratch.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        _local.scratch[key] = buf
    return buf[:numel]


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    tree_masks: torch.Tensor | None = None,
    tree_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed new tokens q [Tq, Hq, D]; token i of seq b sits at absolute position
    context_lens[b] - q_len_b + i and attends causally to every position <= its own. With tree_masks /
    tree_starts ([Tq] each, see tree_allowed) a row sees only those of them its mask allows as well."""
    block_size = k_cache.shape[1]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous whatever q's strides
    cu = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    tables = block_tables.to(torch.int64)
    tree = _live_tree(tree_masks, tree_starts)
    for b, ctx in enumerate(lens):
        start, end = cu[b], cu[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        if ctx < q_len:
            raise ValueError(f"sequence {b}: context_len {ctx} < number of new tokens {q_len}")
        nblk = -(-ctx // block_size)
        k = _gather_kv(k_cache, tables[b, :nblk], ctx).float().transpose(0, 1)  # [Hkv, ctx, D]
        v = _gather_kv(v_cache, tables[b, :nblk], ctx).float().transpose(0, 1)
        qb = q[start:end].float().transpose(0, 1)  # [Hq, q_len, D]
        tree_rows = None
        if tree is not None and bool((tree[0][start:end] != -1).any()):
            tree_rows = tree_allowed(tree[0][start:end], tree[1][start:end], torch.arange(ctx, device=q.device))
        if tree_rows is not None:  # the causal mask below and the tree's; a row left nothing to see gets zeros
            positions = torch.arange(ctx - q_len, ctx, device=q.device)
            mask = (torch.arange(ctx, device=q.device)[None, :] <= positions[:, None]) & tree_rows
            ob = F.scaled_dot_product_attention(
                qb[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=True
            ).nan_to_num_(0.0)
        elif ctx == q_len:
            ob = F.scaled_dot_product_attention(
                qb[None], k[None], v[None], is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            positions = torch.arange(ctx - q_len, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= positions[:, None]  # [q_len, ctx]
            ob = F.scaled_dot_product_attention(
                qb[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=True
            )
        out[start:end] = ob[0].transpose(0, 1).to(q.dtype)
    return out


# --------------------------------------------------------------------------- norm + rotary


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """HF LlamaRMSNorm: weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype), output in x.dtype.
    With residual: new_residual = x + residual (in x.dtype); returns (rmsnorm(new_residual), new_residual)."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = (weight * normed).to(x.dtype)
    if residual is not None:
        return out, x
    return out


def rope_inv_freq(head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (fp32) for HF's rope types default, linear and llama3."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = "default"
    if scaling:
        rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(
        f"unsupported rope scaling type {rope_type!r}; supported: default, linear, llama3"
    )


def rotary_cos_sin(
    head_dim: int,
    max_position: int,
    base: float,
    scaling: dict | None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """[max_position, head_dim] fp32: first half cos, second half sin of position * inv_freq."""
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}")
    inv_freq = rope_inv_freq(head_dim, base, scaling)
    positions = torch.arange(max_position, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX / HF rotate_half rotary on q [T, Hq, D] and k [T, Hkv, D] at positions [T]; math in fp32."""
    half = q.shape[-1] // 2
    cs = cos_sin.index_select(0, positions.to(torch.int64))
    cos = cs[:, None, :half]
    sin = cs[:, None, half:]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


# --------------------------------------------------------------------------- activation


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate then up, as the fused projection) -> silu(gate) * up [T, I] (HF LlamaMLP)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# --------------------------------------------------------------------------- weight-only quantization


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: w [N, K] -> (w_q int8 [N, K], scales fp32 [N]); w ~ w_q * scale."""
    wf = w.float()
    scales = wf.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    w_q = torch.round(wf / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return w_q, scales


def dequantize_int8(w_q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return w_q.float() * scales.float()[:, None]


def int8_linear(
    x: torch.Tensor,
    w_q: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ dequant(w_q [N, K]).T -> [M, N] in x.dtype (fp32 accumulation)."""
    out = torch.matmul(x.float(), w_q.float().t()).mul_(scales.float())
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


def _check_int4_shape(k: int, group_size: int) -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of group_size {group_size}")


def quantize_int4(
    w: torch.Tensor, group_size: int, symmetric: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Group-wise int4 along K. Returns (w_packed uint8 [N, K//2], scales fp32 [N, K//g], zeros fp32 | None).

    Packing: byte j of row n holds k = 2j in the low nibble and k = 2j + 1 in the high nibble.
    Dequantization: w = (nibble - zero) * scale, where zero = 8 when symmetric (zeros is None)
    and a per-group integer in [0, 15] otherwise (asymmetric min/max range).
    """
    n, k = w.shape
    _check_int4_shape(k, group_size)
    groups = w.float().reshape(n, k // group_size, group_size)
    if symmetric:
        scales = groups.abs().amax(dim=-1).clamp(min=1e-12) / 7.0
        zeros = None
        q = torch.round(groups / scales[..., None]).clamp(-8, 7) + 8
    else:
        lo = groups.amin(dim=-1).clamp(max=0.0)
        hi = groups.amax(dim=-1).clamp(min=0.0)
        scales = ((hi - lo) / 15.0).clamp(min=1e-12)
        zeros = torch.round(-lo / scales).clamp(0, 15)
        q = (torch.round(groups / scales[..., None]) + zeros[..., None]).clamp(0, 15)
    q = q.to(torch.uint8).reshape(n, k)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    return packed.contiguous(), scales.contiguous(), zeros


def unpack_int4(w_packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K//2] -> nibbles uint8 [N, K] in k order."""
    n, half = w_packed.shape
    lo = w_packed & 0x0F
    hi = w_packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(n, half * 2)


def dequantize_int4(
    w_packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int
) -> torch.Tensor:
    """fp32 [N, K]; written in place into one buffer (this runs per call on the CPU path)."""
    n, half = w_packed.shape
    k = half * 2
    w = torch.empty(n, k, dtype=torch.float32, device=w_packed.device)
    w[:, 0::2] = w_packed & 0x0F
    w[:, 1::2] = w_packed >> 4
    groups = w.view(n, k // group_size, group_size)
    groups.sub_(zeros.float()[..., None] if zeros is not None else 8.0)
    groups.mul_(scales.float()[..., None])
    return w


def int4_linear(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ dequant(w_packed).T -> [M, N] in x.dtype (fp32 accumulation)."""
    _check_int4_shape(x.shape[-1], group_size)
    w = dequantize_int4(w_packed, scales, zeros, group_size)
    out = torch.matmul(x.float(), w.t())
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)
