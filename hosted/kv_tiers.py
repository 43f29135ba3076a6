"""KV-cache tiers under the device pool: host memory, then a disk directory (issue 34).

A cached block the device pool must reuse is demoted here instead of dropped; a later request whose prefix
matches it restores it instead of recomputing, when that is cheaper. Blocks move, never copy: a block's content
lives in exactly one place (device, host, disk, or in flight between them within one engine step).

Identity: a block is keyed by a 128-bit chain digest of its whole prefix (xxh3_128 over the parent's digest and
its own token ids), and stores its parent's digest and token ids, checked on every match; disk files also carry
a fingerprint of the model (weights files, dtype, quantization, KV layout, block size, engine version) and a
checksum of their payload. A file that fails any check is removed and never used.

Copies are batched per engine step (one gather and one scatter over the device pool), done in `flush`, which the
engine calls after scheduling and before the forward: demotions first (their device blocks may be this step's
restore targets), then restores.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import xxhash

log = logging.getLogger(__name__)

ROOT_KEY = bytes(16)
KV_FORMAT_VERSION = 1
MAGIC = b"SYKVBLK1"
SUFFIX = ".kvblock"
# MAGIC | fingerprint(16) | key(16) | parent key(16) | n_tokens u32 | payload bytes u64 | checksum u64
_HEADER = len(MAGIC) + 16 + 16 + 16 + 4 + 8 + 8
# Until measured: copy bytes/s per tier and prefill tokens/s (replaced by the engine's own figures as it runs).
_PRIOR_BPS = {"host": 4e9, "disk": 1e9}
_PRIOR_PREFILL_TPS = 1000.0
_EMA = 0.3


def chain_key(parent_key: bytes, token_ids) -> bytes:
    """The 128-bit digest of a block's whole prefix: its parent's digest followed by its own token ids."""
    h = xxhash.xxh3_128()
    h.update(parent_key)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


def engine_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("switchyard")
    except PackageNotFoundError:  # a source tree, not installed: the format version still guards
        return "source"


def _file_identity(path: Path) -> bytes:
    """Name, size and the first and last MiB of a weights file: which weights these are, read in milliseconds."""
    h = xxhash.xxh3_128()
    size = path.stat().st_size
    h.update(f"{path.name}:{size}".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        if size > 2 << 20:
            f.seek(size - (1 << 20))
            h.update(f.read(1 << 20))
    return h.digest()


def fingerprint(model_path: Path, layout: dict) -> bytes:
    """16 bytes naming the model weights and everything that shapes the KV they produce."""
    h = xxhash.xxh3_128()
    files = [model_path] if model_path.is_file() else sorted(
        p for p in model_path.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf", ".json") and p.is_file())
    for p in files:
        h.update(_file_identity(p))
    h.update(repr(sorted(layout.items())).encode())
    h.update(f"kv-format-{KV_FORMAT_VERSION}:{engine_version()}".encode())
    return h.digest()


@dataclass(slots=True)
class TierBlock:
    """A block held below the device: its identity and where its KV is (a host slot, or a disk file)."""
    key: bytes
    parent_key: bytes
    token_ids: tuple[int, ...]
    tier: str  # "host" | "disk"
    slot: int = -1  # host
    data: torch.Tensor | None = None  # disk, once read back (staged for a restore)


@dataclass(slots=True)
class TierStats:
    blocks: int = 0
    hits: int = 0  # blocks restored from this tier
    bytes_in: int = 0  # demoted into it
    bytes_out: int = 0  # restored out of it
    restore_seconds: float = 0.0


class HostTier:
    """Blocks in host memory (pinned for a CUDA pool), LRU over slots. The store grows in chunks as blocks arrive,
    up to `capacity` blocks: a large budget costs nothing until it is used."""

    CHUNK = 64  # blocks per allocation

    def __init__(self, capacity: int, block_shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> None:
        self.capacity = capacity
        self.block_shape = block_shape
        self.dtype = dtype
        self.pin = pin
        self.chunks: list[torch.Tensor] = []
        self.allocated = 0  # slots [0, allocated) exist
        self.free_slots: list[int] = []
        self.index: OrderedDict[bytes, TierBlock] = OrderedDict()  # oldest first
        self.in_flight: set[int] = set()  # slots taken for a restore, freed at the flush that copies them

    @property
    def num_free(self) -> int:
        return len(self.free_slots) + self.capacity - self.allocated

    def take_slot(self) -> int:
        if not self.free_slots:
            n = min(self.CHUNK, self.capacity - self.allocated)
            assert n > 0, "host tier full"
            self.chunks.append(torch.empty((n, *self.block_shape), dtype=self.dtype, pin_memory=self.pin))
            self.free_slots = list(range(self.allocated + n - 1, self.allocated - 1, -1))
            self.allocated += n
        return self.free_slots.pop()

    def view(self, slot: int) -> torch.Tensor:
        return self.chunks[slot // self.CHUNK][slot % self.CHUNK]


class DiskTier:
    """One file per block in a directory, LRU within a byte budget. Any OSError turns the tier off (logged,
    counted): a request never fails because of it. With `persist` the directory is kept across restarts (the
    index rebuilt from the files' headers) and written files are fsynced in the background; else it is scratch,
    its block files removed at start."""

    def __init__(self, directory: str, capacity_bytes: int, fp: bytes, block_shape: tuple[int, ...],
                 dtype: torch.dtype, persist: bool) -> None:
        self.dir = Path(directory)
        self.fp = fp
        self.block_shape = block_shape
        self.dtype = dtype
        self.payload_bytes = int(np.prod(block_shape)) * torch.empty((), dtype=dtype).element_size()
        self.capacity_bytes = capacity_bytes
        self.persist = persist
        self.index: OrderedDict[bytes, TierBlock] = OrderedDict()
        self.used_bytes = 0
        self.enabled = True
        self.errors = 0
        self.rejected = 0  # files found foreign, truncated or corrupted, and removed
        self._sync: queue.Queue[Path | None] | None = None
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".probe-{os.getpid()}"
            probe.write_bytes(b"x")
            probe.unlink()
            if persist:
                self._rebuild()
            else:
                for p in self.dir.glob("*" + SUFFIX):
                    p.unlink()
        except OSError as exc:
            self.fail(exc)
            return
        if persist:
            self._sync = queue.Queue()
            threading.Thread(target=_durable, args=(self._sync,), name="kv-disk-sync", daemon=True).start()

    def file_bytes(self, n_tokens: int) -> int:
        return _HEADER + 8 * n_tokens + self.payload_bytes

    def fail(self, exc: OSError) -> None:
        self.errors += 1
        if self.enabled:
            log.warning("KV disk tier off: %s (%s); blocks beyond host memory are dropped", self.dir, exc)
        self.enabled = False
        self.index.clear()
        self.used_bytes = 0

    def path(self, key: bytes) -> Path:
        return self.dir / (key.hex() + SUFFIX)

    # ---- files -----------------------------------------------------------------------------------
    def write(self, block: TierBlock, data: torch.Tensor) -> bool:
        if not self.enabled:
            return False
        size = self.file_bytes(len(block.token_ids))
        if size > self.capacity_bytes:
            return False
        while self.used_bytes + size > self.capacity_bytes and self.index:
            self.remove(next(iter(self.index)))
        tokens = np.asarray(block.token_ids, dtype=np.int64).tobytes()
        payload = data.contiguous().view(torch.uint8).numpy().tobytes()
        checksum = xxhash.xxh64(tokens + payload).intdigest()
        header = (MAGIC + self.fp + block.key + block.parent_key + len(block.token_ids).to_bytes(4, "little")
                  + len(payload).to_bytes(8, "little") + checksum.to_bytes(8, "little"))
        final = self.path(block.key)
        tmp = final.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(tokens)
                f.write(payload)
            os.replace(tmp, final)
        except OSError as exc:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            self.fail(exc)
            return False
        self.index[block.key] = TierBlock(block.key, block.parent_key, block.token_ids, "disk")
        self.used_bytes += size
        if self._sync is not None:
            self._sync.put(final)
        return True

    def read(self, block: TierBlock) -> torch.Tensor | None:
        """The block's KV, or None (and the file removed) when it is missing, truncated or corrupted."""
        path = self.path(block.key)
        try:
            raw = path.read_bytes()
        except OSError:
            self.remove(block.key)
            return None
        parsed = self._parse(raw, len(raw), full=True)
        if parsed is None or parsed[0] != block.key:
            self.rejected += 1
            self.remove(block.key)
            return None
        start = _HEADER + 8 * len(block.token_ids)
        data = torch.frombuffer(bytearray(raw[start:]), dtype=torch.uint8).view(self.dtype).view(self.block_shape)
        return data

    def remove(self, key: bytes) -> None:
        block = self.index.pop(key, None)
        if block is not None:
            self.used_bytes -= self.file_bytes(len(block.token_ids))
        try:
            self.path(key).unlink(missing_ok=True)
        except OSError:
            pass

    def _parse(self, raw: bytes, file_size: int, full: bool) -> tuple[bytes, bytes, tuple[int, ...]] | None:
        """(key, parent key, token ids) of a block file of ours that passes every check; None otherwise.
        `raw` holds at least the header and token ids; `full` also checks the payload's checksum."""
        if len(raw) < _HEADER or raw[:len(MAGIC)] != MAGIC:
            return None
        o = len(MAGIC)
        fp, key, parent = raw[o:o + 16], raw[o + 16:o + 32], raw[o + 32:o + 48]
        o += 48
        n = int.from_bytes(raw[o:o + 4], "little")
        nbytes = int.from_bytes(raw[o + 4:o + 12], "little")
        checksum = int.from_bytes(raw[o + 12:o + 20], "little")
        if fp != self.fp or nbytes != self.payload_bytes or file_size != _HEADER + 8 * n + nbytes:
            return None
        tokens_raw = raw[_HEADER:_HEADER + 8 * n]
        if len(tokens_raw) != 8 * n:
            return None
        tokens = tuple(int(t) for t in np.frombuffer(tokens_raw, dtype=np.int64))
        if chain_key(parent, tokens) != key:
            return None
        if full and xxhash.xxh64(raw[_HEADER:]).intdigest() != checksum:
            return None
        return key, parent, tokens

    def _rebuild(self) -> None:
        """The index from the files present (oldest first); foreign or truncated files removed."""
        files = sorted(self.dir.glob("*" + SUFFIX), key=lambda p: p.stat().st_mtime_ns)
        for p in self.dir.glob("*.tmp"):
            p.unlink()  # a write cut short by a crash
        for p in files:
            size = p.stat().st_size
            with open(p, "rb") as f:
                head = f.read(_HEADER)
                n = int.from_bytes(head[len(MAGIC) + 48:len(MAGIC) + 52], "little") if len(head) == _HEADER else 0
                head += f.read(8 * n)
            parsed = self._parse(head, size, full=False)
            if parsed is None or p.name != parsed[0].hex() + SUFFIX or size + self.used_bytes > self.capacity_bytes:
                self.rejected += parsed is None
                p.unlink()
                continue
            key, parent, tokens = parsed
            self.index[key] = TierBlock(key, parent, tokens, "disk")
            self.used_bytes += size
        if self.index or self.rejected:
            log.info("KV disk tier: %d blocks kept from %s, %d files rejected", len(self.index), self.dir,
                     self.rejected)

    def close(self) -> None:
        if self._sync is not None:
            self._sync.put(None)
            self._sync = None


def _durable(paths: queue.Queue[Path | None]) -> None:
    """The disk tier's background thread: fsync each written block file (None ends it)."""
    while True:
        path = paths.get()
        if path is None:
            return
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            pass  # removed since (LRU): nothing to make durable


@dataclass(slots=True)
class _Pending:
    demotions: list[tuple[int, TierBlock]] = field(default_factory=list)  # (device block id, identity)
    restores: list[tuple[int, TierBlock]] = field(default_factory=list)  # (device block id, source)


class KVTiers:
    """The host and disk tiers of one device KV pool, and the copies between them and the pool."""

    def __init__(self, kv_cache: torch.Tensor, host_blocks: int, disk_dir: str | None, disk_bytes: int,
                 persist: bool, fp: bytes, block_size: int) -> None:
        self.kv_cache = kv_cache  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
        self.block_size = block_size
        shape = (kv_cache.shape[0], 2, *kv_cache.shape[3:])
        self.block_shape = tuple(shape)
        self.bytes_per_block = int(np.prod(shape)) * kv_cache.element_size()
        cuda = kv_cache.device.type == "cuda"
        self.host = HostTier(host_blocks, self.block_shape, kv_cache.dtype, pin=cuda)
        self.disk = (DiskTier(disk_dir, disk_bytes, fp, self.block_shape, kv_cache.dtype, persist)
                     if disk_dir else None)
        self.stream = torch.cuda.Stream(kv_cache.device) if cuda else None
        self.pending = _Pending()
        self.stats = {"host": TierStats(), "disk": TierStats()}
        self.dropped = 0  # demoted blocks neither tier could keep
        self.copy_bps = dict(_PRIOR_BPS)
        self.prefill_tps = _PRIOR_PREFILL_TPS
        self.restore_policy = "auto"  # "auto": restore only what is cheaper than recomputing; "always"

    # ---- matching ---------------------------------------------------------------------------------
    def lookup(self, key: bytes, parent_key: bytes, token_ids: tuple[int, ...]) -> TierBlock | None:
        for tier in (self.host.index, self.disk.index if self.disk is not None else None):
            if tier is None:
                continue
            block = tier.get(key)
            if block is not None and block.parent_key == parent_key and block.token_ids == token_ids:
                tier.move_to_end(key)
                return block
        return None

    def worth_restoring(self, blocks: list[TierBlock]) -> int:
        """How many leading blocks to restore: the prefix that saves the most time over recomputing (0: none)."""
        if self.restore_policy == "always":
            return len(blocks)
        best, best_saved, saved = 0, 0.0, 0.0
        recompute = self.block_size / self.prefill_tps
        for i, b in enumerate(blocks):
            saved += recompute - self.bytes_per_block / self.copy_bps[b.tier]
            if saved > best_saved:
                best, best_saved = i + 1, saved
        return best

    def restore_blocks_per_step(self, step_tokens: int) -> int:
        """Blocks a host restore copies in about the time of one step of `step_tokens` tokens."""
        step_s = step_tokens / self.prefill_tps
        return max(1, int(step_s * self.copy_bps["host"] / self.bytes_per_block))

    def take(self, blocks: list[TierBlock]) -> list[TierBlock]:
        """Move the blocks out of their tiers for a restore (disk ones read and verified now); stops at the first
        that cannot be read. Returns those taken, each to be passed to `queue_restore`."""
        taken = []
        for b in blocks:
            if b.tier == "host":
                del self.host.index[b.key]
                self.host.in_flight.add(b.slot)
            else:
                assert self.disk is not None
                t0 = time.perf_counter()
                data = self.disk.read(b)
                if data is None:
                    break
                self.disk.remove(b.key)
                b.data = data
                elapsed = time.perf_counter() - t0
                self.stats["disk"].restore_seconds += elapsed
                self._observe("disk", self.bytes_per_block, elapsed)
            taken.append(b)
        return taken

    def discard(self, key: bytes) -> None:
        """The device now holds this block (computed again): drop any lower copy, so it lives in one place."""
        block = self.host.index.pop(key, None)
        if block is not None:
            self.host.free_slots.append(block.slot)
        elif self.disk is not None and key in self.disk.index:
            self.disk.remove(key)

    # ---- queued copies ------------------------------------------------------------------------------
    def queue_demotion(self, block_id: int, key: bytes, parent_key: bytes, token_ids: tuple[int, ...]) -> None:
        self.pending.demotions.append((block_id, TierBlock(key, parent_key, token_ids, "host")))

    def queue_restore(self, block_id: int, block: TierBlock) -> None:
        self.pending.restores.append((block_id, block))

    def flush(self) -> None:
        """Do this step's copies: demotions (device -> host, host overflow -> disk), then restores."""
        pending, self.pending = self.pending, _Pending()
        if pending.demotions:
            self._demote(pending.demotions)
        if pending.restores:
            self._restore(pending.restores)

    def _demote(self, demotions: list[tuple[int, TierBlock]]) -> None:
        ids = torch.tensor([d[0] for d in demotions], dtype=torch.int64, device=self.kv_cache.device)
        # [n, layers, 2, block_size, kv_heads, head_dim] on the host, one gather for the step.
        gathered = self.kv_cache.index_select(2, ids).permute(2, 0, 1, 3, 4, 5)
        host_room = self.host.capacity - len(self.host.in_flight)
        keep = demotions[-host_room:] if host_room > 0 else []  # the newest go to host memory
        overflow = demotions[:len(demotions) - len(keep)]
        if keep:
            self._make_host_room(len(keep))
            slots = [self.host.take_slot() for _ in keep]
            src = self._to_host(gathered[len(overflow):])
            for i, (slot, (_, b)) in enumerate(zip(slots, keep)):
                self.host.view(slot).copy_(src[i])
                b.slot = slot
                self.host.index[b.key] = b
            self.stats["host"].bytes_in += len(keep) * self.bytes_per_block
        if overflow:
            cpu = gathered[:len(overflow)].to("cpu")
            for i, (_, b) in enumerate(overflow):
                self._to_disk(b, cpu[i])

    def _make_host_room(self, n: int) -> None:
        """Free n host slots, moving the least recently used blocks to disk (or dropping them)."""
        while self.host.num_free < n:
            _, b = self.host.index.popitem(last=False)
            self._to_disk(b, self.host.view(b.slot))
            self.host.free_slots.append(b.slot)

    def _to_disk(self, b: TierBlock, data: torch.Tensor) -> None:
        if self.disk is not None and self.disk.write(b, data):
            self.stats["disk"].bytes_in += self.bytes_per_block
        else:
            self.dropped += 1

    def _to_host(self, src: torch.Tensor) -> torch.Tensor:
        """The gathered blocks in host memory: as they are on a CPU pool; on CUDA one device -> pinned copy on the
        side stream (after the compute that wrote them)."""
        if self.stream is None:
            return src
        self.stream.wait_stream(torch.cuda.current_stream(self.kv_cache.device))
        with torch.cuda.stream(self.stream):
            out = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            out.copy_(src, non_blocking=True)
        self.stream.synchronize()
        return out

    def _restore(self, restores: list[tuple[int, TierBlock]]) -> None:
        t0 = time.perf_counter()
        host = [(i, b) for i, b in restores if b.tier == "host"]
        disk = [(i, b) for i, b in restores if b.tier == "disk"]
        parts, dst = [], []
        if host:
            parts.append(torch.stack([self.host.view(b.slot) for _, b in host]))
            dst += [i for i, _ in host]
        if disk:
            parts.append(torch.stack([b.data for _, b in disk]))
            dst += [i for i, _ in disk]
        src = torch.cat(parts) if len(parts) > 1 else parts[0]
        dev = self.kv_cache.device
        dst_t = torch.tensor(dst, dtype=torch.int64, device=dev)
        if self.stream is None:
            self.kv_cache.index_copy_(2, dst_t, src.permute(1, 2, 0, 3, 4, 5))
        else:
            # Host -> device on the side stream, after what the current stream queued (this step's demotion gather
            # reads blocks restored into here); the forward (current stream) waits for it, not the CPU.
            self.stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(self.stream):
                moved = src.pin_memory().to(dev, non_blocking=True)
                self.kv_cache.index_copy_(2, dst_t, moved.permute(1, 2, 0, 3, 4, 5))
            torch.cuda.current_stream(dev).wait_stream(self.stream)
            self.stream.synchronize()  # the host slots are reused at once
        elapsed = time.perf_counter() - t0
        for _, b in host:
            self.host.in_flight.discard(b.slot)
            self.host.free_slots.append(b.slot)
        for _, b in disk:
            b.data = None
        hs, ds = self.stats["host"], self.stats["disk"]
        hs.hits += len(host)
        ds.hits += len(disk)
        hs.bytes_out += len(host) * self.bytes_per_block
        ds.bytes_out += len(disk) * self.bytes_per_block
        share = len(host) / len(restores)
        hs.restore_seconds += elapsed * share
        ds.restore_seconds += elapsed * (1 - share)
        if host and not disk:
            self._observe("host", len(host) * self.bytes_per_block, elapsed)

    def _observe(self, tier: str, nbytes: int, seconds: float) -> None:
        if seconds > 0 and nbytes > 0:
            self.copy_bps[tier] = (1 - _EMA) * self.copy_bps[tier] + _EMA * nbytes / seconds

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if seconds > 0 and tokens > 0:
            self.prefill_tps = (1 - _EMA) * self.prefill_tps + _EMA * tokens / seconds

    # ---- introspection ------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        out = {}
        for name, s in self.stats.items():
            held = len(self.host.index) if name == "host" else (len(self.disk.index) if self.disk else 0)
            out[name] = {"blocks": held, "hits": s.hits, "bytes_in": s.bytes_in, "bytes_out": s.bytes_out,
                         "restore_seconds": s.restore_seconds}
        out["disk"]["enabled"] = bool(self.disk is not None and self.disk.enabled)
        out["disk"]["errors"] = self.disk.errors if self.disk is not None else 0
        out["disk"]["rejected"] = self.disk.rejected if self.disk is not None else 0
        out["dropped"] = self.dropped
        return out

    def check(self, device_keys: set[bytes]) -> None:
        """Assert the accounting: every host slot free, held or in flight exactly once; disk bytes add up; a
        block's key in one place only (device, host or disk)."""
        h = self.host
        held = [b.slot for b in h.index.values()]
        slots = held + h.free_slots + list(h.in_flight)
        assert sorted(slots) == list(range(h.allocated)), "host slots lost or double-booked"
        assert not self.pending.demotions and not self.pending.restores, "copies queued but not flushed"
        disk_keys = set(self.disk.index) if self.disk is not None else set()
        if self.disk is not None:
            assert self.disk.used_bytes == sum(self.disk.file_bytes(len(b.token_ids))
                                               for b in self.disk.index.values())
        host_keys = set(h.index)
        assert not (host_keys & disk_keys), "a block in host memory and on disk"
        assert not (device_keys & (host_keys | disk_keys)), "a block on the device and in a lower tier"

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()


def build_kv_tiers(config, model_config, runner) -> KVTiers:
    """The tiers an EngineConfig asks for (kv_host_gb, kv_disk_dir, kv_disk_gb, kv_disk_persist) under
    runner's KV pool, with the fingerprint of what produced that KV."""
    from hosted.checkpoint import resolve_model_path

    layout = {"model_type": model_config.model_type, "layers": model_config.num_hidden_layers,
              "kv_heads": model_config.num_key_value_heads, "head_dim": model_config.head_dim,
              "dtype": config.dtype, "kv_dtype": str(runner.kv_dtype), "block_size": config.block_size,
              "quantization": config.quantization, "group": config.quantization_group_size,
              "kernels": getattr(runner.kernels, "name", "?"), "device": runner.device.type}
    fp = fingerprint(resolve_model_path(config.model_dir), layout)
    host_blocks = int(config.kv_host_gb * (1 << 30)) // runner.bytes_per_block
    tiers = KVTiers(runner.kv_cache, host_blocks, config.kv_disk_dir, int(config.kv_disk_gb * (1 << 30)),
                    config.kv_disk_persist, fp, config.block_size)
    tiers.restore_policy = config.kv_restore
    log.info("KV tiers: host %d blocks (%.2f GiB)%s", host_blocks, config.kv_host_gb,
             f", disk {config.kv_disk_dir} ({config.kv_disk_gb:g} GiB{', persistent' if config.kv_disk_persist else ''})"
             if config.kv_disk_dir else "")
    return tiers
