"""Budget reservations: reserve the worst-case cost at admission, settle the real cost after.

Check-and-reserve runs without an await in between, so on one event loop concurrent requests
cannot overspend (the race LiteLLM users report with check-then-increment). Spend already in
the ledger is loaded once per key; after that the book is the in-process source of truth.
A failed or slow load is never cached: the request gets a 503 with Retry-After and the key's
next request loads again. One book per gateway process: replicas share one book through Redis
(`serve --redis-url`: gateway/shared_state.py, the same interface).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway import errors
from gateway.keys import KeyInfo
from openai_wire import APIError

if TYPE_CHECKING:
    from gateway.policy import BudgetSpec
    from gateway.pricing import WorstCase

log = logging.getLogger("switchyard.budgets")

SPEND_LOAD_TIMEOUT_S = 5.0  # a database that hangs (blocked, not refused) must not hold requests longer
SPEND_RETRY_AFTER_S = 2  # what the 503 of a failed spend lookup tells the client to wait


@dataclass(slots=True)
class Reservation:
    key_id: str
    amount_usd: float
    settled: bool = False
    rid: str = ""  # its id in the shared book (gateway/shared_state.py); "" in a process-local book
    local: bool = False  # shared book: made while Redis was unreachable, against this replica's share


@dataclass(slots=True)
class _Account:
    spent_usd: float
    reserved_usd: float = 0.0


class BudgetBook:
    def __init__(self, load_spent: Callable[[str], Awaitable[float]],
                 load_timeout_s: float = SPEND_LOAD_TIMEOUT_S) -> None:
        self._load_spent = load_spent
        self._load_timeout_s = load_timeout_s
        self._accounts: dict[str, _Account] = {}
        self._loading: dict[str, asyncio.Future] = {}  # one lookup in flight per key, shared by its requests

    async def _account(self, key_id: str) -> _Account:
        account = self._accounts.get(key_id)
        if account is not None:
            return account
        pending = self._loading.get(key_id)
        if pending is None:
            pending = asyncio.ensure_future(self._load_spent(key_id))
            self._loading[key_id] = pending
            pending.add_done_callback(functools.partial(self._loaded, key_id))
        try:
            # shield: one waiter's cancellation (its client left) must not cancel the lookup for the others.
            spent = await asyncio.wait_for(asyncio.shield(pending), self._load_timeout_s)
            spent = float(spent or 0.0)
            if not math.isfinite(spent):
                raise ValueError(f"the ledger's spend sum is {spent}")
        except Exception as exc:  # noqa: BLE001 - whatever the database raised, or the timeout: a 503, retried
            log.warning("spend lookup for key %s failed (%s: %s); answering 503, the next request retries",
                        key_id, type(exc).__name__, exc)
            raise spend_unavailable() from None
        return self._accounts.setdefault(key_id, _Account(spent_usd=spent))

    def _loaded(self, key_id: str, future: asyncio.Future) -> None:
        """A lookup ended: forget it whatever its outcome, so a failure is retried by the next request; keep its
        answer even when every waiter gave up (timed out or left)."""
        if self._loading.get(key_id) is future:
            del self._loading[key_id]
        if future.cancelled() or future.exception() is not None:  # retrieved: asyncio logs it no more
            return
        try:
            spent = float(future.result() or 0.0)
        except (TypeError, ValueError):
            return
        if math.isfinite(spent):
            self._accounts.setdefault(key_id, _Account(spent_usd=spent))

    async def reserve(self, key: KeyInfo, estimate_usd: float, prompt_tokens: int = 0) -> Reservation | None:
        """Reserve estimate_usd against the key's budget or raise a 429 (503 while its spend cannot be read).
        None when the key has no budget. `prompt_tokens`: the request's estimate, for the shared book (its one
        script also counts the key's RPM/TPM); unused here."""
        if key.budget_usd is None:
            return None
        account = await self._account(key.id)
        # From here to the return there is no await: check and reserve are one atomic step.
        committed = account.spent_usd + account.reserved_usd
        if not committed + estimate_usd <= key.budget_usd + 1e-12:  # written so that a nan anywhere refuses
            left = max(0.0, key.budget_usd - committed)
            raise errors.quota_exceeded(
                f"Budget exceeded for key {key.id}: ${committed:.6f} of ${key.budget_usd:.6f} spent or reserved; "
                f"this request may cost up to ${estimate_usd:.6f} and ${left:.6f} is left.")
        account.reserved_usd += estimate_usd
        return Reservation(key_id=key.id, amount_usd=estimate_usd)

    def settle(self, reservation: Reservation | None, actual_usd: float) -> None:
        """Release the reservation and book the real cost, once: later calls for the same reservation do nothing."""
        if reservation is None or reservation.settled:
            return
        reservation.settled = True
        account = self._accounts[reservation.key_id]
        account.reserved_usd = max(0.0, account.reserved_usd - reservation.amount_usd)
        if account.reserved_usd < 1e-12:
            account.reserved_usd = 0.0  # float residue of many adds and subtracts
        account.spent_usd += actual_usd if math.isfinite(actual_usd) else 0.0

    def spent(self, key_id: str) -> float | None:
        account = self._accounts.get(key_id)
        return None if account is None else account.spent_usd

    def reserved(self, key_id: str) -> float | None:
        """USD reserved by the key's requests in flight (None: its spend is not loaded)."""
        account = self._accounts.get(key_id)
        return None if account is None else account.reserved_usd


def spend_unavailable() -> APIError:
    """The key's spend could not be read (its database is unreachable or slow): retryable, so a 503 with
    Retry-After; nothing was reserved."""
    return APIError(503, "This key's spend cannot be read right now (the gateway's database is unreachable), so "
                         "its budget cannot be checked; retry shortly.", type="api_error",
                    code="budget_unavailable", headers={"Retry-After": str(SPEND_RETRY_AFTER_S)})


def reservation_usd(worst: WorstCase, rules: BudgetSpec, cap_param: str) -> float:
    """What a budgeted key reserves for a request with this worst case, under the policy's `budgets:` rules:
    the priced worst case; when it cannot be priced, refused (refuse_unpriced), or at least the policy's
    ceiling (unpriced_reservation_usd), or else the guess as if it were priced (the behaviour before the
    ceiling existed). `cap_param`: the request's max-tokens field, named when setting it would help."""
    if worst.priceable:
        return worst.priced_usd
    if rules.refuse_unpriced:
        raise _unpriced_refusal(worst, cap_param)
    if rules.unpriced_reservation_usd is None:
        return worst.estimate_usd
    return max(worst.priced_usd, rules.unpriced_reservation_usd)


def _unpriced_refusal(worst: WorstCase, cap_param: str) -> APIError:
    reasons = "; ".join(worst.unpriced + worst.unbounded)
    if worst.unpriced:  # the operator's to fix: no request can make such a backend priced
        return APIError(403, f"This key has a budget and the gateway's policy refuses requests whose cost cannot "
                             f"be priced: {reasons}.", type="permission_error", code="unpriced_backend",
                        headers={"x-should-retry": "false"})
    return errors.invalid_request(f"This key has a budget and the gateway's policy refuses requests whose cost "
                                  f"cannot be priced: {reasons}; set '{cap_param}'.", param=cap_param,
                                  code="max_tokens_required")
