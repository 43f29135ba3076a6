"""Block pool, ref counts and the prefix cache, without a model."""
from __future__ import annotations

import pytest

import hosted.block_manager as bm_mod
from hosted.block_manager import BlockManager
from hosted.sampling_params import SamplingParams
from hosted.sequence import Sequence


def seq(tokens: list[int], arrival: int = 0) -> Sequence:
    return Sequence(request_id=f"s{arrival}", token_ids=list(tokens), num_prompt_tokens=len(tokens),
                    params=SamplingParams(), arrival=arrival)


def admit(bm: BlockManager, s: Sequence) -> int:
    """Prefix-match, then allocate the rest of the prompt and mark it computed; returns hit tokens."""
    ids, hashes = bm.match_prefix(s)
    assert bm.can_allocate(s, s.num_tokens, ids)
    if ids:
        bm.take_prefix(s, ids, hashes)
    hit = s.num_computed_tokens
    bm.allocate(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.register_computed_blocks(s)
    return hit


def test_allocate_and_free_ref_counts():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(list(range(10)))
    assert admit(bm, a) == 0
    assert len(a.block_table) == 3 and bm.num_free_blocks == 5
    assert not bm.can_allocate(seq(list(range(40))), 40)
    bm.free(a)
    assert bm.num_free_blocks == 8
    bm.check_all_free()
    with pytest.raises(RuntimeError):
        bm.allocate(seq(list(range(40)), 1), 40)


def test_prefix_hits_share_blocks_and_never_cover_last_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq(list(range(12)))  # 3 full blocks, all cached after compute
    admit(bm, a)
    b = seq(list(range(12)) + [99], arrival=1)
    assert admit(bm, b) == 12
    assert b.block_table[:3] == a.block_table and all(bm.blocks[x].ref_count == 2 for x in a.block_table)
    c = seq(list(range(12)), arrival=2)  # identical prompt: its last block must be recomputed
    assert admit(bm, c) == 8
    d = seq(list(range(4)) + [7, 7, 7, 7, 8], arrival=3)  # diverges in block 2
    assert admit(bm, d) == 4
    for s in (a, b, c, d):
        bm.free(s)
    bm.check_all_free()
    assert bm.num_cached_blocks > 0  # freed cached blocks stay findable
    e = seq(list(range(12)) + [5], arrival=4)
    assert admit(bm, e) == 12
    bm.free(e)


def test_hash_collisions_never_share(monkeypatch):
    """With every hash colliding, exact token + parent verification must still refuse wrong blocks."""
    monkeypatch.setattr(bm_mod, "chain_hash", lambda parent, tokens: 42)
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(bm, a)
    b = seq([9, 9, 9, 9, 5, 6, 7, 8, 9], arrival=1)  # block 1 equal to a's, but after a different block 0
    assert admit(bm, b) == 0
    c = seq([1, 2, 3, 4, 0], arrival=2)
    assert admit(bm, c) == 4  # the genuine match still works
    for s in (a, b, c):
        bm.free(s)
    bm.check_all_free()


def test_lru_eviction_prefers_least_recent_and_tail_blocks():
    bm = BlockManager(num_blocks=6, block_size=2)
    a = seq([1, 2, 3, 4, 5])  # blocks: [1,2] [3,4] [5]
    admit(bm, a)
    bm.free(a)
    b = seq([7, 8, 9], arrival=1)  # [7,8] cached, [9] not
    admit(bm, b)
    bm.free(b)
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 3
    # Taking 4 blocks: the 3 plain free blocks first, then evict a's tail block [3,4] (freed first).
    big = seq(list(range(100, 108)), arrival=2)
    bm.allocate(big, 8)
    assert len(bm.match_prefix(seq([1, 2, 3, 4, 0]))[0]) == 1  # root [1,2] survives, [3,4] is gone
    # One more block evicts a's root, still older than b's block.
    bm.allocate(big, 10)
    assert bm.match_prefix(seq([1, 2, 3, 4, 0]))[0] == []
    assert len(bm.match_prefix(seq([7, 8, 0]))[0]) == 1  # b's block was used more recently: kept
    bm.free(big)
    bm.check_all_free()


def test_evicted_parent_invalidates_children():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = seq([1, 2, 3, 4, 5])
    admit(bm, a)
    root = a.block_table[0]
    bm.free(a)
    # Re-fill exactly the root block with other content; the child [3,4] is still "cached" but orphaned.
    filler = seq([8, 8, 8, 8, 8, 8], arrival=1)
    bm.allocate(filler, 6)
    assert root in filler.block_table
    bm.free(filler)
    assert bm.match_prefix(seq([1, 2, 3, 4, 0]))[0] == []


def test_can_allocate_counts_hits_taken_from_the_free_pool():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3, 4, 5, 6, 7])
    admit(bm, a)
    bm.free(a)
    b = seq([1, 2, 3, 4, 5, 6, 0, 1], arrival=1)
    ids, hashes = bm.match_prefix(b)
    assert len(ids) == 3
    assert bm.can_allocate(b, 8, ids)  # 3 cached (free) blocks + 1 new = 4
    assert not bm.can_allocate(b, 10, ids)
    bm.take_prefix(b, ids, hashes)
    bm.allocate(b, 8)
    assert bm.num_free_blocks == 0
    bm.free(b)
    bm.check_all_free()


def test_prefix_caching_disabled():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = seq([1, 2, 3, 4, 5])
    admit(bm, a)
    bm.free(a)
    assert admit(bm, seq([1, 2, 3, 4, 5], 1)) == 0
