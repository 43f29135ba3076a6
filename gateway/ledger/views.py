"""Column names of the analyst-facing `cost_ledger` view (created by migrations/).

STABLE_COLUMNS is a public contract: queries, reports and dashboards may rely on these names and
their order. Later migrations may only append columns after them.
"""
from __future__ import annotations

VIEW_NAME = "cost_ledger"

STABLE_COLUMNS: tuple[str, ...] = (
    "request_id", "created_at", "api_key_id", "team", "requested_model", "route", "backend",
    "served_model", "prompt_tokens", "cached_prompt_tokens", "completion_tokens", "cost_usd",
    "cost_basis", "gpu_seconds", "counterfactual_cost_usd", "ttft_ms", "latency_ms", "status",
    "policy_version", "difficulty", "threshold",
)

EXTRA_COLUMNS: tuple[str, ...] = (
    "input_cost_usd", "output_cost_usd", "error_type", "price_table_version", "route_reason",
    "endpoint", "stream", "http_status", "attempts",
    # migration 0003
    "device_hour_usd", "device_kind", "utilisation", "cost_note", "cache_savings_usd",
    # migration 0005
    "busy_cost_usd",
    # migration 0006
    "replica",
    # migration 0007
    "kv_restored_host_tokens", "kv_restored_disk_tokens",
)

ALL_COLUMNS: tuple[str, ...] = STABLE_COLUMNS + EXTRA_COLUMNS
