"""Gateway replicas as one: budgets and RPM/TPM windows shared through Redis (`switchyard serve --redis-url`).

The hot path makes one round trip per request: one Lua script checks the key's RPM and TPM windows and reserves its
worst-case cost, atomically for every replica (nothing is counted unless everything passes). Settling (the real
cost in, the reservation out) and token counts go after the answer, off the request's latency. Reservations carry
an expiry, so a crashed replica's reservations stop holding budget after RESERVATION_TTL_S.

Spend is seeded from the ledger (SUM(cost_usd) per key, as BudgetBook does) the first time Redis has no account
for a key (also after a Redis restart), and reconciled with the ledger every RECONCILE_S: Redis takes the larger
of the two, so spend the ledger holds and Redis lost is never forgotten (errs towards refusing, never overspends).

Redis unreachable: every replica enforces locally with its share (1 / the last live replica count, from the
replicas' heartbeats) of each key's remaining budget and of its RPM/TPM; `/health` (`shared_state`), the metric
`switchyard_shared_state_up` and the log say so. What was settled or admitted meanwhile is replayed into Redis
once it answers again, and the ledger reconciliation follows at once.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass, replace

from prometheus_client import Gauge
from redis.exceptions import NoScriptError

from gateway import errors
from gateway.budgets import BudgetBook, Reservation
from gateway.keys import KeyInfo
from gateway.ratelimit import WINDOW_S, RateLimiter
from gateway.redis_wire import WireClient, encode

log = logging.getLogger("switchyard.shared_state")

RESERVATION_TTL_S = 900.0  # longer than any request the gateway lets run; a crashed replica's holds go after it
HEARTBEAT_S = 1.0  # replicas announce themselves this often (and a replica in fallback probes Redis)
REPLICA_TTL_S = 5.0  # a replica not heard from for this long no longer counts
RECONCILE_S = 30.0  # Redis spend vs the ledger
SOCKET_TIMEOUT_S = 1.0  # a Redis that hangs sends the request to local enforcement, not to a stall
# The heartbeat, seeding and replay (off the hot path) wait longer: on a loaded machine a slow reply is the gateway's
# own event loop lagging, and a false outage would hand out local shares on top of the shared budget.
BACKGROUND_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 32  # to Redis, per replica; a request waits up to POOL_WAIT_S for one (then: local enforcement)
POOL_WAIT_S = 5.0
FLUSH_DELAY_S = 0.02  # settles and token counts wait this long to share a write with those of other requests
MAX_PENDING = 100_000  # settles and admissions kept for replay during an outage (oldest dropped past this)
PREFIX = "switchyard"
KEY_CHANNEL = f"{PREFIX}:keys"  # pub/sub: the id of a key revoked, updated or rotated
POLICY_CHANNEL = f"{PREFIX}:policy"  # pub/sub: a policy version a replica shared (gateway/shared_policy.py)

SHARED_UP = Gauge("switchyard_shared_state_up", "1 while budgets and rate limits are shared through Redis; 0 while "
                                                "this replica enforces its share locally (Redis unreachable)")
SHARED_REPLICAS = Gauge("switchyard_shared_state_replicas", "Live gateway replicas (last count seen in Redis)")

# The key whose RPM/TPM the budget script already counted for this request: the limiter's admit() then has nothing
# left to do (a request's reserve and admit run in its own task, one after the other).
_ADMITTED: ContextVar[str | None] = ContextVar("switchyard_admitted", default=None)

_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local budget, est = ARGV[1], tonumber(ARGV[2])
local rpm, tpm, prompt = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
if budget ~= '' then
  if redis.call('HEXISTS', KEYS[1], 'spent') == 0 then return {0, 'seed'} end
  local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
  if #expired > 0 then
    local freed = 0
    for _, rid in ipairs(expired) do freed = freed + tonumber(redis.call('HGET', KEYS[3], rid) or '0') end
    redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
    redis.call('HDEL', KEYS[3], unpack(expired))
    redis.call('HINCRBYFLOAT', KEYS[1], 'reserved', -freed)
  end
end
if rpm then
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now - 60000)
  if redis.call('ZCARD', KEYS[4]) >= rpm then
    local oldest = redis.call('ZRANGE', KEYS[4], 0, 0, 'WITHSCORES')
    return {0, 'rpm', tostring((tonumber(oldest[2]) + 60000 - now) / 1000)}
  end
end
if tpm then
  local sec, used, oldest = math.floor(now / 1000), 0, nil
  local all = redis.call('HGETALL', KEYS[5])
  for i = 1, #all, 2 do
    local s = tonumber(all[i])
    if s <= sec - 60 then redis.call('HDEL', KEYS[5], all[i])
    else
      used = used + tonumber(all[i + 1])
      if oldest == nil or s < oldest then oldest = s end
    end
  end
  if used + prompt > tpm then
    local retry = 60
    if oldest then retry = oldest + 60 - sec end
    return {0, 'tpm', tostring(retry), tostring(used)}
  end
end
local spent, reserved = '0', '0'
if budget ~= '' then
  local acct = redis.call('HMGET', KEYS[1], 'spent', 'reserved')
  spent, reserved = acct[1], acct[2] or '0'
  local r = tonumber(reserved)
  if r < 1e-12 then r = 0 end
  local committed = tonumber(spent) + r
  if not (committed + est <= tonumber(budget) + 1e-12) then return {0, 'budget', tostring(committed)} end
  redis.call('HINCRBYFLOAT', KEYS[1], 'reserved', est)
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[7]), ARGV[6])
  redis.call('HSET', KEYS[3], ARGV[6], ARGV[2])
end
if rpm then
  redis.call('ZADD', KEYS[4], now, ARGV[6])
  redis.call('PEXPIRE', KEYS[4], 61000)
end
return {1, spent, reserved}
"""

# KEYS: acct, res, resamt; ARGV: reservation id ('' none), actual USD. The reservation goes back (when it is still
# there: not expired, not lost with a restarted Redis) and the cost is booked (when the key's account exists: else
# the next seed reads it from the ledger).
_SETTLE = """
if ARGV[1] ~= '' then
  local amt = redis.call('HGET', KEYS[3], ARGV[1])
  if amt then
    redis.call('HDEL', KEYS[3], ARGV[1])
    redis.call('ZREM', KEYS[2], ARGV[1])
    redis.call('HINCRBYFLOAT', KEYS[1], 'reserved', -tonumber(amt))
  end
end
if tonumber(ARGV[2]) ~= 0 and redis.call('HEXISTS', KEYS[1], 'spent') == 1 then
  redis.call('HINCRBYFLOAT', KEYS[1], 'spent', ARGV[2])
end
return 1
"""

# KEYS: acct; ARGV: the ledger's sum. Seeds a missing account; raises a lower spend to the ledger's (reconcile).
_SEED = """
if redis.call('HEXISTS', KEYS[1], 'spent') == 0 then
  redis.call('HSET', KEYS[1], 'spent', ARGV[1], 'reserved', '0')
elseif tonumber(redis.call('HGET', KEYS[1], 'spent')) < tonumber(ARGV[1]) then
  redis.call('HSET', KEYS[1], 'spent', ARGV[1])
end
return tostring(redis.call('HGET', KEYS[1], 'spent'))
"""


def _keys(key_id: str) -> tuple[str, str, str, str, str]:
    base = f"{PREFIX}:key:{{{key_id}}}"  # one hash slot per key (Redis Cluster runs the script on one node)
    return f"{base}:acct", f"{base}:res", f"{base}:resamt", f"{base}:rpm", f"{base}:tpm"


@dataclass(slots=True)
class _Local:
    """A key's local account while Redis is unreachable: what this replica settled and holds since."""
    base_spent: float  # the key's spend when the outage began (last seen in Redis, or the ledger's)
    spent: float = 0.0
    reserved: float = 0.0


class SharedState:
    """This replica's link to Redis: the scripts, the heartbeat, the fallback and the replay after an outage."""

    def __init__(self, url: str, load_spent: Callable[[str], Awaitable[float]], *,
                 reservation_ttl_s: float = RESERVATION_TTL_S, heartbeat_s: float = HEARTBEAT_S,
                 reconcile_s: float = RECONCILE_S, socket_timeout_s: float = SOCKET_TIMEOUT_S) -> None:
        import redis.asyncio as aioredis

        self.url = url
        # A bounded pool: a burst of concurrent requests queues for a connection instead of opening one each (a
        # connection storm times connects out and would send the burst to local enforcement).
        pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=MAX_CONNECTIONS, timeout=POOL_WAIT_S,
                                                        socket_timeout=max(socket_timeout_s,
                                                                           BACKGROUND_TIMEOUT_S),
                                                        socket_connect_timeout=socket_timeout_s,
                                                        decode_responses=True)
        self._client = aioredis.Redis(connection_pool=pool)
        # The hot path (admission, then the settles) on one pipelined socket of its own (gateway/redis_wire.py)
        self._wire = WireClient(url, socket_timeout_s)
        self._admit = self._client.register_script(_ADMIT)
        self._settle = self._client.register_script(_SETTLE)
        self._seed = self._client.register_script(_SEED)
        self._load_spent = load_spent
        self.replica_id = f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self._ttl_ms = int(reservation_ttl_s * 1000)
        self._heartbeat_s, self._reconcile_s = heartbeat_s, reconcile_s
        self.up = False
        self.replicas = 1  # the last live count seen; the divisor of every budget and limit during an outage
        self.down_since: float | None = None
        self.last_error: str | None = None
        self.outages = 0
        self._local: dict[str, _Local] = {}
        self._known_spent: dict[str, float] = {}  # per key, spent + reserved as the last script reply showed
        self._lookups: dict[str, asyncio.Future] = {}  # key id -> its one ledger lookup in flight
        self._seeding: dict[str, asyncio.Future] = {}  # key id -> its one seeding (lookup, then the write)
        self._local_limiter = RateLimiter(clock=time.time)
        self._pending_settles: list[tuple[str, str, float]] = []  # (key id, reservation id, USD) to replay
        self._pending_admits: list[tuple[str, float]] = []  # (key id, wall time) of requests admitted locally
        self._pending_tokens: list[tuple[str, float, int]] = []
        self._batch: tuple[list, list] = ([], [])  # settles and token counts for the next pipelined flush
        self._flushing: asyncio.Task | None = None
        self._flush_timer: asyncio.TimerHandle | None = None
        self._background: set[asyncio.Task] = set()
        self._loop_task: asyncio.Task | None = None
        self._closing = False
        # Key changes (revoke, update, rotate) announced by any replica: a client of its own, without the read
        # timeout (a subscription waits for messages), and the callbacks that drop the key from local caches.
        self._pubsub_client = aioredis.Redis.from_url(url, socket_connect_timeout=socket_timeout_s,
                                                      decode_responses=True)
        self._handlers: dict[str, list[Callable[[str], None]]] = {KEY_CHANNEL: [], POLICY_CHANNEL: []}
        self._listener: asyncio.Task | None = None
        self.policy = None  # gateway/shared_policy.py's SharedPolicy, which sets itself here (health, close)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        try:
            await self._heartbeat()
            self._mark_up()
        except Exception as exc:  # noqa: BLE001 - unreachable at start: serve, enforcing locally (a share of 1)
            self._mark_down(exc)
        self._loop_task = asyncio.create_task(self._loop(), name="shared-state")
        self._listener = asyncio.create_task(self._listen(), name="shared-state-keys")

    @property
    def client(self):
        """The Redis client (read timeouts bounded): for gateway/shared_policy.py."""
        return self._client

    async def aclose(self) -> None:
        self._closing = True
        if self.policy is not None:
            await self.policy.aclose()
        if self._loop_task is not None:
            # Bounded: a cancellation that lands inside redis-py's I/O can be swallowed there; the flag ends the loop
            self._loop_task.cancel()
            await asyncio.wait({self._loop_task}, timeout=2.0)
        if self._listener is not None:
            self._listener.cancel()
            await asyncio.wait({self._listener}, timeout=2.0)
        with contextlib.suppress(Exception):
            await self._pubsub_client.aclose()
        if self._flush_timer is not None:  # what is batched goes now
            self._flush_timer.cancel()
            self._start_flush()
        if self._background:
            await asyncio.wait(self._background, timeout=2.0)
        self._wire.close()
        with contextlib.suppress(Exception):
            await self._client.zrem(f"{PREFIX}:replicas", self.replica_id)
        with contextlib.suppress(Exception):
            await self._client.aclose()

    def health(self) -> dict:
        """`/health`'s `shared_state` block."""
        return {"backend": "redis", "status": "shared" if self.up else "local_fallback", "replica": self.replica_id,
                **({"policy": self.policy.health()} if self.policy is not None else {}),
                "replicas": self.replicas,
                "local_share": None if self.up else 1 / max(1, self.replicas),
                "down_for_s": None if self.down_since is None else round(time.monotonic() - self.down_since, 1),
                "last_error": self.last_error, "outages": self.outages,
                "pending_replay": len(self._pending_settles) + len(self._pending_admits) + len(self._pending_tokens)}

    async def _loop(self) -> None:
        next_reconcile = time.monotonic() + self._reconcile_s
        while not self._closing:
            await asyncio.sleep(self._heartbeat_s)
            try:
                await self._heartbeat()
                if not self.up:
                    # Connections from before the outage are dead (a restarted Redis closed them): new ones
                    await self._client.connection_pool.disconnect()
                    self._wire.close()
                    await self._heartbeat()
                    await self._replay()
                    await self._reconcile()
                    self._mark_up()
                    next_reconcile = time.monotonic() + self._reconcile_s
                elif time.monotonic() >= next_reconcile:
                    await self._reconcile()
                    next_reconcile = time.monotonic() + self._reconcile_s
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - Redis (or the ledger, reconciling) failed: try next beat
                if self._is_redis_error(exc):
                    self._mark_down(exc)
                else:
                    log.warning("reconciling spend with the ledger failed: %s", exc)

    async def _heartbeat(self) -> None:
        now_ms = time.time() * 1000
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.zadd(f"{PREFIX}:replicas", {self.replica_id: now_ms})
            pipe.zremrangebyscore(f"{PREFIX}:replicas", "-inf", now_ms - REPLICA_TTL_S * 1000)
            pipe.zcard(f"{PREFIX}:replicas")
            count = (await pipe.execute())[-1]
        self.replicas = max(1, int(count))
        SHARED_REPLICAS.set(self.replicas)

    def _mark_up(self) -> None:
        if not self.up and self.down_since is not None:
            log.warning("Redis answers again after %.1f s: budgets and rate limits are shared again (%d replicas); "
                        "what this replica did meanwhile was replayed", time.monotonic() - self.down_since,
                        self.replicas)
        self.up, self.down_since = True, None
        self._local.clear()
        self._local_limiter = RateLimiter(clock=time.time)
        SHARED_UP.set(1)

    def _mark_down(self, exc: BaseException) -> None:
        self.last_error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        if self.up or self.down_since is None:
            self.outages += 1
            self.down_since = time.monotonic()
            log.warning("Redis at %s unreachable (%s): enforcing locally with this replica's share (1/%d) of every "
                        "budget and limit until it answers", _redact(self.url), self.last_error, self.replicas)
        self.up = False
        SHARED_UP.set(0)

    @staticmethod
    def _is_redis_error(exc: BaseException) -> bool:
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import TimeoutError as RedisTimeoutError

        return isinstance(exc, (RedisConnectionError, RedisTimeoutError, OSError, TimeoutError))

    # ------------------------------------------------------------------ key changes, every replica at once

    def on_key_change(self, callback: Callable[[str], None]) -> None:
        self._handlers[KEY_CHANNEL].append(callback)

    def on_message(self, channel: str, callback: Callable[[str], None]) -> None:
        """Call `callback(data)` for each message on `channel` (KEY_CHANNEL or POLICY_CHANNEL: both subscribed)."""
        self._handlers[channel].append(callback)

    async def announce_key_change(self, key_id: str) -> None:
        """Tell every replica (this one too) that the key changed: they drop it from their caches now rather than
        within the cache's freshness (1 s). Best effort: with Redis away, the freshness still holds."""
        try:
            await self._client.publish(KEY_CHANNEL, key_id)
        except Exception as exc:  # noqa: BLE001 - the answer to the admin call stands
            log.warning("could not announce the change of key %s to the other replicas: %s", key_id, exc)
            for callback in self._handlers[KEY_CHANNEL]:
                callback(key_id)

    async def _listen(self) -> None:
        while not self._closing:
            pubsub = self._pubsub_client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(*self._handlers)
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        for callback in self._handlers.get(str(message["channel"]), ()):
                            callback(str(message["data"]))
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - Redis away: subscribe again after a beat (the heartbeat logs it)
                await asyncio.sleep(self._heartbeat_s)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    # ------------------------------------------------------------------ the hot path

    async def admit(self, key: KeyInfo, estimate_usd: float | None, prompt_tokens: int) -> Reservation | None:
        """Count the request in the key's RPM/TPM windows and reserve `estimate_usd` (None: no budget), atomically
        across replicas; raise the 429 (or the budget's 503) otherwise."""
        if not self.up:
            return await self._admit_locally(key, estimate_usd, prompt_tokens)
        rid = uuid.uuid4().hex
        args = ["" if key.budget_usd is None or estimate_usd is None else repr(float(key.budget_usd)),
                repr(float(estimate_usd or 0.0)), "" if key.rpm is None else str(key.rpm),
                "" if key.tpm is None else str(key.tpm), str(int(prompt_tokens)), rid, str(self._ttl_ms)]
        try:
            reply = await self._run_admit(key.id, args)
            if reply[0] == 0 and reply[1] == "seed":
                await self._seed_from_ledger(key.id)
                reply = await self._run_admit(key.id, args)
        except errors.APIError:
            raise
        except Exception as exc:  # Redis gone mid-request: this request and the next go local
            if not self._is_redis_error(exc):
                raise
            self._mark_down(exc)
            return await self._admit_locally(key, estimate_usd, prompt_tokens)
        if reply[0] == 1:
            if args[0]:
                self._known_spent[key.id] = float(reply[1]) + max(0.0, float(reply[2]))  # an outage's base
                return Reservation(key_id=key.id, amount_usd=float(estimate_usd), rid=rid)
            return None
        raise _refusal(key, reply, estimate_usd)

    async def _ledger_spent(self, key_id: str) -> float:
        """The key's spend in the ledger: one lookup per key at a time, shared by its concurrent requests (a burst of
        1,000 first requests on a key would otherwise make 1,000 queries, exhaust the database pool and get 503s)."""
        lookup = self._lookups.get(key_id)
        if lookup is None:
            lookup = self._lookups[key_id] = asyncio.ensure_future(asyncio.wait_for(self._load_spent(key_id), 5.0))
            lookup.add_done_callback(lambda _: self._lookups.pop(key_id, None))
        spent = float(await asyncio.shield(lookup) or 0.0)
        if not math.isfinite(spent):
            raise ValueError(f"the ledger's spend sum is {spent}")
        return spent

    async def _run_admit(self, key_id: str, args: list[str]) -> list:
        """The admission script: one EVALSHA, one round trip (loaded first when Redis lacks it: a restart)."""
        command = encode("EVALSHA", self._admit.sha, 5, *_keys(key_id), *args)
        try:
            return (await self._wire.execute_many([command]))[0]
        except NoScriptError:
            await self._wire.execute("SCRIPT", "LOAD", _ADMIT)
            return (await self._wire.execute_many([command]))[0]

    async def _seed_from_ledger(self, key_id: str) -> None:
        """Seed the key's account from the ledger: one seeding per key at a time, shared by its concurrent requests
        (a request whose "no account" reply came before the seed landed may start another: a few, not a burst)."""
        seeding = self._seeding.get(key_id)
        if seeding is None:
            seeding = self._seeding[key_id] = asyncio.ensure_future(self._seed_once(key_id))
            seeding.add_done_callback(lambda _: self._seeding.pop(key_id, None))
        await asyncio.shield(seeding)

    async def _seed_once(self, key_id: str) -> None:
        from gateway.budgets import spend_unavailable

        try:
            spent = await self._ledger_spent(key_id)
        except Exception as exc:  # noqa: BLE001 - the database failed: a 503 as BudgetBook answers
            log.warning("spend lookup for key %s failed (%s: %s); answering 503", key_id, type(exc).__name__, exc)
            raise spend_unavailable() from None
        await self._seed(keys=_keys(key_id)[:1], args=[repr(spent)])

    async def _admit_locally(self, key: KeyInfo, estimate_usd: float | None, prompt_tokens: int
                             ) -> Reservation | None:
        share = max(1, self.replicas)
        if key.rpm is not None or key.tpm is not None:
            scaled = replace(key, rpm=None if key.rpm is None else max(1, key.rpm // share),
                             tpm=None if key.tpm is None else max(1, key.tpm // share))
            self._local_limiter.admit(scaled, prompt_tokens)
        reservation = None
        if key.budget_usd is not None and estimate_usd is not None:
            account = self._local.get(key.id)
            if account is None:
                # The larger of this replica's last view (spent + reserved by every replica, at its last reply)
                # and the ledger's sum (every replica's rows written since): other replicas' spend since the last
                # reply would otherwise be counted in no share.
                base = self._known_spent.get(key.id)
                try:
                    ledger = await self._ledger_spent(key.id)
                    base = ledger if base is None or not ledger <= base else base
                except Exception:  # noqa: BLE001 - the ledger too: the last view, if any
                    if base is None:
                        from gateway.budgets import spend_unavailable
                        raise spend_unavailable() from None
                account = self._local.setdefault(key.id, _Local(base_spent=base))
            allowance = max(0.0, key.budget_usd - account.base_spent) / share
            committed = account.spent + account.reserved
            if not committed + estimate_usd <= allowance + 1e-12:
                raise errors.quota_exceeded(
                    f"Budget exceeded for key {key.id}: this replica's share while the shared state is unreachable "
                    f"(1/{share} of the ${key.budget_usd - account.base_spent:.6f} left) is "
                    f"${allowance:.6f}, ${committed:.6f} of it spent or reserved; this request may cost up to "
                    f"${estimate_usd:.6f}.")
            account.reserved += estimate_usd
            reservation = Reservation(key_id=key.id, amount_usd=estimate_usd, rid="", local=True)
        if key.rpm is not None:
            self._remember(self._pending_admits, (key.id, time.time()))
        return reservation

    def settle(self, reservation: Reservation, actual_usd: float) -> None:
        """Book it locally (an outage reservation) and in Redis (now, or replayed once Redis answers)."""
        actual = actual_usd if math.isfinite(actual_usd) else 0.0
        if reservation.local:
            account = self._local.get(reservation.key_id)
            if account is not None:
                account.reserved = max(0.0, account.reserved - reservation.amount_usd)
                account.spent += actual
        if not self.up:
            self._remember(self._pending_settles, (reservation.key_id, reservation.rid, actual))
            return
        self._batch[0].append((reservation.key_id, reservation.rid, actual))
        self._schedule_flush()

    def record_tokens(self, key: KeyInfo, tokens: int) -> None:
        if not self.up:
            scaled = replace(key, tpm=max(1, key.tpm // max(1, self.replicas)))
            self._local_limiter.record_tokens(scaled, tokens)
            self._remember(self._pending_tokens, (key.id, time.time(), tokens))
            return
        self._batch[1].append((key.id, time.time(), tokens))
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if self._flush_timer is None and self._flushing is None:
            self._flush_timer = asyncio.get_running_loop().call_later(FLUSH_DELAY_S, self._start_flush)

    def _start_flush(self) -> None:
        self._flush_timer = None
        self._flushing = asyncio.ensure_future(self._flush())
        self._background.add(self._flushing)
        self._flushing.add_done_callback(self._background.discard)

    async def _flush(self) -> None:
        """Settles and token counts of the last FLUSH_DELAY_S in one write, after the answers: a request's token
        count and its settle, and those of the requests around it, share one round trip off their latency."""
        (settles, tokens), self._batch = self._batch, ([], [])
        try:
            await self._send(settles, tokens)
        except Exception as exc:  # noqa: BLE001 - kept for the replay
            for item in settles:
                self._remember(self._pending_settles, item)
            for item in tokens:
                self._remember(self._pending_tokens, item)
            if self._is_redis_error(exc):
                self._mark_down(exc)
            else:
                log.error("settling in Redis failed: %s", exc)
        finally:
            self._flushing = None
            if self._batch[0] or self._batch[1]:  # came while this one was on the wire
                self._schedule_flush()

    async def _send(self, settles: list, tokens: list) -> None:
        commands = [encode("EVALSHA", self._settle.sha, 3, *_keys(key_id)[:3], rid, repr(actual))
                    for key_id, rid, actual in settles]
        for key_id, at, count in tokens:
            commands.append(encode("HINCRBY", _keys(key_id)[4], int(at), count))
            commands.append(encode("EXPIRE", _keys(key_id)[4], int(WINDOW_S) + 2))
        replies = await self._wire.execute_many(commands, raise_on_error=False)
        for reply in replies:
            if isinstance(reply, Exception) and not isinstance(reply, NoScriptError):
                raise reply
        if any(isinstance(reply, NoScriptError) for reply in replies[:len(settles)]):
            # A restarted Redis has no scripts: load it and send the settles again (none ran; the token counts
            # did, so they are not sent twice).
            await self._wire.execute("SCRIPT", "LOAD", _SETTLE)
            await self._wire.execute_many(commands[:len(settles)])

    @staticmethod
    def _remember(queue: list, item: tuple) -> None:
        queue.append(item)
        if len(queue) > MAX_PENDING:
            del queue[: len(queue) - MAX_PENDING]

    # ------------------------------------------------------------------ after an outage

    async def _replay(self) -> None:
        """Push what this replica settled, admitted and counted while Redis was away (then forget it)."""
        settles, admits, tokens = self._pending_settles, self._pending_admits, self._pending_tokens
        for key_id, rid, actual in settles:
            await self._settle(keys=_keys(key_id)[:3], args=[rid, repr(actual)])
        horizon = time.time() - WINDOW_S
        async with self._client.pipeline(transaction=False) as pipe:
            for key_id, at in admits:
                if at > horizon:  # requests still inside the window count against the shared RPM
                    pipe.zadd(_keys(key_id)[3], {f"replay:{uuid.uuid4().hex}": int(at * 1000)})
                    pipe.pexpire(_keys(key_id)[3], 61000)
            for key_id, at, count in tokens:
                if at > horizon:
                    pipe.hincrby(_keys(key_id)[4], str(int(at)), count)
                    pipe.expire(_keys(key_id)[4], int(WINDOW_S) + 2)
            await pipe.execute()
        self._pending_settles, self._pending_admits, self._pending_tokens = [], [], []

    async def _reconcile(self) -> None:
        """Raise each known key's Redis spend to the ledger's when the ledger holds more (rows Redis lost)."""
        for key_id in list(self._known_spent) + [k for k in self._local if k not in self._known_spent]:
            spent = float(await self._load_spent(key_id) or 0.0)
            if math.isfinite(spent):
                self._known_spent[key_id] = float(await self._seed(keys=_keys(key_id)[:1], args=[repr(spent)]))


def _refusal(key: KeyInfo, reply: list, estimate_usd: float | None) -> errors.APIError:
    kind = reply[1]
    if kind == "rpm":
        return errors.rate_limited(f"Rate limit reached for key {key.id}: {key.rpm} requests per minute.",
                                   float(reply[2]))
    if kind == "tpm":
        return errors.rate_limited(f"Rate limit reached for key {key.id}: {key.tpm} tokens per minute "
                                   f"({int(float(reply[3]))} used in the last minute).", float(reply[2]))
    committed = float(reply[2])
    left = max(0.0, (key.budget_usd or 0.0) - committed)
    return errors.quota_exceeded(
        f"Budget exceeded for key {key.id}: ${committed:.6f} of ${key.budget_usd:.6f} spent or reserved; "
        f"this request may cost up to ${estimate_usd:.6f} and ${left:.6f} is left.")


def publish_key_change(url: str, key_id: str, timeout_s: float = 2.0) -> int:
    """From a process with no gateway in it (`switchyard keys revoke|update|rotate --redis-url`): announce the key's
    change on KEY_CHANNEL, as a replica's admin API does. Returns how many replicas heard it; raises on a Redis
    error (the caller says the change still holds: every replica rereads a key at least once a second)."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        return int(client.publish(KEY_CHANNEL, key_id))
    finally:
        client.close()


def _redact(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}***@{rest.split('@', 1)[1]}" if "@" in rest else url


class SharedBudgetBook(BudgetBook):
    """BudgetBook's interface (reserve / settle), the book kept in Redis; the same script counts the RPM/TPM."""

    def __init__(self, state: SharedState) -> None:
        super().__init__(state._load_spent)
        self.state = state

    async def reserve(self, key: KeyInfo, estimate_usd: float, prompt_tokens: int = 0) -> Reservation | None:
        if key.budget_usd is None:
            return None
        reservation = await self.state.admit(key, estimate_usd, prompt_tokens)
        _ADMITTED.set(key.id)  # its RPM/TPM are counted: the limiter's admit() that follows has nothing to do
        return reservation

    def settle(self, reservation: Reservation | None, actual_usd: float) -> None:
        if reservation is None or reservation.settled:
            return
        reservation.settled = True
        self.state.settle(reservation, actual_usd)


class SharedRateLimiter(RateLimiter):
    """RateLimiter's interface over Redis windows. admit() returns an awaitable when the request's budget script
    did not already count it (a key without a budget), None when there is nothing left to do."""

    def __init__(self, state: SharedState) -> None:
        super().__init__()
        self.state = state

    def admit(self, key: KeyInfo, estimated_prompt_tokens: int):  # type: ignore[override]
        if _ADMITTED.get() == key.id:
            _ADMITTED.set(None)
            return None
        if key.rpm is None and key.tpm is None:
            return None
        return self.state.admit(key, None, estimated_prompt_tokens)

    def record_tokens(self, key: KeyInfo, tokens: int) -> None:
        if key.tpm is None or tokens <= 0:
            return
        self.state.record_tokens(key, tokens)
