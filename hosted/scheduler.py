"""Continuous batching: decide, every step, which sequences run and how many tokens each feeds.

Order of service within a step's token budget (max_num_batched_tokens):
1. running sequences that are decoding (one token each), oldest first;
2. running sequences still prefilling, as chunks of whatever budget remains, oldest first;
3. waiting sequences (preempted ones first, then new arrivals), with prefix-cache hits, as chunks; a prefix
   found in the host / disk KV tiers is restored instead of recomputed where that is cheaper, and the restores
   of one step copy about one step's worth of blocks: a longer restore, beside other work, is split across
   steps (the sequence waits at the head of the queue, holding what it restored so far), so a restore never
   holds the running decodes for much longer than one step;
4. draft tokens of decodes that speculate (hosted/spec/), with what budget and free blocks are left: such a
   decode then feeds 1 + k tokens, as a prefill chunk over its cached context.
When the block pool runs dry for a running sequence, the newest running sequence is preempted: its
blocks are freed and it goes back to the front of the waiting queue to be recomputed later.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hosted.block_manager import BlockManager
from hosted.sequence import SeqStatus, Sequence


@dataclass(slots=True)
class ScheduledBatch:
    # (sequence, tokens fed this step); decodes (exactly one uncomputed token) come first.
    items: list[tuple[Sequence, int]] = field(default_factory=list)
    num_decodes: int = 0
    num_tokens: int = 0
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.items


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # kept in priority order (lowest arrival first)
        self.num_preemptions = 0
        self._restored_this_step = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and release its blocks (finish or abort)."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.bm.free(seq)
        seq.status = SeqStatus.FINISHED

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        scheduled: dict[int, int] = {}  # id(seq) -> tokens, for seqs picked this step
        self._restored_this_step = 0
        budget = self._schedule_running(scheduled, batch)
        budget = self._admit_waiting(budget, scheduled)
        self._add_drafts(budget, scheduled)
        self._emit(scheduled, batch)
        return batch

    def _schedule_running(self, scheduled: dict[int, int], batch: ScheduledBatch) -> int:
        """Running sequences first (decodes, then prefill chunks); returns the token budget left."""
        budget = self.max_num_batched_tokens
        decodes = [s for s in self.running if s.num_uncomputed == 1]
        prefills = [s for s in self.running if s.num_uncomputed > 1]
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop to make room for an older sequence
            n = min(seq.num_uncomputed, budget)
            if not self._reserve_running(seq, n, scheduled, batch):
                continue  # seq itself was preempted
            scheduled[id(seq)] = n
            # Recount rather than subtract: a victim scheduled earlier in this loop gave its tokens back.
            budget = self.max_num_batched_tokens - sum(scheduled.values())
        return budget

    def _admit_waiting(self, budget: int, scheduled: dict[int, int]) -> int:
        """Then waiting sequences, oldest first, while the budget, the batch and the KV pool allow; returns the
        token budget left."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hit_ids: list[int] = []
            hit_hashes: list[int] = []
            lower: list = []
            lower_hashes: list[int] = []
            if seq.num_computed_tokens == 0 and not seq.block_table:
                hit_ids, hit_hashes = self.bm.match_prefix(seq)
                lower, lower_hashes = self.bm.match_lower(seq, hit_ids)
            elif seq.block_table:  # a waiting sequence holds blocks only mid-restore: its next part
                lower, lower_hashes = self.bm.match_lower(seq, seq.block_table)
            if lower:
                room = self._restore_room(scheduled)
                if room < len(lower):
                    if room > 0:
                        self._restore_part(seq, hit_ids, hit_hashes, lower[:room], lower_hashes[:room])
                    break  # next step: this step already restores what fits beside the running work
            cached = len(hit_ids) + len(lower)
            start = (len(seq.block_table) + cached) * self.bm.block_size if cached else seq.num_computed_tokens
            n = min(seq.num_tokens - start, budget)
            if not self.bm.can_allocate(seq, start + n, hit_ids):
                break  # never preempt running work to admit new work
            self.waiting.popleft()
            if hit_ids:
                self.bm.take_prefix(seq, hit_ids, hit_hashes)
            restored = (0, 0)
            if lower:
                restored = self.bm.take_restored(seq, lower, lower_hashes)
                self._restored_this_step += sum(restored)
                n = min(seq.num_tokens - seq.num_computed_tokens, budget)  # a disk block may have failed its checks
            if not seq.admitted_once:
                seq.admitted_once = True
                seq.num_cached_tokens = seq.num_computed_tokens
                bs = self.bm.block_size
                seq.num_restored_host_tokens += restored[0] * bs  # after any parts restored in earlier steps
                seq.num_restored_disk_tokens += restored[1] * bs
                self.bm.prefix_queries_tokens += seq.num_prompt_tokens
                self.bm.prefix_hit_tokens += seq.num_cached_tokens
            self.bm.allocate(seq, seq.num_computed_tokens + n)
            seq.status = SeqStatus.RUNNING
            self._insert_running(seq)
            scheduled[id(seq)] = n
            budget -= n
        return budget

    def _restore_room(self, scheduled: dict[int, int]) -> int:
        """Blocks this step may still restore: about one step's worth of copying. With nothing else scheduled
        (no decode to hold), the first restore of the step goes whole."""
        tiers = self.bm.tiers
        assert tiers is not None
        if self._restored_this_step == 0 and not scheduled:
            return 1 << 62
        return max(0, tiers.restore_blocks_per_step(self.max_num_batched_tokens) - self._restored_this_step)

    def _restore_part(self, seq: Sequence, hit_ids: list[int], hit_hashes: list[int], part: list,
                      part_hashes: list[int]) -> None:
        """Restore the leading `part` of seq's lower-tier prefix this step; seq stays at the head of the queue,
        holding its device hits and what it restored, and goes on restoring next step."""
        need = len(seq.block_table) + len(hit_ids) + len(part)
        if not self.bm.can_allocate(seq, need * self.bm.block_size, hit_ids):
            return
        if hit_ids:
            self.bm.take_prefix(seq, hit_ids, hit_hashes)
        restored = self.bm.take_restored(seq, part, part_hashes)
        self._restored_this_step += sum(restored)
        if not seq.admitted_once:
            seq.num_restored_host_tokens += restored[0] * self.bm.block_size
            seq.num_restored_disk_tokens += restored[1] * self.bm.block_size

    def _emit(self, scheduled: dict[int, int], batch: ScheduledBatch) -> None:
        """In the order the model runner wants: decodes first, then prefill chunks."""
        for seq in self.running:
            n = scheduled.get(id(seq))
            if n is not None and n == 1 and seq.num_uncomputed == 1:
                batch.items.append((seq, 1))
        batch.num_decodes = len(batch.items)
        for seq in self.running:
            n = scheduled.get(id(seq))
            if n is not None and not (n == 1 and seq.num_uncomputed == 1):
                batch.items.append((seq, n))
        batch.num_tokens = sum(n for _, n in batch.items)

    def _add_drafts(self, budget: int, scheduled: dict[int, int]) -> None:
        """Last, decodes with draft tokens (hosted/spec/) verify as many of them, oldest sequence first, as the
        budget and the free blocks left over allow: drafts never preempt, delay or keep out other work."""
        for seq in self.running:
            spec = seq.spec_token_ids
            if not spec:
                continue
            if scheduled.get(id(seq)) != 1 or seq.num_uncomputed != 1:
                del spec[:]  # not decoding this step
            del spec[budget:]
            while spec and not self.bm.can_allocate(seq, seq.num_computed_tokens + 1 + len(spec)):
                spec.pop()
            if not spec:
                seq.spec_draft_probs = None
                continue
            if seq.spec_draft_probs is not None:
                seq.spec_draft_probs = seq.spec_draft_probs[:len(spec)]
            self.bm.allocate(seq, seq.num_computed_tokens + 1 + len(spec))
            scheduled[id(seq)] = 1 + len(spec)
            budget -= len(spec)

    def _reserve_running(self, seq: Sequence, n: int, scheduled: dict[int, int], batch: ScheduledBatch) -> bool:
        """Make room for n more tokens of a running seq, preempting the newest running seqs as needed."""
        while not self.bm.can_allocate(seq, seq.num_computed_tokens + n):
            victim = self.running[-1]
            self._preempt(victim, batch)
            scheduled.pop(id(victim), None)
            if victim is seq:
                return False
        self.bm.allocate(seq, seq.num_computed_tokens + n)
        return True

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        seq.spec_token_ids.clear()
        seq.spec_draft_probs = None
        seq.status = SeqStatus.WAITING
        # Back into the waiting queue by arrival, i.e. ahead of every request that came after it.
        i = 0
        while i < len(self.waiting) and self.waiting[i].arrival < seq.arrival:
            i += 1
        self.waiting.insert(i, seq)
        for later in list(self.waiting)[i + 1:]:
            if later.block_table:  # a restore in progress, no longer at the head: its blocks stay cached, unheld
                self.bm.free(later)
        self.num_preemptions += 1
        batch.preempted.append(seq)

    def _insert_running(self, seq: Sequence) -> None:
        # Preempted sequences come back with their old (low) arrival number; keep the list ordered.
        if not self.running or self.running[-1].arrival < seq.arrival:
            self.running.append(seq)
            return
        i = len(self.running)
        while i > 0 and self.running[i - 1].arrival > seq.arrival:
            i -= 1
        self.running.insert(i, seq)
