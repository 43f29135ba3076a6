"""KV-cache tiering (issue 34): cached blocks the device pool evicts move to host memory and disk and come back on
a prefix hit. Greedy outputs must not change through demotion, restore and a restart; the accounting stays exact
(checked after every test by conftest's pool check, which runs BlockManager.check_accounting); a bad disk file is
never used; a failing disk turns the tier off without failing a request."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hosted.engine import SamplingParams
from hosted.kv_tiers import SUFFIX, DiskTier, TierBlock, chain_key

BS = 4
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
# Tiny llama: 2 layers x (K, V) x 4 tokens x 2 kv heads x 16 dims x fp32 bytes per block.
BLOCK_BYTES = 2 * 2 * BS * 2 * 16 * 4


def _gb(blocks: int) -> float:
    return blocks * BLOCK_BYTES / (1 << 30)


def _history(seed: int, n: int = 30) -> list[int]:
    return [(seed * 37 + j * 11) % 280 + 15 for j in range(n)]


def _fillers(k: int) -> list[list[int]]:
    return [_history(100 + i, 26) for i in range(k)]


def _engine(make_engine, model, **kw):
    kw.setdefault("block_size", BS)
    kw.setdefault("num_kv_blocks", 16)
    kw.setdefault("max_num_seqs", 2)
    kw.setdefault("kv_restore", "always")
    return make_engine(model, **kw)


def _final(engine, rid, prompt):
    engine.add_request(rid, prompt, PARAMS)
    tokens, last = [], None
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid:
                tokens += o.new_token_ids
                last = o
    return tokens, last


@pytest.fixture
def reference(tiny_model_dirs, make_engine):
    """Greedy outputs with no prefix caching at all."""
    engine = make_engine(tiny_model_dirs["llama"], enable_prefix_caching=False, num_kv_blocks=64)
    return lambda prompt: engine.generate([prompt], PARAMS)[0]


def _conversation(engine, reference, history):
    """Run `history`, push it out of the device pool with other requests, then return with a longer turn."""
    first, _ = _final(engine, "turn1", history)
    assert first == reference(history)
    for i, p in enumerate(_fillers(4)):
        _final(engine, f"fill{i}", p)
    returning = history + first + [17, 18, 19]
    got, out = _final(engine, "turn2", returning)
    assert got == reference(returning)
    return out


def test_host_tier_restores_and_output_unchanged(tiny_model_dirs, make_engine, reference):
    engine = _engine(make_engine, tiny_model_dirs["llama"], kv_host_gb=_gb(64))
    out = _conversation(engine, reference, _history(1))
    assert out.num_restored_host_tokens == 32  # 8 full blocks: the history and 5 computed output tokens
    assert out.num_restored_disk_tokens == 0
    assert out.num_cached_tokens >= out.num_restored_host_tokens
    s = engine.stats().kv_tiers
    assert s["host"]["hits"] == 8 and s["host"]["bytes_out"] == 8 * BLOCK_BYTES
    assert s["host"]["bytes_in"] > 0 and s["host"]["blocks"] > 0


def test_disk_tier_restores_when_host_is_full(tiny_model_dirs, make_engine, reference, tmp_path):
    engine = _engine(make_engine, tiny_model_dirs["llama"], kv_host_gb=_gb(2), kv_disk_dir=str(tmp_path / "kv"))
    out = _conversation(engine, reference, _history(2))
    assert out.num_restored_disk_tokens > 0
    assert out.num_restored_host_tokens + out.num_restored_disk_tokens == 32
    s = engine.stats().kv_tiers
    assert s["disk"]["hits"] * BS == out.num_restored_disk_tokens and s["disk"]["enabled"]
    assert len(list((tmp_path / "kv").glob("*" + SUFFIX))) == s["disk"]["blocks"]


def test_evict_cached_demotes_every_unreferenced_block(tiny_model_dirs, make_engine, reference):
    engine = _engine(make_engine, tiny_model_dirs["llama"], kv_host_gb=_gb(64))
    history = _history(10)
    first, _ = _final(engine, "turn1", history)
    cached = engine.block_manager.num_cached_blocks
    assert engine.block_manager.evict_cached() == cached == 8
    engine.kv_tiers.flush()
    assert engine.block_manager.num_cached_blocks == 0 and engine.stats().kv_tiers["host"]["blocks"] == 8
    engine.block_manager.check_accounting()
    returning = history + first + [17]
    got, out = _final(engine, "turn2", returning)
    assert got == reference(returning) and out.num_restored_host_tokens == 32


def test_tiering_off_recomputes(tiny_model_dirs, make_engine, reference):
    engine = _engine(make_engine, tiny_model_dirs["llama"])
    out = _conversation(engine, reference, _history(3))
    assert out.num_restored_host_tokens == out.num_restored_disk_tokens == 0
    assert engine.stats().kv_tiers is None


def _demote_to_disk(make_engine, model, directory, history):
    """An engine with a persistent disk tier and no host memory, where `history`'s blocks end up on disk."""
    engine = _engine(make_engine, model, kv_disk_dir=str(directory), kv_disk_persist=True)
    first, _ = _final(engine, "turn1", history)
    for i, p in enumerate(_fillers(4)):
        _final(engine, f"fill{i}", p)
    assert engine.stats().kv_tiers["disk"]["blocks"] >= 7
    engine.kv_tiers.close()
    return first


def test_persistent_disk_tier_survives_restart(tiny_model_dirs, make_engine, reference, tmp_path):
    model, history = tiny_model_dirs["llama"], _history(4)
    first = _demote_to_disk(make_engine, model, tmp_path / "kv", history)
    engine = _engine(make_engine, model, kv_disk_dir=str(tmp_path / "kv"), kv_disk_persist=True)
    assert engine.stats().kv_tiers["disk"]["blocks"] >= 7  # rebuilt from the files
    returning = history + first + [17, 18, 19]
    got, out = _final(engine, "after-restart", returning)
    assert got == reference(returning)
    assert out.num_restored_disk_tokens == 32


def test_scratch_disk_tier_is_cleared_at_start(tiny_model_dirs, make_engine, tmp_path):
    model = tiny_model_dirs["llama"]
    _demote_to_disk(make_engine, model, tmp_path / "kv", _history(5))
    engine = _engine(make_engine, model, kv_disk_dir=str(tmp_path / "kv"))
    assert engine.stats().kv_tiers["disk"]["blocks"] == 0
    assert not list((tmp_path / "kv").glob("*" + SUFFIX))


def test_corrupted_payload_is_rejected_and_recomputed(tiny_model_dirs, make_engine, reference, tmp_path):
    model, history = tiny_model_dirs["llama"], _history(6)
    first = _demote_to_disk(make_engine, model, tmp_path / "kv", history)
    # Flip one byte in the payload of the history's first block: its header still checks out at start.
    key = chain_key(bytes(16), history[:BS])
    path = tmp_path / "kv" / (key.hex() + SUFFIX)
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0x40
    path.write_bytes(bytes(raw))
    engine = _engine(make_engine, model, kv_disk_dir=str(tmp_path / "kv"), kv_disk_persist=True)
    returning = history + first + [17, 18, 19]
    got, out = _final(engine, "after-corruption", returning)
    assert got == reference(returning)
    assert out.num_restored_disk_tokens == 0  # the chain breaks at its first block: all recomputed
    assert engine.stats().kv_tiers["disk"]["rejected"] == 1
    assert not path.exists()


def _disk(directory, fp=b"F" * 16, persist=True):
    return DiskTier(str(directory), 1 << 20, fp, (2, 2, BS, 2, 16), torch.float32, persist)


def test_disk_files_truncated_or_foreign_are_removed(tmp_path):
    disk = _disk(tmp_path)
    blocks = []
    parent = bytes(16)
    for i in range(3):
        tokens = tuple(range(i * BS, (i + 1) * BS))
        key = chain_key(parent, tokens)
        b = TierBlock(key, parent, tokens, "disk")
        assert disk.write(b, torch.randn(2, 2, BS, 2, 16))
        blocks.append(b)
        parent = key
    disk.close()
    truncated = disk.path(blocks[1].key)
    truncated.write_bytes(truncated.read_bytes()[:-1])
    again = _disk(tmp_path)
    assert set(again.index) == {blocks[0].key, blocks[2].key} and again.rejected == 1
    assert not truncated.exists()
    foreign = _disk(tmp_path, fp=b"G" * 16)  # another model, dtype, layout or engine version
    assert not foreign.index and foreign.rejected == 2
    assert not list(tmp_path.glob("*" + SUFFIX))


def test_disk_block_round_trip_and_key_check(tmp_path):
    disk = _disk(tmp_path, persist=False)
    tokens = (5, 6, 7, 8)
    b = TierBlock(chain_key(bytes(16), tokens), bytes(16), tokens, "disk")
    data = torch.randn(2, 2, BS, 2, 16)
    assert disk.write(b, data)
    assert torch.equal(disk.read(disk.index[b.key]), data)
    # A file renamed to another block's key fails the key check.
    other = TierBlock(chain_key(bytes(16), (9, 9, 9, 9)), bytes(16), (9, 9, 9, 9), "disk")
    disk.path(b.key).rename(disk.path(other.key))
    disk.index[other.key] = other
    assert disk.read(other) is None and disk.rejected == 1


def test_concurrent_requests_restore_a_shared_prefix_once(tiny_model_dirs, make_engine, reference):
    engine = _engine(make_engine, tiny_model_dirs["llama"], kv_host_gb=_gb(64), num_kv_blocks=24, max_num_seqs=3)
    history = _history(7)
    _final(engine, "turn1", history)
    for i, p in enumerate(_fillers(6)):
        _final(engine, f"fill{i}", p)
    assert engine.stats().kv_tiers["host"]["blocks"] >= 7
    a, b = history + [40, 41], history + [50, 51, 52]
    engine.add_request("a", a, PARAMS)
    engine.add_request("b", b, PARAMS)
    got, outs = {"a": [], "b": []}, {}
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
            outs[o.request_id] = o
    assert got["a"] == reference(a) and got["b"] == reference(b)
    assert engine.stats().kv_tiers["host"]["hits"] == 7  # once, not once per request
    assert outs["a"].num_restored_host_tokens == 28 and outs["b"].num_restored_host_tokens == 0
    assert outs["b"].num_cached_tokens == 28  # b shared a's restored blocks on the device


def test_unwritable_disk_dir_turns_the_tier_off(tiny_model_dirs, make_engine, reference, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    engine = _engine(make_engine, tiny_model_dirs["llama"], kv_host_gb=_gb(2), kv_disk_dir=str(blocker / "kv"))
    out = _conversation(engine, reference, _history(8))
    s = engine.stats().kv_tiers
    assert not s["disk"]["enabled"] and s["disk"]["errors"] == 1 and s["disk"]["blocks"] == 0
    assert out.finish_reason == "length"


_FULL_DISK_SCRIPT = r"""
import json, logging, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
logging.basicConfig(level=logging.WARNING)
from hosted.engine import EngineConfig, LLMEngine, SamplingParams
model, directory, history, fillers = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
engine = LLMEngine(EngineConfig(model_dir=model, block_size=4, num_kv_blocks=16, max_num_seqs=2, kv_restore="always",
                                kv_disk_dir=directory))
# Every block file is larger than this: the first write to the disk tier fails as on a full disk (EFBIG).
resource.setrlimit(resource.RLIMIT_FSIZE, (1500, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
outs = [engine.generate([p], params)[0] for p in [history] + fillers + [history]]
print(json.dumps({"outs": outs, "tiers": engine.stats().kv_tiers}))
"""


def test_full_disk_turns_the_tier_off_without_failing_requests(tiny_model_dirs, reference, tmp_path):
    model, history = tiny_model_dirs["llama"], _history(9)
    fillers = _fillers(4)
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", _FULL_DISK_SCRIPT, model, str(tmp_path / "kv"), json.dumps(history),
                           json.dumps(fillers)], check=False, capture_output=True, text=True, cwd=root, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["outs"] == [reference(p) for p in [history] + fillers + [history]]
    disk = result["tiers"]["disk"]
    assert not disk["enabled"] and disk["errors"] >= 1
    assert "KV disk tier off" in proc.stderr and "File too large" in proc.stderr


def test_batching_preemption_and_tiers_together_match_solo(tiny_model_dirs, make_engine, reference, tmp_path):
    """Continuous batching, chunked prefill, preemption and demotions / restores within the same steps (a pool too
    small for the batch, a host tier of a few blocks, the rest on disk): every request's greedy output unchanged."""
    from tests.hosted.test_engine_batching import _prompts, _run

    prompts = _prompts() + [p + [7, 8, 9] for p in _prompts()]  # each prompt returns with a longer turn
    engine = make_engine(tiny_model_dirs["llama"], block_size=BS, num_kv_blocks=24, max_num_batched_tokens=24,
                         max_num_seqs=5, kv_host_gb=_gb(6), kv_disk_dir=str(tmp_path / "kv"), kv_restore="always")
    got = _run(engine, prompts, PARAMS, stagger=2)
    s = engine.stats()
    assert s.num_preemptions > 0 and s.kv_tiers["host"]["hits"] > 0 and s.kv_tiers["disk"]["hits"] > 0
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == reference(p), f"request {i} differs"


def _two_histories_in_host(make_engine, model):
    engine = _engine(make_engine, model, kv_host_gb=_gb(64), kv_restore="auto")
    histories = [_history(11), _history(12)]
    for i, h in enumerate(histories):
        _final(engine, f"first{i}", h)
    engine.block_manager.evict_cached()
    engine.kv_tiers.flush()
    return engine, histories


def test_auto_recomputes_where_copying_is_slower(tiny_model_dirs, make_engine, reference):
    engine, histories = _two_histories_in_host(make_engine, tiny_model_dirs["llama"])
    tiers = engine.kv_tiers
    # As measured on a machine whose host copies are slower than its prefill: a restore would lose time.
    tiers.copy_bps["host"] = tiers.bytes_per_block * tiers.prefill_tps / BS / 4
    got, out = _final(engine, "slow-copy", histories[0] + [30])
    assert got == reference(histories[0] + [30]) and out.num_restored_host_tokens == 0
    # And where copying is faster, the same kind of hit is restored.
    tiers.copy_bps["host"] = tiers.bytes_per_block * tiers.prefill_tps / BS * 4
    got, out = _final(engine, "fast-copy", histories[1] + [30])
    assert got == reference(histories[1] + [30]) and out.num_restored_host_tokens == 28


def test_one_steps_worth_of_restores_per_step(tiny_model_dirs, make_engine, reference):
    engine, histories = _two_histories_in_host(make_engine, tiny_model_dirs["llama"])
    tiers = engine.kv_tiers
    tiers.restore_policy = "always"
    tiers.copy_bps["host"] = tiers.bytes_per_block  # one block per second: a step's time copies one block
    tiers.prefill_tps = engine.config.max_num_batched_tokens
    assert tiers.restore_blocks_per_step(engine.config.max_num_batched_tokens) == 1
    prompts = [h + [30] for h in histories]
    engine.add_request("a", prompts[0], PARAMS)
    engine.add_request("b", prompts[1], PARAMS)
    got = {"a": [], "b": []}
    for o in engine.step():
        got[o.request_id] += o.new_token_ids
    # The first restore of a step goes whole; the second waits for the next step.
    assert [s.request_id for s in engine.scheduler.running] == ["a"]
    assert [s.request_id for s in engine.scheduler.waiting] == ["b"]
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    assert got == {"a": reference(prompts[0]), "b": reference(prompts[1])}
    assert engine.stats().kv_tiers["host"]["hits"] == 14


def test_a_long_restore_is_split_across_steps_beside_a_running_decode(tiny_model_dirs, make_engine, reference):
    """A restore longer than one step's worth of copying, admitted while another request decodes, goes one step's
    worth per step: the decode makes a token every step meanwhile, and the restored request's output, its usage
    split and the tier's counters are those of a restore in one go."""
    engine, histories = _two_histories_in_host(make_engine, tiny_model_dirs["llama"])
    tiers = engine.kv_tiers
    tiers.restore_policy = "always"

    def one_block_per_step():  # the measured rates move as the engine runs: hold them where a step copies one block
        tiers.copy_bps["host"] = tiers.bytes_per_block
        tiers.prefill_tps = engine.config.max_num_batched_tokens
        assert tiers.restore_blocks_per_step(engine.config.max_num_batched_tokens) == 1

    long_params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    decoding = _history(40, 9)
    engine.add_request("dec", decoding, long_params)
    got = {"dec": [], "back": []}
    for o in engine.step():  # its prefill (nothing of it is cached anywhere)
        got[o.request_id] += o.new_token_ids
    back = histories[0] + [30]
    engine.add_request("back", back, PARAMS)
    bm = engine.block_manager
    held = []
    outs = {}
    while engine.scheduler.waiting:
        before = len(got["dec"])
        one_block_per_step()
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
            outs[o.request_id] = o
        assert len(got["dec"]) == before + 1  # the decode was not held: one token this step
        waiting = [s for s in engine.scheduler.waiting if s.request_id == "back"]
        held.append(len(waiting[0].block_table) if waiting else None)
        bm.check_accounting()
    assert held == [1, 2, 3, 4, 5, 6, None]  # one block a step, then admitted with the last one
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
            outs[o.request_id] = o
    assert got == {"dec": _engine_reference(make_engine, tiny_model_dirs, decoding, long_params),
                   "back": reference(back)}
    assert outs["back"].num_restored_host_tokens == 28 and outs["back"].num_cached_tokens == 28
    assert engine.stats().kv_tiers["host"]["hits"] == 7


def _engine_reference(make_engine, tiny_model_dirs, prompt, params):
    engine = make_engine(tiny_model_dirs["llama"], enable_prefix_caching=False, num_kv_blocks=64)
    return engine.generate([prompt], params)[0]
