"""LedgerRecord: one request's ledger row, filled in by the gateway as the request progresses."""
from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import UTC, datetime
from typing import Any


@dataclass(slots=True)
class LedgerRecord:
    """Mirrors RequestRow (all columns but the autoincrement id). Naive datetimes are taken as UTC.

    `status` defaults to "ok": the gateway overwrites it with error / client_closed / rejected
    whenever a request does not end in a normal response.
    """

    request_id: str
    created_at: datetime
    api_key_id: str | None = None
    team: str | None = None
    endpoint: str = "chat.completions"
    requested_model: str = ""
    route: str | None = None
    backend: str | None = None
    served_model: str | None = None
    stream: bool = False
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    input_cost_usd: float = 0.0
    output_cost_usd: float = 0.0
    cost_usd: float = 0.0
    cost_basis: str | None = None  # api_price | gpu_amortized
    gpu_seconds: float | None = None
    counterfactual_cost_usd: float | None = None
    ttft_ms: float | None = None
    latency_ms: float | None = None
    status: str = "ok"  # ok | error | client_closed | rejected
    error_type: str | None = None
    http_status: int | None = None
    attempts: int = 1
    policy_version: str | None = None
    price_table_version: str | None = None
    difficulty: float | None = None
    threshold: float | None = None
    route_reason: str | None = None
    prompt_text: str | None = None
    completion_text: str | None = None

    def to_row(self) -> dict[str, Any]:
        """Column name -> value for an INSERT into `requests`; created_at as an aware UTC datetime."""
        row = {name: getattr(self, name) for name in _FIELD_ORDER}  # not asdict(): it deep-copies (slow)
        row["created_at"] = _utc(self.created_at)
        return row

    def to_json(self) -> dict[str, Any]:
        """JSON-safe form for the spool file (created_at as ISO-8601 with offset)."""
        row = {name: getattr(self, name) for name in _FIELD_ORDER}
        row["created_at"] = _utc(self.created_at).isoformat()
        return row

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LedgerRecord:
        """Inverse of to_json. Unknown keys (from a newer writer) are ignored, missing ones default."""
        known = {k: v for k, v in data.items() if k in FIELD_NAMES}
        known["created_at"] = datetime.fromisoformat(known["created_at"])
        return cls(**known)


_FIELD_ORDER: tuple[str, ...] = tuple(f.name for f in fields(LedgerRecord))
FIELD_NAMES: frozenset[str] = frozenset(_FIELD_ORDER)


def _utc(value: datetime) -> datetime:
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value.astimezone(UTC)
