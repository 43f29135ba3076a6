"""KV tiering (issue 34): the prompt tokens an engine restored from its lower KV tiers instead of recomputing.

Revision ID: 0007_kv_restored_tokens
Revises: 0006_request_replica
Create Date: 2026-12-03

- `requests.kv_restored_host_tokens`, `requests.kv_restored_disk_tokens` (nullable): for an engine row, the prompt
  tokens whose KV came back from the engine's host-memory / disk tier (usage.switchyard_prompt_tokens). They are
  part of `cached_prompt_tokens` too (priced as cached); NULL when the backend does not report the split. The
  `cost_ledger` view appends both (its contract: names only ever appended).

Plain ADD COLUMN: the same on SQLite and PostgreSQL, no table rebuild.
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007_kv_restored_tokens"
down_revision: str | None = "0006_request_replica"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COST_LEDGER_COLUMNS = """
    request_id, created_at, api_key_id, team, requested_model, route, backend, served_model,
    prompt_tokens, cached_prompt_tokens, completion_tokens, cost_usd, cost_basis, gpu_seconds,
    counterfactual_cost_usd, ttft_ms, latency_ms, status, policy_version, difficulty, threshold,
    input_cost_usd, output_cost_usd, error_type, price_table_version, route_reason, endpoint, stream,
    http_status, attempts,
    device_hour_usd, device_kind, utilisation, cost_note, cache_savings_usd,
    busy_cost_usd,
    replica"""


def upgrade() -> None:
    op.execute("DROP VIEW IF EXISTS cost_ledger")
    op.add_column("requests", sa.Column("kv_restored_host_tokens", sa.Integer(), nullable=True))
    op.add_column("requests", sa.Column("kv_restored_disk_tokens", sa.Integer(), nullable=True))
    op.execute(f"CREATE VIEW cost_ledger AS SELECT {_COST_LEDGER_COLUMNS},\n"
               "    kv_restored_host_tokens, kv_restored_disk_tokens\nFROM requests")


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS cost_ledger")
    # Plain DROP COLUMN (SQLite >= 3.35): a batch rebuild of `requests` would fail on the other views over it.
    op.drop_column("requests", "kv_restored_disk_tokens")
    op.drop_column("requests", "kv_restored_host_tokens")
    op.execute(f"CREATE VIEW cost_ledger AS SELECT {_COST_LEDGER_COLUMNS}\nFROM requests")
