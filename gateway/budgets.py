"""Budget reservations: reserve the worst-case cost at admission, settle the real cost after.

Check-and-reserve runs without an await in between, so on one event loop concurrent requests
cannot overspend (the race LiteLLM users report with check-then-increment). Spend already in
the ledger is loaded once per key; after that the book is the in-process source of truth.
One book per gateway process: with several replicas, give each key one replica's budget or
route budgeted keys to one replica (noted as a known limit).
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gateway import errors
from gateway.keys import KeyInfo


@dataclass(slots=True)
class Reservation:
    key_id: str
    amount_usd: float
    settled: bool = False


@dataclass(slots=True)
class _Account:
    spent_usd: float
    reserved_usd: float = 0.0


class BudgetBook:
    def __init__(self, load_spent: Callable[[str], Awaitable[float]]) -> None:
        self._load_spent = load_spent
        self._accounts: dict[str, _Account] = {}
        self._loading: dict[str, asyncio.Future] = {}

    async def _account(self, key_id: str) -> _Account:
        account = self._accounts.get(key_id)
        if account is not None:
            return account
        pending = self._loading.get(key_id)
        if pending is None:
            pending = asyncio.ensure_future(self._load_spent(key_id))
            self._loading[key_id] = pending
        spent = await pending
        self._loading.pop(key_id, None)
        return self._accounts.setdefault(key_id, _Account(spent_usd=float(spent or 0.0)))

    async def reserve(self, key: KeyInfo, estimate_usd: float) -> Reservation | None:
        """Reserve estimate_usd against the key's budget or raise a 429. None when the key has no budget."""
        if key.budget_usd is None:
            return None
        account = await self._account(key.id)
        # From here to the return there is no await: check and reserve are one atomic step.
        committed = account.spent_usd + account.reserved_usd
        if committed + estimate_usd > key.budget_usd + 1e-12:
            left = max(0.0, key.budget_usd - committed)
            raise errors.quota_exceeded(
                f"Budget exceeded for key {key.id}: ${committed:.6f} of ${key.budget_usd:.6f} spent or reserved; "
                f"this request may cost up to ${estimate_usd:.6f} and ${left:.6f} is left.")
        account.reserved_usd += estimate_usd
        return Reservation(key_id=key.id, amount_usd=estimate_usd)

    def settle(self, reservation: Reservation | None, actual_usd: float) -> None:
        """Release the reservation and book the real cost (idempotent)."""
        if reservation is None or reservation.settled:
            return
        reservation.settled = True
        account = self._accounts[reservation.key_id]
        account.reserved_usd = max(0.0, account.reserved_usd - reservation.amount_usd)
        account.spent_usd += actual_usd

    def spent(self, key_id: str) -> float | None:
        account = self._accounts.get(key_id)
        return None if account is None else account.spent_usd
