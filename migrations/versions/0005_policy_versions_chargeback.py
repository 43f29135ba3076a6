"""Reports priced by the policy that served, and stable chargeback.

Revision ID: 0005_policy_versions_chargeback
Revises: 0004_key_lifecycle
Create Date: 2026-12-03

- `policy_versions`: the text of every policy version the gateway loaded (version = the 16-hex-digit
  sha256 every ledger row records in `policy_version`), so a report prices each row by its own policy.
- `requests.busy_cost_usd`: an engine row's device-seconds at the list rate (gpu_seconds × device_hour_usd /
  3600), beside the utilisation-amortised `cost_usd`: the same request always costs the same. The
  `cost_ledger` view appends it (its contract: names only ever appended).

Plain ADD COLUMN / CREATE TABLE: the same on SQLite and PostgreSQL, no table rebuild.
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_policy_versions_chargeback"
down_revision: str | None = "0004_key_lifecycle"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COST_LEDGER_COLUMNS = """
    request_id, created_at, api_key_id, team, requested_model, route, backend, served_model,
    prompt_tokens, cached_prompt_tokens, completion_tokens, cost_usd, cost_basis, gpu_seconds,
    counterfactual_cost_usd, ttft_ms, latency_ms, status, policy_version, difficulty, threshold,
    input_cost_usd, output_cost_usd, error_type, price_table_version, route_reason, endpoint, stream,
    http_status, attempts,
    device_hour_usd, device_kind, utilisation, cost_note, cache_savings_usd"""


def upgrade() -> None:
    op.create_table(
        "policy_versions",
        sa.Column("version", sa.String(64), primary_key=True),
        sa.Column("loaded_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("source", sa.String(1024)),
        sa.Column("text", sa.Text(), nullable=False),
    )
    op.execute("DROP VIEW IF EXISTS cost_ledger")
    op.add_column("requests", sa.Column("busy_cost_usd", sa.Float(), nullable=True))
    op.execute(f"CREATE VIEW cost_ledger AS SELECT {_COST_LEDGER_COLUMNS},\n    busy_cost_usd\nFROM requests")


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS cost_ledger")
    with op.batch_alter_table("requests") as batch:  # SQLite drops columns by rebuilding the table
        batch.drop_column("busy_cost_usd")
    op.execute(f"CREATE VIEW cost_ledger AS SELECT {_COST_LEDGER_COLUMNS}\nFROM requests")
    op.drop_table("policy_versions")
