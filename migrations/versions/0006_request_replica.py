"""Engine fleets: the replica that served each request.

Revision ID: 0006_request_replica
Revises: 0005_policy_versions_chargeback
Create Date: 2026-12-03

- `requests.replica` (nullable): for an engine backend with `api_bases:` (a fleet), the replica that served the
  request, as its position in the list ("0", "1", …); NULL for every other row. The `cost_ledger` view appends
  it (its contract: names only ever appended).

Plain ADD COLUMN: the same on SQLite and PostgreSQL, no table rebuild.
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006_request_replica"
down_revision: str | None = "0005_policy_versions_chargeback"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COST_LEDGER_COLUMNS = """
    request_id, created_at, api_key_id, team, requested_model, route, backend, served_model,
    prompt_tokens, cached_prompt_tokens, completion_tokens, cost_usd, cost_basis, gpu_seconds,
    counterfactual_cost_usd, ttft_ms, latency_ms, status, policy_version, difficulty, threshold,
    input_cost_usd, output_cost_usd, error_type, price_table_version, route_reason, endpoint, stream,
    http_status, attempts,
    device_hour_usd, device_kind, utilisation, cost_note, cache_savings_usd,
    busy_cost_usd"""


def upgrade() -> None:
    op.execute("DROP VIEW IF EXISTS cost_ledger")
    op.add_column("requests", sa.Column("replica", sa.String(128), nullable=True))
    op.execute(f"CREATE VIEW cost_ledger AS SELECT {_COST_LEDGER_COLUMNS},\n    replica\nFROM requests")


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS cost_ledger")
    with op.batch_alter_table("requests") as batch:  # SQLite drops columns by rebuilding the table
        batch.drop_column("replica")
    op.execute(f"CREATE VIEW cost_ledger AS SELECT {_COST_LEDGER_COLUMNS}\nFROM requests")
