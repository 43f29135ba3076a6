"""The live policy, hot-reloaded: a valid edit is swapped in atomically, an invalid one is rejected.

Readers take `store.current` (a plain attribute read, so a request sees one whole policy). A background
task polls the file's stamp (mtime_ns, size, inode); the swap is a single reference assignment.

A reload cannot hurt traffic:
- the file is read and validated in a thread (bounded: 1 MiB, limited YAML alias expansion; see
  gateway/policy_diagnostics.py), never on the event loop;
- only a whole file goes live: a changed stamp must stay the same for `settle_s` (a file being written in
  place keeps changing), unless a new inode replaced a file that was there (an atomic rename, which is
  whole by construction) — that is read at once. A stamp that changes while the file is being read is not
  judged; the next poll looks again;
- a rejected, unreadable or deleted file leaves the last good policy serving; `status()` (in `/health`)
  and the metrics switchyard_policy_reload_errors_total / switchyard_policy_reload_failing say so.

Replicas sharing a Redis (gateway/shared_policy.py) also take a policy another replica read from its file:
`adopt()` swaps it in the same way (its listeners run), and `status()` names its origin.
"""
from __future__ import annotations

import asyncio
import hashlib
import inspect
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from gateway import metrics
from gateway.policy import Policy, PolicyError, load_policy
from gateway.policy_warnings import policy_warnings
from gateway.tasks import cancel_and_wait, poll_forever

log = logging.getLogger("switchyard.policy")

PolicyCallback = Callable[[Policy], Awaitable[None] | None]


@dataclass(frozen=True, slots=True)
class FileStamp:
    mtime_ns: int
    size: int
    inode: int

    def as_dict(self) -> dict[str, int]:
        return {"mtime_ns": self.mtime_ns, "size": self.size, "inode": self.inode}


@dataclass(frozen=True, slots=True)
class ReloadError:
    message: str
    at: float  # unix time
    stamp: FileStamp | None  # None: the file was missing

    def as_dict(self) -> dict:
        return {"message": self.message, "at": _iso(self.at),
                "file": self.stamp.as_dict() if self.stamp else None}


class _ChangedWhileReading(Exception):
    pass


class PolicyStore:
    def __init__(self, path: str | Path, poll_interval_s: float = 0.5, settle_s: float = 0.3):
        self.path = Path(path)
        self.poll_interval_s = poll_interval_s
        self.settle_s = settle_s  # a changed stamp must hold this long before the file is read (0: at once)
        self.current: Policy | None = None
        self.text: str | None = None  # the current policy's text (None: the file changed while it was read back)
        self.origin = "file"  # or "replica <id>": adopted from another replica through Redis
        self.file_mtime: float | None = None  # unix time the file last loaded from it was written
        self.loaded_at: float | None = None
        self.reload_errors = 0
        self.reloads = 0
        self.last_error: str | None = None  # the failure now (None once a good file is back)
        self.last_failure: ReloadError | None = None  # the latest failure, kept after recovery
        self._stamp: FileStamp | None = None  # the stamp last judged (loaded, rejected or unchanged)
        self._pending: tuple[FileStamp, float] | None = None  # a new stamp and when it was first seen
        self._missing = False
        self._callbacks: list[PolicyCallback] = []
        self._task: asyncio.Task | None = None

    def on_change(self, callback: PolicyCallback, *, first: bool = False) -> None:
        """Call `callback(new_policy)` (sync or async) after each successful swap (not for the first load); `first`:
        before the listeners already registered (sharing a new version with the other replicas goes first)."""
        if first:
            self._callbacks.insert(0, callback)
        else:
            self._callbacks.append(callback)

    async def start(self) -> Policy:
        """Load the file once (a bad file raises PolicyError) and start watching it."""
        self._stamp = _file_stamp(self.path)
        self.current, warnings, self.text = await asyncio.to_thread(_load, self.path)
        self.file_mtime = self._stamp.mtime_ns / 1e9 if self._stamp else None
        self.loaded_at = time.time()
        metrics.POLICY_RELOAD_FAILING.set(0)
        log.info("policy loaded from %s: version %s, %d routes, %d backends", self.path,
                 self.current.version, len(self.current.routes), len(self.current.backends))
        _log_warnings(warnings)
        if self._task is None:
            self._task = asyncio.create_task(self._watch(), name="policy-watch")
        return self.current

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    def status(self) -> dict:
        """What `/health` shows: the live version, the file's state and the last reload error."""
        current = self.current
        return {
            "version": current.version if current else None,
            "origin": self.origin,
            "path": str(self.path),
            "live_since": _iso(self.loaded_at) if self.loaded_at else None,
            "file": "missing" if self._missing else ("settling" if self._pending else "ok"),
            "reloads": self.reloads,
            "reload_errors": self.reload_errors,
            "reload_failing": self.last_error is not None,
            "last_reload_error": self.last_failure.as_dict() if self.last_failure else None,
        }

    async def check_now(self) -> bool:
        """Reload if the file changed and has settled. Returns True when a new policy was swapped in."""
        stamp = _file_stamp(self.path)
        if stamp is None:
            self._on_missing()
            return False
        if stamp == self._stamp:
            self._pending = None
            return False
        if not self._settled(stamp):
            return False
        try:
            policy, warnings, text = await asyncio.to_thread(self._read, stamp)
        except _ChangedWhileReading:
            self._pending = None  # still being written: start the settle wait again
            return False
        except PolicyError as e:
            self._judged(stamp)
            self._fail(str(e), stamp, "invalid")
            return False
        self._judged(stamp)
        self.file_mtime = stamp.mtime_ns / 1e9
        if self.current is not None and policy.version == self.current.version:
            self.origin = "file"  # touched, restored as it was, or now holding what a replica sent
            self._recovered()
            return False
        await self._swap(policy, warnings, text, "file")
        return True

    async def adopt(self, policy: Policy, text: str, origin: str, warnings: list[str] | None = None) -> bool:
        """Serve a policy another replica read from its file (validated by the caller); its listeners run as for a
        reload. The file watcher goes on: this file's next change is swapped in (and shared) as ever."""
        if self.current is not None and policy.version == self.current.version:
            return False
        await self._swap(policy, warnings or [], text, origin)
        return True

    def _settled(self, stamp: FileStamp) -> bool:
        """Has this stamp held for settle_s? A new inode in place of a file that was there (an atomic
        rename) is whole already; a file created where none was may still be being written."""
        if self.settle_s <= 0 or (self._stamp is not None and stamp.inode != self._stamp.inode):
            return True
        now = time.monotonic()
        if self._pending is None or self._pending[0] != stamp:
            self._pending = (stamp, now)
            return False
        return now - self._pending[1] >= self.settle_s

    def _read(self, stamp: FileStamp) -> tuple[Policy, list[str], str | None]:
        """In a thread: load and validate, then make sure the file did not change while it was read."""
        loaded = _load(self.path)
        if _file_stamp(self.path) != stamp:
            raise _ChangedWhileReading
        return loaded

    def _judged(self, stamp: FileStamp) -> None:
        self._stamp, self._pending, self._missing = stamp, None, False

    async def _swap(self, policy: Policy, warnings: list[str], text: str | None, origin: str) -> None:
        old = self.current
        self.current = policy  # the atomic swap
        self.text, self.origin = text, origin
        self.loaded_at = time.time()
        self.reloads += 1
        if origin == "file":
            self._recovered()
        log.info("policy reloaded from %s: version %s -> %s", self.path if origin == "file" else origin,
                 old.version if old else "-", policy.version)
        _log_warnings(warnings)
        for cb in list(self._callbacks):
            try:
                result = cb(policy)
                if inspect.isawaitable(result):
                    await result
            except Exception:  # a failing listener must not stop the watcher or undo the swap
                log.exception("policy change callback %r failed", cb)

    def _on_missing(self) -> None:
        self._pending = None
        if self._missing:
            return  # counted once per disappearance
        self._missing, self._stamp = True, None  # a file that comes back is new: it settles first
        self._fail(f"{self.path}: the policy file is missing (deleted or moved away)", None, "missing")

    def _fail(self, message: str, stamp: FileStamp | None, reason: str) -> None:
        self.reload_errors += 1
        self.last_error = message
        self.last_failure = ReloadError(message, time.time(), stamp)
        metrics.POLICY_RELOAD_ERRORS.labels(reason).inc()
        metrics.POLICY_RELOAD_FAILING.set(1)
        log.error("policy reload rejected; still serving version %s:\n%s",
                  self.current.version if self.current else "-", message)

    def _recovered(self) -> None:
        if self.last_error is not None:
            log.info("policy file %s is good again; serving version %s", self.path,
                     self.current.version if self.current else "-")
        self.last_error = None
        metrics.POLICY_RELOAD_FAILING.set(0)

    async def _watch(self) -> None:
        await poll_forever(self.check_now, self.poll_interval_s, "policy watcher")


def _load(path: Path) -> tuple[Policy, list[str], str | None]:
    """Blocking (run in a thread): the validated policy, its warnings (these stat files too) and its text (None if
    the file changed in between: _read then sees a new stamp)."""
    policy = load_policy(path)
    try:
        text = path.read_bytes().decode("utf-8")  # as load_policy read it (no newline translation)
    except (OSError, UnicodeDecodeError):
        text = None
    if text is not None and hashlib.sha256(text.encode("utf-8")).hexdigest()[:16] != policy.version:
        text = None
    return policy, policy_warnings(policy), text


def _log_warnings(warnings: list[str]) -> None:
    for warning in warnings:
        log.warning("%s", warning)


def _file_stamp(path: Path) -> FileStamp | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return FileStamp(st.st_mtime_ns, st.st_size, st.st_ino)


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds")
