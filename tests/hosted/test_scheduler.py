"""Scheduling decisions, driven without a model: a fake step advances what the batch computed."""
from __future__ import annotations

from hosted.block_manager import BlockManager
from hosted.sampling_params import SamplingParams
from hosted.scheduler import ScheduledBatch, Scheduler
from hosted.sequence import SeqStatus, Sequence


def make(n_tokens: int, arrival: int) -> Sequence:
    return Sequence(request_id=f"r{arrival}", token_ids=[arrival + 1] * n_tokens, num_prompt_tokens=n_tokens,
                    params=SamplingParams(), arrival=arrival)


def fake_step(sched: Scheduler, batch: ScheduledBatch) -> None:
    for seq, n in batch.items:
        seq.num_computed_tokens += n
        sched.bm.register_computed_blocks(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(0)


def test_decodes_first_then_prefill_chunks_within_budget():
    sched = Scheduler(BlockManager(64, 4, enable_prefix_caching=False), max_num_seqs=8, max_num_batched_tokens=10)
    a, b = make(3, 0), make(2, 1)
    sched.add(a)
    sched.add(b)
    fake_step(sched, sched.schedule())  # both prefill fully (5 tokens)
    long = make(23, 2)
    sched.add(long)
    batch = sched.schedule()
    # Both decodes are served, then the long prompt gets the remaining 8 tokens as a chunk.
    assert [(s.request_id, n) for s, n in batch.items] == [("r0", 1), ("r1", 1), ("r2", 8)]
    assert batch.num_decodes == 2 and batch.num_tokens == 10
    fake_step(sched, batch)
    batch = sched.schedule()
    assert [(s.request_id, n) for s, n in batch.items] == [("r0", 1), ("r1", 1), ("r2", 8)]
    fake_step(sched, batch)
    batch = sched.schedule()
    assert [(s.request_id, n) for s, n in batch.items] == [("r0", 1), ("r1", 1), ("r2", 7)]
    fake_step(sched, batch)
    assert long.num_output_tokens == 1  # its prompt finished in the third chunk and sampled


def test_max_num_seqs_bounds_running():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(4):
        sched.add(make(3, i))
    batch = sched.schedule()
    assert len(batch.items) == 2 and len(sched.waiting) == 2


def test_preempts_newest_and_requeues_by_arrival():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    seqs = [make(4, i) for i in range(4)]  # 2 blocks each: the pool is exactly full after prefill
    for s in seqs:
        sched.add(s)
    fake_step(sched, sched.schedule())
    assert bm.num_free_blocks == 0
    # Each now needs a third block for its 5th token. Preempting r3 frees two: r0 and r1 get them;
    # r2 is then the newest running sequence and preempts itself.
    batch = sched.schedule()
    assert [s.request_id for s, _ in batch.items] == ["r0", "r1"]
    assert [s.request_id for s in batch.preempted] == ["r3", "r2"]
    assert sched.num_preemptions == 2
    assert [s.request_id for s in sched.waiting] == ["r2", "r3"]
    assert seqs[3].status is SeqStatus.WAITING and seqs[3].block_table == [] and seqs[3].num_computed_tokens == 0
    fake_step(sched, batch)
    sched.remove(seqs[0])
    # A preempted sequence recomputes prompt + generated tokens (4 + 1) when it comes back; r3 must wait.
    batch = sched.schedule()
    assert [(s.request_id, n) for s, n in batch.items] == [("r1", 1), ("r2", 5)]
    assert [s.request_id for s in sched.waiting] == ["r3"]


def test_waiting_work_never_preempts_running_work():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a = make(6, 0)
    sched.add(a)
    fake_step(sched, sched.schedule())
    sched.add(make(4, 1))  # needs 2 blocks, 1 is free: must wait
    batch = sched.schedule()
    assert [s.request_id for s, _ in batch.items] == ["r0"] and not batch.preempted
    assert len(sched.waiting) == 1


def test_prefix_hits_skip_budget_and_count_once():
    bm = BlockManager(num_blocks=32, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    first = make(13, 0)
    sched.add(first)
    fake_step(sched, sched.schedule())
    again = Sequence(request_id="x", token_ids=list(first.token_ids[:13]) + [5, 6], num_prompt_tokens=15,
                     params=SamplingParams(), arrival=1)
    sched.add(again)
    batch = sched.schedule()
    assert {s.request_id: n for s, n in batch.items}["x"] == 3  # 12 tokens came from the cache
    assert again.num_cached_tokens == 12 and bm.prefix_hit_tokens == 12


def test_a_restore_split_across_steps_gives_its_blocks_back_when_a_preempted_sequence_goes_ahead():
    """Issue 34: a long restore beside running work goes one step's worth per step, the sequence waiting at the
    head of the queue with the blocks restored so far. When a preempted (older) sequence is requeued ahead of it,
    it lets go of them: they stay in the prefix cache, found again as device hits, so nothing is restored twice."""
    import torch

    from hosted.kv_tiers import KVTiers

    bm = BlockManager(num_blocks=16, block_size=2)
    tiers = KVTiers(torch.zeros(1, 2, 16, 2, 1, 1), 32, None, 0, False, bytes(16), 2)
    bm.attach_tiers(tiers)
    tiers.restore_policy = "always"
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    history = Sequence(request_id="h", token_ids=list(range(1, 10)), num_prompt_tokens=9, params=SamplingParams(),
                       arrival=0)
    sched.add(history)
    fake_step(sched, sched.schedule())
    sched.remove(history)
    assert bm.evict_cached() == 4
    tiers.flush()
    a, c = make(3, 1), make(3, 2)
    sched.add(a)
    sched.add(c)
    fake_step(sched, sched.schedule())
    back = Sequence(request_id="back", token_ids=list(range(1, 10)) + [50], num_prompt_tokens=10,
                    params=SamplingParams(), arrival=3)
    sched.add(back)
    tiers.copy_bps["host"], tiers.prefill_tps = tiers.bytes_per_block, 100.0  # a step's time copies one block
    batch = sched.schedule()
    tiers.flush()
    assert [(s.request_id, n) for s, n in batch.items] == [("r1", 1), ("r2", 1)]  # decodes only
    assert sched.waiting[0] is back and len(back.block_table) == 1 and back.num_restored_host_tokens == 2
    fake_step(sched, batch)
    sched._preempt(c, ScheduledBatch())  # as when the pool runs dry for a: c goes back ahead of back
    assert list(sched.waiting) == [c, back] and back.block_table == [] and back.num_computed_tokens == 0
    bm.check_accounting()
    while sched.waiting:
        tiers.copy_bps["host"], tiers.prefill_tps = tiers.bytes_per_block, 100.0
        batch = sched.schedule()
        tiers.flush()
        fake_step(sched, batch)
    assert back.num_cached_tokens == 8 and back.num_restored_host_tokens == 8  # 1 block a hit, 3 restored
    assert tiers.stats["host"].hits == 4
    for s in (a, c, back):
        sched.remove(s)
    bm.check_accounting()
