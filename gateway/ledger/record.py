"""The rows the ledger writer takes: LedgerRecord (one request, filled in as it progresses) and ShadowRecord
(one shadow evaluation), with their spool-file conversions."""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from typing import Any

# The ledger's `endpoint` column for each endpoint the gateway serves.
ENDPOINT_NAMES = {"chat": "chat.completions", "completions": "completions", "embeddings": "embeddings",
                  "responses": "responses"}


class SpoolRecord:
    """Row conversions shared by the rows the ledger writer handles (LedgerRecord, ShadowRecord): a
    slots dataclass whose fields are its table's columns, with a `created_at` datetime (naive = UTC)."""

    __slots__ = ()

    def to_row(self) -> dict[str, Any]:
        """Column name -> value for an INSERT; created_at as an aware UTC datetime."""
        row = {name: getattr(self, name) for name in _field_names(type(self))}  # not asdict(): it deep-copies
        row["created_at"] = _utc(row["created_at"])
        return row

    def to_json(self) -> dict[str, Any]:
        """JSON-safe form for the spool file (created_at as ISO-8601 with offset)."""
        row = self.to_row()
        row["created_at"] = row["created_at"].isoformat()
        return row

    @classmethod
    def from_json(cls, data: dict[str, Any]):
        """Inverse of to_json. Unknown keys (from a newer writer) are ignored, missing ones default."""
        names = _field_set(cls)
        known = {k: v for k, v in data.items() if k in names}
        known["created_at"] = datetime.fromisoformat(known["created_at"])
        return cls(**known)


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


@functools.cache
def _field_set(cls: type) -> frozenset[str]:
    return frozenset(_field_names(cls))


@dataclass(slots=True)
class LedgerRecord(SpoolRecord):
    """Mirrors RequestRow (all columns but the autoincrement id). Naive datetimes are taken as UTC.

    `status` defaults to "ok": the gateway overwrites it with error / client_error / client_closed / rejected
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
    status: str = "ok"  # ok | error | client_error | client_closed | rejected (docs/sql-cookbook.md)
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
    # Buy-versus-host attribution (migration 0003)
    device_hour_usd: float | None = None  # engine rows: the engine's hourly price, all devices
    device_kind: str | None = None  # engine rows: gpu | cpu
    utilisation: float | None = None  # engine rows: the busy fraction the cost was amortised at
    cost_note: str | None = None  # why the cost is $0 or estimated (gateway/pricing.py NOTE_*)
    cache_savings_usd: float | None = None  # API rows: cached prompt tokens × (input − cached price)
    # Stable chargeback (migration 0005)
    busy_cost_usd: float | None = None  # engine rows: device seconds at the list rate (no idle share)
    # Engine fleets (migration 0006): which replica served (its position in the backend's api_bases)
    replica: str | None = None
    # KV tiering (migration 0007): engine rows, prompt tokens restored from host memory / disk (part of cached)
    kv_restored_host_tokens: int | None = None
    kv_restored_disk_tokens: int | None = None


@dataclass(slots=True)
class UptimeRecord(SpoolRecord):
    """Mirrors EngineUptimeRow: one engine's measured up and busy time over one interval (a minute)."""

    interval_id: str
    created_at: datetime  # the interval's start (UTC)
    backend: str
    seconds: float  # wall seconds the engine answered its metrics within the interval
    busy_seconds: float  # of those, seconds it spent in forward passes (its own counter)
    device_hour_usd: float  # the engine's hourly price, all devices
    devices: int = 1
    device_kind: str = "gpu"


@dataclass(slots=True)
class ShadowRecord(SpoolRecord):
    """Mirrors ShadowEvalRow (all columns but the autoincrement id). The router's column names: weak_* is the
    route's easy backend, strong_* its hard one (gateway/shadow/runner.py maps them, in one place)."""

    request_id: str
    created_at: datetime
    route: str
    endpoint: str
    prompt_text: str
    messages_json: str | None
    easy_backend: str
    hard_backend: str
    served_backend: str
    weak_answer: str | None
    strong_answer: str | None
    weak_correct: bool
    strong_correct: bool
    judge: str
    difficulty: float | None = None
    threshold: float | None = None
    model_version: str | None = None
    policy_version: str | None = None


@dataclass(slots=True)
class PolicyVersionRecord(SpoolRecord):
    """Mirrors PolicyVersionRow. `created_at` is the table's `loaded_at` (the spool keeps the writer's name)."""

    version: str
    created_at: datetime
    text: str
    source: str | None = None

    def to_row(self) -> dict[str, Any]:
        return {"version": self.version, "loaded_at": _utc(self.created_at), "source": self.source,
                "text": self.text}

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "created_at": _utc(self.created_at).isoformat(), "source": self.source,
                "text": self.text}


def _utc(value: datetime) -> datetime:
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value.astimezone(UTC)
