"""One live policy for every gateway replica sharing a Redis (`serve --redis-url`; issue 32, item 1).

A replica whose policy file changes (gateway/policy_store.py's watcher swapped a new, valid version in) puts the
text in Redis (hash `switchyard:policy`: version, text, at = the file's mtime, replica) and announces the version
on the channel `switchyard:policy`; every other replica reads it, validates it with its own parser and swaps it in
(PolicyStore.adopt) at once. A missed message costs at most CHECK_S: each replica also compares the shared version
with its own every CHECK_S (one HGET).

At start the newer one wins: this replica's file (its mtime) or the shared policy (its `at`). A rolling deploy's
new file replaces the cluster's policy; a replica restarting with an older copy of the file takes the cluster's.
The replicas' clocks are trusted to agree within seconds (NTP). A shared text that does not validate here (a field
this replica's version does not know) is refused once per version, logged and shown in /health; this replica keeps
serving what it has. A Redis restarted empty gets the policy back from the first replica that looks.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from gateway.policy import Policy, PolicyError, parse_policy
from gateway.policy_warnings import policy_warnings
from gateway.shared_state import POLICY_CHANNEL, PREFIX, SharedState
from gateway.tasks import poll_forever

if TYPE_CHECKING:
    from gateway.policy_store import PolicyStore

log = logging.getLogger("switchyard.shared_policy")

POLICY_KEY = f"{PREFIX}:policy"  # hash: version, text, at, replica (POLICY_CHANNEL announces a new one)
CHECK_S = 1.0


def _parse(text: str, source: str) -> tuple[Policy, list[str]]:
    """In a thread: validate as a file is, and its warnings for this replica (an env var unset here, a model file
    missing here)."""
    policy = parse_policy(text, source)
    return policy, policy_warnings(policy)


class SharedPolicy:
    def __init__(self, state: SharedState, store: PolicyStore) -> None:
        self._state, self._store = state, store
        self.shared_version: str | None = None  # the version in Redis when last read
        self.refused: dict | None = None  # the last shared version this replica could not validate, and why
        self._at: float = store.file_mtime or time.time()  # when the policy served now was written
        self._lock = asyncio.Lock()
        self._task: asyncio.Task | None = None
        self._kicks: set[asyncio.Task] = set()
        store.on_change(self._changed, first=True)  # the others start adopting while this one applies it
        state.on_message(POLICY_CHANNEL, self._announced)
        state.policy = self  # its /health block and its close go with the shared state's

    async def start(self) -> None:
        await self.check()  # Redis away: this file's policy; the checks catch up once it answers
        self._task = asyncio.create_task(poll_forever(self.check, CHECK_S, "shared policy"), name="shared-policy")

    async def aclose(self) -> None:
        for task in [*self._kicks, *([self._task] if self._task else [])]:
            task.cancel()
        if self._task is not None:  # bounded: a cancellation landing inside redis-py's I/O can be swallowed there
            await asyncio.wait({self._task, *self._kicks}, timeout=2.0)

    def health(self) -> dict:
        """/health's `shared_state.policy`: the cluster's version and whether this replica serves it."""
        serving = self._store.current.version if self._store.current else None
        return {"shared_version": self.shared_version, "serving": serving,
                "in_step": self.shared_version is None or self.shared_version == serving, "refused": self.refused}

    async def check(self) -> None:
        """At start, every CHECK_S and on each announcement: the newer of the shared policy and the one served here
        wins (the shared one is adopted, or this one shared: the first replica up, a newer file at start, an edit
        made while Redis was away, a Redis restarted empty)."""
        async with self._lock:
            try:
                version, at = await self._state.client.hmget(POLICY_KEY, ["version", "at"])
                self.shared_version = version
                if version == self._store.current.version:
                    return
                if version is None or float(at or 0) < self._at:
                    await self._publish()
                elif not (self.refused and self.refused["version"] == version):
                    await self._adopt()
            except Exception as exc:  # Redis away: the shared state's heartbeat logs the outage
                if not self._state._is_redis_error(exc):
                    raise

    async def _adopt(self) -> None:
        version, text, at, replica = await self._state.client.hmget(POLICY_KEY, ["version", "text", "at", "replica"])
        if version is None or text is None:
            return
        try:
            policy, warnings = await asyncio.to_thread(_parse, text, str(self._store.path))
        except PolicyError as exc:
            self.refused = {"version": version, "replica": replica, "error": str(exc).splitlines()[0][:300]}
            log.error("shared policy: version %s from replica %s does not validate here; still serving %s:\n%s",
                      version, replica, self._store.current.version, exc)
            return
        self._at = float(at or 0)
        self.shared_version = version
        await self._store.adopt(policy, text, f"replica {replica}", warnings)

    async def _changed(self, policy: Policy) -> None:
        """The store's listener: a version read from this replica's file goes to every replica."""
        if self._store.origin != "file":
            return  # adopted: it is the shared one already
        self._at = self._store.file_mtime or time.time()
        try:
            async with self._lock:
                await self._publish()
        except Exception as exc:  # noqa: BLE001 - Redis away: the first check after it returns shares it
            log.warning("shared policy: could not share version %s yet (%s)", policy.version, exc)

    async def _publish(self) -> None:
        policy, text = self._store.current, self._store.text
        if text is None:
            log.warning("shared policy: version %s's text is unknown (its file changed while read); not shared",
                        policy.version)
            return
        async with self._state.client.pipeline(transaction=True) as pipe:
            pipe.hset(POLICY_KEY, mapping={"version": policy.version, "text": text, "at": repr(self._at),
                                           "replica": self._state.replica_id})
            pipe.publish(POLICY_CHANNEL, policy.version)
            await pipe.execute()
        self.shared_version = policy.version
        self.refused = None
        log.info("shared policy: version %s shared with every replica", policy.version)

    def _announced(self, _version: str) -> None:
        task = asyncio.ensure_future(self.check())
        self._kicks.add(task)
        task.add_done_callback(self._kicks.discard)
