"""The live policy, hot-reloaded: a valid edit is swapped in atomically, an invalid one is rejected.

Readers take `store.current` (a plain attribute read, so a request sees one whole policy). A background
task polls the file's (mtime, size) and reloads on change; the swap is a single reference assignment.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

from gateway.policy import Policy, PolicyError, load_policy, policy_warnings
from gateway.tasks import cancel_and_wait, poll_forever

log = logging.getLogger("switchyard.policy")

PolicyCallback = Callable[[Policy], Awaitable[None] | None]


class PolicyStore:
    def __init__(self, path: str | Path, poll_interval_s: float = 0.5):
        self.path = Path(path)
        self.poll_interval_s = poll_interval_s
        self.current: Policy | None = None
        self.reload_errors = 0
        self.reloads = 0
        self.last_error: str | None = None
        self._stamp: tuple[int, int] | None = None
        self._callbacks: list[PolicyCallback] = []
        self._task: asyncio.Task | None = None

    def on_change(self, callback: PolicyCallback) -> None:
        """Call `callback(new_policy)` (sync or async) after each successful swap (not for the first load)."""
        self._callbacks.append(callback)

    async def start(self) -> Policy:
        """Load the file once (a bad file raises PolicyError) and start watching it."""
        self._stamp = self._file_stamp()
        self.current = load_policy(self.path)
        log.info("policy loaded from %s: version %s, %d routes, %d backends", self.path,
                 self.current.version, len(self.current.routes), len(self.current.backends))
        self._warn(self.current)
        if self._task is None:
            self._task = asyncio.create_task(self._watch(), name="policy-watch")
        return self.current

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def check_now(self) -> bool:
        """Reload if the file changed since the last look. Returns True when a new policy was swapped in."""
        stamp = self._file_stamp()
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            policy = load_policy(self.path)
        except PolicyError as e:
            self.reload_errors += 1
            self.last_error = str(e)
            log.error("policy reload rejected; still serving version %s:\n%s",
                      self.current.version if self.current else "-", e)
            return False
        if self.current is not None and policy.version == self.current.version:
            return False  # touched but unchanged
        old = self.current
        self.current = policy  # the atomic swap
        self.reloads += 1
        self.last_error = None
        log.info("policy reloaded from %s: version %s -> %s", self.path,
                 old.version if old else "-", policy.version)
        self._warn(policy)
        for cb in list(self._callbacks):
            try:
                result = cb(policy)
                if inspect.isawaitable(result):
                    await result
            except Exception:  # a failing listener must not stop the watcher or undo the swap
                log.exception("policy change callback %r failed", cb)
        return True

    @staticmethod
    def _warn(policy: Policy) -> None:
        for warning in policy_warnings(policy):
            log.warning("%s", warning)

    def _file_stamp(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size)

    async def _watch(self) -> None:
        await poll_forever(self.check_now, self.poll_interval_s, "policy watcher")
