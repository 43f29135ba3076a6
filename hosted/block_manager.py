"""Paged KV-cache bookkeeping: a pool of fixed-size blocks, per-sequence block tables, ref counts,
and the prefix cache (full blocks found by a chained hash, verified exactly, evicted LRU). With KV tiers
attached (hosted/kv_tiers.py), an evicted cached block is demoted to host memory / disk instead of dropped,
and a prefix match continues into those tiers."""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from hosted.sequence import Sequence

if TYPE_CHECKING:
    from hosted.kv_tiers import KVTiers, TierBlock

_ROOT_HASH = 0


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    # Prefix-cache identity, set once the block is full and computed; hash == -1 means "not cached".
    hash: int = -1
    token_ids: tuple[int, ...] = ()
    # (block_id, generation) of the block holding the previous block_size tokens, None for a first block.
    # Matching requires this to equal the block we just matched, so a hash collision can never make two
    # different prefixes share KV: the whole chain is verified token for token.
    parent: tuple[int, int] | None = None
    generation: int = 0  # bumped every time the block is handed out for new content
    # The 128-bit chain digest of the whole prefix (hosted/kv_tiers.chain_key), and the parent's: the identity
    # a block keeps when it is demoted below the device, where (block_id, generation) no longer exists.
    key: bytes = b""
    parent_key: bytes = b""


def chain_hash_of(bm: BlockManager, hit_ids: list[int]) -> int:
    """The chain hash of the last of the device hits (the root hash when there are none)."""
    return bm.blocks[hit_ids[-1]].hash if hit_ids else _ROOT_HASH


def chain_hash(parent_hash: int, token_ids: list[int] | tuple[int, ...]) -> int:
    """xxh64 of the parent block's hash followed by this block's token ids."""
    h = xxhash.xxh64()
    h.update(parent_hash.to_bytes(8, "little", signed=False))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))  # ref 0, holding nothing worth keeping
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, cached content; oldest first
        self._by_hash: dict[int, int] = {}
        self.prefix_queries_tokens = 0
        self.prefix_hit_tokens = 0
        self.tiers: KVTiers | None = None

    def attach_tiers(self, tiers: KVTiers) -> None:
        """Demote evicted cached blocks into `tiers` and match prefixes into them (needs prefix caching)."""
        if self.enable_prefix_caching:
            self.tiers = tiers

    # ---- pool state -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_hash)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -----------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Cached full blocks covering a prefix of seq.token_ids, without taking them.

        Returns (block_ids, hashes). The last token is never covered: the model must compute at
        least one token to produce logits.
        """
        if not self.enable_prefix_caching:
            return [], []
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        ids: list[int] = []
        hashes: list[int] = []
        parent_hash = _ROOT_HASH
        parent: tuple[int, int] | None = None
        for i in range(max_blocks):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(parent_hash, tokens)
            block_id = self._by_hash.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != tokens or block.parent != parent:
                break
            ids.append(block_id)
            hashes.append(h)
            parent_hash, parent = h, (block_id, block.generation)
        return ids, hashes

    def match_lower(self, seq: Sequence, hit_ids: list[int]) -> tuple[list[TierBlock], list[int]]:
        """After the device hits `hit_ids`, the blocks continuing the prefix in the host / disk tiers, cut to
        the part worth restoring rather than recomputing; with their chain hashes. Takes nothing."""
        tiers = self.tiers
        if tiers is None:
            return [], []
        from hosted.kv_tiers import ROOT_KEY, chain_key

        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        parent_key = self.blocks[hit_ids[-1]].key if hit_ids else ROOT_KEY
        parent_hash = chain_hash_of(self, hit_ids)
        found: list[TierBlock] = []
        hashes: list[int] = []
        for i in range(len(hit_ids), max_blocks):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            key = chain_key(parent_key, tokens)
            block = tiers.lookup(key, parent_key, tokens)
            if block is None:
                break
            parent_hash = chain_hash(parent_hash, tokens)
            found.append(block)
            hashes.append(parent_hash)
            parent_key = key
        keep = tiers.worth_restoring(found) if found else 0
        return found[:keep], hashes[:keep]

    def take_restored(self, seq: Sequence, found: list[TierBlock], hashes: list[int]) -> tuple[int, int]:
        """Give seq fresh device blocks for `found` (from match_lower, after its device hits), entered in the prefix
        cache at once (a request admitted after it shares them: restored once) and marked computed; the copies
        are queued for the engine's next flush. Returns (blocks restored from host, from disk): a disk block that
        fails its checks ends the restore there, and seq computes the rest."""
        assert self.tiers is not None and len(seq.block_table) * self.block_size == seq.num_computed_tokens
        taken = self.tiers.take(found)
        for block_src, h in zip(taken, hashes):
            block_id = self._take_block()
            block = self.blocks[block_id]
            prev = self.blocks[seq.block_table[-1]] if seq.block_table else None
            block.hash, block.token_ids, block.key, block.parent_key = h, block_src.token_ids, block_src.key, block_src.parent_key
            block.parent = (prev.block_id, prev.generation) if prev is not None else None
            if h not in self._by_hash:
                self._by_hash[h] = block_id
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
            seq.block_keys.append(block_src.key)
            self.tiers.queue_restore(block_id, block_src)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        host = sum(1 for b in taken if b.tier == "host")
        return host, len(taken) - host

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Enter seq's newly full, computed blocks into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        from hosted.kv_tiers import ROOT_KEY, chain_key

        bs = self.block_size
        num_full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        for i in range(len(seq.block_hashes), num_full):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            parent_hash = seq.block_hashes[i - 1] if i else _ROOT_HASH
            h = chain_hash(parent_hash, tokens)
            seq.block_hashes.append(h)
            parent_key = seq.block_keys[i - 1] if i else ROOT_KEY
            key = chain_key(parent_key, tokens)
            seq.block_keys.append(key)
            block = self.blocks[seq.block_table[i]]
            if block.hash != -1 or h in self._by_hash:
                continue  # already cached (a hit), or an identical block computed by another sequence
            prev = self.blocks[seq.block_table[i - 1]] if i else None
            block.hash = h
            block.token_ids = tokens
            block.key, block.parent_key = key, parent_key
            block.parent = (prev.block_id, prev.generation) if prev is not None else None
            self._by_hash[h] = block.block_id
            if self.tiers is not None:
                self.tiers.discard(key)  # computed again: the device copy is the one kept

    # ---- allocation -------------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_tokens: int, hit_ids: list[int] | None = None) -> bool:
        """Whether seq can hold `num_tokens` tokens in total, after taking `hit_ids` (from match_prefix)."""
        hit_ids = hit_ids or []
        need = self.blocks_for(num_tokens) - len(seq.block_table) - len(hit_ids)
        taken_from_pool = sum(1 for b in hit_ids if self.blocks[b].ref_count == 0)
        return need + taken_from_pool <= self.num_free_blocks

    def take_prefix(self, seq: Sequence, hit_ids: list[int], hit_hashes: list[int]) -> None:
        """Give an empty sequence the matched cached blocks (ref-counted) and mark them computed."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        for block_id in hit_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._evictable[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.block_hashes = list(hit_hashes)
        seq.block_keys = [self.blocks[b].key for b in hit_ids]
        seq.num_computed_tokens = len(hit_ids) * self.block_size

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow seq's block table to hold `num_tokens` tokens. Caller checked can_allocate."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need > self.num_free_blocks:
            raise RuntimeError("KV block pool exhausted (can_allocate was not checked)")
        for _ in range(need):
            seq.block_table.append(self._take_block())

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Drop seq's blocks beyond the first blocks_for(num_tokens) (rejected draft tokens rolled back). The
        blocks dropped hold no computed full block, so none of them is in the prefix cache."""
        keep = self.blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())
        del seq.block_hashes[keep:]
        del seq.block_keys[keep:]

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            if block.hash != -1:
                self._evictable[block_id] = None
            else:
                self._free.append(block_id)

    def free(self, seq: Sequence) -> None:
        """Drop seq's references. Cached blocks stay findable until evicted; the tail goes first."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.block_hashes = []
        seq.block_keys = []
        seq.num_computed_tokens = 0

    def _take_block(self) -> int:
        block_id = self._free.popleft() if self._free else self._evict_lru()
        block = self.blocks[block_id]
        block.ref_count = 1
        block.generation += 1
        return block_id

    def _evict_lru(self) -> int:
        """Take the least recently used cached block out of the prefix cache (demoted when tiers are attached)."""
        block_id, _ = self._evictable.popitem(last=False)
        block = self.blocks[block_id]
        if self.tiers is not None:
            # Copied out at the engine's next flush, before anything writes this block again.
            self.tiers.queue_demotion(block_id, block.key, block.parent_key, block.token_ids)
        self._uncache(block)
        return block_id

    def _uncache(self, block: Block) -> None:
        if self._by_hash.get(block.hash) == block.block_id:
            del self._by_hash[block.hash]
        block.hash = -1
        block.token_ids = ()
        block.parent = None
        block.key = block.parent_key = b""

    def reset_prefix_cache(self) -> None:
        """Forget every unreferenced cached block (their memory returns to the plain free list)."""
        while self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            self._uncache(self.blocks[block_id])
            self._free.append(block_id)

    def evict_cached(self) -> int:
        """Move every unreferenced cached block out of the device pool: demoted into the tiers when attached (the
        engine's next flush copies them), else forgotten. Returns how many blocks left the pool."""
        n = len(self._evictable)
        while self._evictable:
            self._free.append(self._evict_lru())
        return n

    def check_all_free(self) -> None:
        """Assert the pool holds no references (tests call this after every engine is drained)."""
        held = [b.block_id for b in self.blocks if b.ref_count != 0]
        assert not held, f"blocks still referenced: {held[:20]}"
        assert self.num_free_blocks == self.num_blocks, (self.num_free_blocks, self.num_blocks)
        self.check_accounting()

    def check_accounting(self) -> None:
        """Every device block free, cached-unreferenced or referenced, exactly once; with tiers, every cached
        block's content in one place only (device, host memory or disk)."""
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free) and not (free & evictable), "a block listed twice"
        for b in self.blocks:
            listed = (b.block_id in free) + (b.block_id in evictable) + (b.ref_count > 0)
            assert listed == 1, f"block {b.block_id}: free/cached/referenced {listed} times"
            assert b.block_id not in evictable or b.hash != -1, f"block {b.block_id}: evictable but not cached"
        if self.tiers is not None:
            self.tiers.check({b.key for b in self.blocks if b.hash != -1})
