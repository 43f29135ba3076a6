"""Tree attention masks (speculative tree verification, AttentionMetadata.tree_masks / tree_starts) in every
attention path: the torch reference against a float64 dense oracle written from the definition, then the native
CPU kernels and the Triton kernels (interpreted on CPU) against the reference.

A verify group of n rows sits at table positions start .. start + n - 1 of its sequence. Row i's mask holds bit j
for every row j it may see (its ancestors and itself); every row sees all positions before start. Groups are fed
either as decode rows (each row its own decode entry over the sequence's block table, context length start + n,
or start + i + 1 for a chain) or as one prefill chunk (causal as well)."""

from __future__ import annotations

import pytest
import torch

from hosted.layers.attention import AttentionMetadata, PagedAttention
from kernels import cpu_native, ops, reference
from tests.kernels.conftest import KERNEL_TEST_DEVICE, TRITON_ALREADY_COMPILED_MODE
from tests.kernels.native_setup import HAVE_COMPILER, native_on, torch_threads  # noqa: F401 - native_on: autouse

torch.set_num_threads(2)

SCALE = 0.3
BACKENDS = ["reference", "native", "triton"]


# --------------------------------------------------------------------------- trees and caches


def signed64(m: int) -> int:
    return m - (1 << 64) if m >= 1 << 63 else m


def random_tree(n: int, gen: torch.Generator) -> list[int]:
    """parents[i] < i, parents[0] = -1: rows in topological order, as a tree verify lays them out."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


def ancestor_masks(parents: list[int]) -> list[int]:
    masks: list[int] = []
    for i, p in enumerate(parents):
        masks.append((1 << i) | (masks[p] if p >= 0 else 0))
    return [signed64(m) for m in masks]


def depths(parents: list[int]) -> list[int]:
    out: list[int] = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def chain_masks(n: int) -> list[int]:
    return [signed64((1 << (i + 1)) - 1) for i in range(n)]


def build_pool(seqs: list[tuple[torch.Tensor, torch.Tensor]], block_size: int, dtype: torch.dtype,
               gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Caches holding each (k, v) [L, Hkv, D] sequence in shuffled blocks (the rest random), and the int32 block
    tables (one spare column)."""
    num_kv_heads, head_dim = seqs[0][0].shape[1:]
    nblks = [-(-k.shape[0] // block_size) for k, _ in seqs]
    num_blocks = sum(nblks) + 2
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seqs), max(nblks) + 1, dtype=torch.int32)
    cursor = 0
    for s, ((k, v), nb) in enumerate(zip(seqs, nblks)):
        ids = order[cursor:cursor + nb]
        cursor += nb
        tables[s, :nb] = ids.to(torch.int32)
        pos = torch.arange(k.shape[0])
        reference.store_kv(k, v, k_cache, v_cache, ids[pos // block_size] * block_size + pos % block_size)
    return k_cache, v_cache, tables


def dense_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int, mask: int, start: int) -> torch.Tensor:
    """float64 attention of one row q [Hq, D] over k/v [>= ctx, Hkv, D], written from the definition."""
    seen = [p for p in range(ctx) if mask == -1 or p < start or (p - start < 64 and (mask >> (p - start)) & 1)]
    group = q.shape[0] // k.shape[1]
    kd = k[seen].double().repeat_interleave(group, 1)  # [n, Hq, D]
    vd = v[seen].double().repeat_interleave(group, 1)
    scores = torch.einsum("hd,nhd->hn", q.double(), kd) * SCALE
    return torch.einsum("hn,nhd->hd", torch.softmax(scores, -1), vd)


def seq_kv(length: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator):
    k = torch.randn(length, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(length, num_kv_heads, head_dim, generator=gen).to(dtype)
    return k, v


# --------------------------------------------------------------------------- backends


def _skip_unavailable(backend: str) -> None:
    if backend == "native" and not HAVE_COMPILER:
        pytest.skip("no C compiler: the native path is off")
    if backend == "triton" and TRITON_ALREADY_COMPILED_MODE:
        pytest.skip("triton was imported before TRITON_INTERPRET could be set")
    if backend != "triton" and KERNEL_TEST_DEVICE != "cpu":
        pytest.skip("CPU backend")


def _device(backend: str) -> torch.device:
    return torch.device(KERNEL_TEST_DEVICE if backend == "triton" else "cpu")


def _on(device: torch.device, *tensors):
    return [None if t is None else t.to(device) for t in tensors]


def decode(backend, q, kc, vc, tables, lens, masks=None, starts=None) -> torch.Tensor:
    dev = _device(backend)
    args = _on(dev, q, kc, vc, tables, lens)
    tree = [] if masks is None else _on(dev, masks, starts)
    if backend == "reference":
        out = reference.paged_decode_attention(*args, SCALE, *tree)
    elif backend == "native":
        out = cpu_native.paged_decode_attention(*args, SCALE, *tree)
        assert out is not None, "the native decode attention declined"
    else:
        from kernels import triton_ops

        out = triton_ops.paged_decode_attention(*args, SCALE, *tree)
    return out.cpu()


def prefill(backend, q, kc, vc, tables, cu, lens, masks=None, starts=None) -> torch.Tensor:
    dev = _device(backend)
    args = _on(dev, q, kc, vc, tables, cu, lens)
    tree = [] if masks is None else _on(dev, masks, starts)
    if backend == "reference":
        out = reference.paged_prefill_attention(*args, SCALE, *tree)
    elif backend == "native":
        out = cpu_native.paged_prefill_attention(*args, SCALE, *tree)
        assert out is not None, "the native prefill attention declined"
    else:
        from kernels import triton_ops

        out = triton_ops.paged_prefill_attention(*args, SCALE, *tree)
    return out.cpu()


def _masks(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _starts(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


# --------------------------------------------------------------------------- one batch, both layouts


class MixedBatch:
    """Two sequences verifying trees (n1 rows after prefix1, n2 after prefix2) and one plain sequence, as a
    decode batch (tree rows interleaved with plain decode rows) and as prefill chunks (a tree chunk, a plain
    chunk of 3 tokens, a tree chunk)."""

    def __init__(self, prefix1, n1, prefix2, n2, num_kv_heads, group, head_dim, block_size, dtype, seed,
                 chains=False):
        gen = torch.Generator().manual_seed(seed)
        self.gen = gen
        self.lengths = [prefix1 + n1, 29, prefix2 + n2]
        self.seqs = [seq_kv(n, num_kv_heads, head_dim, dtype, gen) for n in self.lengths]
        self.kc, self.vc, self.tables = build_pool(self.seqs, block_size, dtype, gen)
        self.groups = []  # (sequence, start, masks)
        for s, (prefix, n) in ((0, (prefix1, n1)), (2, (prefix2, n2))):
            masks = chain_masks(n) if chains else ancestor_masks(random_tree(n, gen))
            self.groups.append((s, prefix, masks))
        self.num_q_heads, self.head_dim = num_kv_heads * group, head_dim

    def decode_rows(self):
        """(seq, ctx, mask, start) per row: group 0's rows, a plain row, group 1's rows, a plain row."""
        rows = []
        (s0, st0, m0), (s2, st2, m2) = self.groups
        rows += [(s0, st0 + len(m0), m, st0) for m in m0]
        rows.append((1, self.lengths[1], -1, 0))
        rows += [(s2, st2 + len(m2), m, st2) for m in m2]
        rows.append((1, 17, -1, 5))  # plain: the start of a -1 row is ignored
        return rows

    def decode_case(self):
        rows = self.decode_rows()
        q = torch.randn(len(rows), self.num_q_heads, self.head_dim, generator=self.gen)
        tables = self.tables[[r[0] for r in rows]]
        lens = torch.tensor([r[1] for r in rows], dtype=torch.int32)
        return q, tables, lens, _masks([r[2] for r in rows]), _starts([r[3] for r in rows]), rows

    def prefill_case(self):
        (s0, st0, m0), (s2, st2, m2) = self.groups
        chunks = [(s0, len(m0), m0, st0), (1, 3, [-1, -1, -1], 0), (s2, len(m2), m2, st2)]
        q = torch.randn(sum(c[1] for c in chunks), self.num_q_heads, self.head_dim, generator=self.gen)
        cu = torch.tensor([0] + list(torch.cumsum(torch.tensor([c[1] for c in chunks]), 0)), dtype=torch.int32)
        lens = torch.tensor([self.lengths[c[0]] for c in chunks], dtype=torch.int32)
        tables = self.tables[[c[0] for c in chunks]]
        rows = []  # (seq, ctx = own position + 1, mask, start) per row
        for s, n, masks, start in chunks:
            rows += [(s, self.lengths[s] - n + i + 1, masks[i], start) for i in range(n)]
        return q, tables, cu, lens, _masks([r[2] for r in rows]), _starts([r[3] for r in rows]), rows

    def dense(self, q, rows):
        return torch.stack([dense_row(q[i], *self.seqs[s], ctx, m, st) for i, (s, ctx, m, st) in enumerate(rows)])


ATOL = {torch.float32: 2e-5, torch.bfloat16: 2e-5}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix1,n1,prefix2,n2,block_size", [
    (0, 1, 5, 3, 4),  # a group at position 0 (nothing before it), one-row group
    (13, 10, 16, 7, 16),  # straddling a block boundary; starting exactly on one
    (37, 64, 3, 24, 16),  # 64 rows: bit 63 (the sign bit) in use
])
def test_reference_matches_dense_oracle(dtype, prefix1, n1, prefix2, n2, block_size):
    b = MixedBatch(prefix1, n1, prefix2, n2, 2, 3, 32, block_size, dtype, seed=prefix1 + n2)
    q, tables, lens, masks, starts, rows = b.decode_case()
    out = reference.paged_decode_attention(q, b.kc, b.vc, tables, lens, SCALE, masks, starts)
    torch.testing.assert_close(out.double(), b.dense(q, rows), atol=ATOL[dtype], rtol=0)
    q, tables, cu, lens, masks, starts, rows = b.prefill_case()
    out = reference.paged_prefill_attention(q, b.kc, b.vc, tables, cu, lens, SCALE, masks, starts)
    torch.testing.assert_close(out.double(), b.dense(q, rows), atol=ATOL[dtype], rtol=0)


def test_tree_masks_change_the_output():
    """The oracle test above would pass a kernel that ignored the masks only if masks changed nothing."""
    b = MixedBatch(9, 12, 4, 6, 1, 2, 16, 4, torch.float32, seed=3)
    q, tables, lens, masks, starts, _ = b.decode_case()
    masked = reference.paged_decode_attention(q, b.kc, b.vc, tables, lens, SCALE, masks, starts)
    plain = reference.paged_decode_attention(q, b.kc, b.vc, tables, lens, SCALE)
    assert (masked - plain).abs().amax() > 1e-2


@pytest.mark.parametrize("backend", ["native", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix1,n1,prefix2,n2,block_size,num_kv_heads,group,head_dim", [
    (0, 1, 5, 3, 4, 1, 4, 32),
    (13, 10, 16, 7, 16, 3, 3, 64),  # SmolLM2's attention shape
    (37, 64, 3, 24, 16, 2, 2, 128),
])
def test_kernels_match_reference(backend, dtype, prefix1, n1, prefix2, n2, block_size, num_kv_heads, group,
                                 head_dim):
    _skip_unavailable(backend)
    if backend == "triton" and n1 == 64 and KERNEL_TEST_DEVICE == "cpu":
        n1 = 40  # the interpreter is slow; 64-row groups are covered by the native kernels
    b = MixedBatch(prefix1, n1, prefix2, n2, num_kv_heads, group, head_dim, block_size, dtype, seed=n1 + head_dim)
    q, tables, lens, masks, starts, _ = b.decode_case()
    want = reference.paged_decode_attention(q, b.kc, b.vc, tables, lens, SCALE, masks, starts)
    got = decode(backend, q, b.kc, b.vc, tables, lens, masks, starts)
    torch.testing.assert_close(got, want, atol=ATOL[dtype], rtol=0)
    q, tables, cu, lens, masks, starts, _ = b.prefill_case()
    want = reference.paged_prefill_attention(q, b.kc, b.vc, tables, cu, lens, SCALE, masks, starts)
    got = prefill(backend, q, b.kc, b.vc, tables, cu, lens, masks, starts)
    torch.testing.assert_close(got, want, atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("backend", ["native", "triton"])
def test_bf16_queries_over_bf16_caches(backend):
    """bf16 q over a bf16 cache: the native prefill takes the fp32-math kernel with masks (the AMX tiles, where
    there are tiles, have none) and returns bf16 like the reference."""
    _skip_unavailable(backend)
    b = MixedBatch(13, 10, 16, 7, 3, 3, 64, 16, torch.bfloat16, seed=4)
    q, tables, cu, lens, masks, starts, _ = b.prefill_case()
    q = q.to(torch.bfloat16)
    want = reference.paged_prefill_attention(q, b.kc, b.vc, tables, cu, lens, SCALE, masks, starts)
    got = prefill(backend, q, b.kc, b.vc, tables, cu, lens, masks, starts)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=2 ** -7)  # one bf16 ulp
    q, tables, lens, masks, starts, _ = b.decode_case()
    q = q.to(torch.bfloat16)
    want = reference.paged_decode_attention(q, b.kc, b.vc, tables, lens, SCALE, masks, starts)
    got = decode(backend, q, b.kc, b.vc, tables, lens, masks, starts)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=2 ** -7)  # one bf16 ulp


@pytest.mark.parametrize("threads", [1, 2])
def test_native_decode_parts_across_threads(threads):
    """One long sequence's tree rows: the native kernel cuts few sequences' blocks into parts across threads, so a
    part can hold tree positions only, every one masked (its merge weight must be zero, not NaN)."""
    _skip_unavailable("native")
    gen = torch.Generator().manual_seed(11)
    prefix, n = 200, 16
    k, v = seq_kv(prefix + n, 3, 64, torch.float32, gen)
    kc, vc, tables = build_pool([(k, v)], 16, torch.float32, gen)
    masks = ancestor_masks([-1] + [0] * (n - 1))  # a star: every row sees the root and itself
    q = torch.randn(1, 9, 64, generator=gen)
    for i in range(n):
        lens, m, st = _starts([prefix + n]), _masks([masks[i]]), _starts([prefix])
        with torch_threads(threads):
            got = decode("native", q, kc, vc, tables[:1], lens, m, st)
        torch.testing.assert_close(got[0].double(), dense_row(q[0], k, v, prefix + n, masks[i], prefix),
                                   atol=2e-5, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chain_masks_equal_causal_exactly(backend, dtype):
    """A chain verify (mask[i] = (1 << (i + 1)) - 1) gives today's causal output bit for bit: as decode rows
    (context start + i + 1) and as a prefill chunk."""
    _skip_unavailable(backend)
    b = MixedBatch(19, 6, 16, 9, 2, 2, 64, 16, dtype, seed=5, chains=True)
    rows = []
    for s, start, masks in b.groups:
        rows += [(s, start + i + 1, m, start) for i, m in enumerate(masks)]
    rows += [(1, 29, -1, 0), (1, 20, -1, 0)]
    q = torch.randn(len(rows), b.num_q_heads, b.head_dim, generator=b.gen)
    tables = b.tables[[r[0] for r in rows]]
    lens = torch.tensor([r[1] for r in rows], dtype=torch.int32)
    # One thread and four sequences: the native kernel then cuts no row into parts whether it counts the rows or
    # the sequences (how the parts are cut changes the order of summation; this checks the masking alone).
    with torch_threads(1):
        masked = decode(backend, q, b.kc, b.vc, tables, lens, _masks([r[2] for r in rows]),
                        _starts([r[3] for r in rows]))
        assert torch.equal(masked, decode(backend, q, b.kc, b.vc, tables, lens))
    q, tables, cu, lens, masks, starts, _ = b.prefill_case()
    masked = prefill(backend, q, b.kc, b.vc, tables, cu, lens, masks, starts)
    assert torch.equal(masked, prefill(backend, q, b.kc, b.vc, tables, cu, lens))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["decode_rows", "prefill_chunk"])
def test_tree_nodes_equal_their_paths_as_chains(backend, layout):
    """The semantic check: node i of a tree verify attends exactly as the last token of the chain prefix +
    root-to-i path would (its ancestors' K/V laid out one after the other, plain causal attention)."""
    _skip_unavailable(backend)
    gen = torch.Generator().manual_seed(21)
    prefix, n, hkv, group, head_dim, block_size = 11, 12, 2, 3, 32, 8
    parents = random_tree(n, gen)
    masks = ancestor_masks(parents)
    k, v = seq_kv(prefix + n, hkv, head_dim, torch.float32, gen)
    paths = []
    for i in range(n):
        path, node = [], i
        while node >= 0:
            path.append(node)
            node = parents[node]
        paths.append(path[::-1])
    chains = [(torch.cat([k[:prefix], k[prefix + torch.tensor(p)]]), torch.cat([v[:prefix], v[prefix + torch.tensor(p)]]))
              for p in paths]
    kc, vc, tables = build_pool([(k, v), *chains], block_size, torch.float32, gen)
    q = torch.randn(n, hkv * group, head_dim, generator=gen)
    tree_masks, tree_starts = _masks(masks), _starts([prefix] * n)
    if layout == "decode_rows":
        lens = torch.full((n,), prefix + n, dtype=torch.int32)
        tree = decode(backend, q, kc, vc, tables[[0] * n], lens, tree_masks, tree_starts)
    else:
        cu, lens = _starts([0, n]), _starts([prefix + n])
        tree = prefill(backend, q, kc, vc, tables[:1], cu, lens, tree_masks, tree_starts)
    chain_lens = torch.tensor([prefix + len(p) for p in paths], dtype=torch.int32)
    as_chains = decode(backend, q, kc, vc, tables[1:], chain_lens)
    assert depths(parents) == [len(p) - 1 for p in paths]
    torch.testing.assert_close(tree, as_chains, atol=2e-6, rtol=0)


@pytest.mark.parametrize("mode", ["reference", "auto"])
def test_paged_attention_passes_each_half_its_rows(mode):
    """PagedAttention hands the decode rows' masks to decode attention and the prefill rows' to prefill."""
    if mode == "auto" and not HAVE_COMPILER:
        pytest.skip("no C compiler")
    b = MixedBatch(13, 10, 16, 7, 3, 3, 64, 16, torch.float32, seed=8)
    qd, tables_d, lens_d, masks_d, starts_d, rows_d = b.decode_case()
    qp, tables_p, cu, lens_p, masks_p, starts_p, rows_p = b.prefill_case()
    layer = PagedAttention(b.num_q_heads, 3, 64, SCALE, ops.select("cpu", mode))
    layer.k_cache, layer.v_cache = b.kc, b.vc
    d = qd.shape[0]
    q = torch.cat([qd, qp])
    k = torch.zeros(q.shape[0], 3, 64)  # written to slot -1: skipped
    meta = AttentionMetadata(slot_mapping=torch.full((q.shape[0],), -1, dtype=torch.int64), num_decode_tokens=d,
                             decode_block_tables=tables_d, decode_context_lens=lens_d,
                             prefill_block_tables=tables_p, prefill_cu_seqlens_q=cu, prefill_context_lens=lens_p,
                             tree_masks=torch.cat([masks_d, masks_p]), tree_starts=torch.cat([starts_d, starts_p]))
    out = layer(q, k, k, meta)
    torch.testing.assert_close(out.double(), b.dense(q, rows_d + rows_p), atol=2e-5, rtol=0)
    plain = AttentionMetadata(meta.slot_mapping, d, tables_d, lens_d, tables_p, cu, lens_p)
    assert plain.tree_masks is None and plain.tree_starts is None
    assert (layer(q, k, k, plain) - out).abs().amax() > 1e-2
