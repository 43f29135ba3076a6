"""Ledger schema: requests, api_keys and the cost_ledger view.

Revision ID: 0001_ledger_schema
Revises:
Create Date: 2025-01-01

Written out by hand (not create_all) so the history stays frozen when models.py grows;
tests/gateway/test_db_schema.py checks that models.py and the migrated database agree.
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001_ledger_schema"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The analyst-facing contract: these names are stable; new columns are only ever appended.
# Plain SELECT with no functions, so the same SQL works on SQLite and PostgreSQL.
COST_LEDGER_VIEW = """
CREATE VIEW cost_ledger AS
SELECT
    request_id, created_at, api_key_id, team, requested_model, route, backend, served_model,
    prompt_tokens, cached_prompt_tokens, completion_tokens, cost_usd, cost_basis, gpu_seconds,
    counterfactual_cost_usd, ttft_ms, latency_ms, status, policy_version, difficulty, threshold,
    input_cost_usd, output_cost_usd, error_type, price_table_version, route_reason, endpoint, stream,
    http_status, attempts
FROM requests
"""


def upgrade() -> None:
    big_id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
    op.create_table(
        "requests",
        sa.Column("id", big_id, primary_key=True, autoincrement=True),
        sa.Column("request_id", sa.String(64), nullable=False, unique=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("api_key_id", sa.String(64)),
        sa.Column("team", sa.String(128)),
        sa.Column("endpoint", sa.String(32), nullable=False),
        sa.Column("requested_model", sa.String(256), nullable=False),
        sa.Column("route", sa.String(256)),
        sa.Column("backend", sa.String(128)),
        sa.Column("served_model", sa.String(256)),
        sa.Column("stream", sa.Boolean(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("input_cost_usd", sa.Float(), nullable=False),
        sa.Column("output_cost_usd", sa.Float(), nullable=False),
        sa.Column("cost_usd", sa.Float(), nullable=False),
        sa.Column("cost_basis", sa.String(32)),
        sa.Column("gpu_seconds", sa.Float()),
        sa.Column("counterfactual_cost_usd", sa.Float()),
        sa.Column("ttft_ms", sa.Float()),
        sa.Column("latency_ms", sa.Float()),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("error_type", sa.String(64)),
        sa.Column("http_status", sa.Integer()),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("policy_version", sa.String(64)),
        sa.Column("price_table_version", sa.String(64)),
        sa.Column("difficulty", sa.Float()),
        sa.Column("threshold", sa.Float()),
        sa.Column("route_reason", sa.String(64)),
        sa.Column("prompt_text", sa.Text()),
        sa.Column("completion_text", sa.Text()),
    )
    op.create_index("ix_requests_created_at", "requests", ["created_at"])
    op.create_index("ix_requests_team_created_at", "requests", ["team", "created_at"])
    op.create_index("ix_requests_backend_created_at", "requests", ["backend", "created_at"])
    op.create_index("ix_requests_api_key_id", "requests", ["api_key_id"])

    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("key_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("team", sa.String(128), nullable=False),
        sa.Column("budget_usd", sa.Float()),
        sa.Column("rpm", sa.Integer()),
        sa.Column("tpm", sa.Integer()),
        sa.Column("is_admin", sa.Boolean(), nullable=False),
        sa.Column("revoked", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )

    op.execute(COST_LEDGER_VIEW)


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS cost_ledger")
    op.drop_table("api_keys")
    op.drop_index("ix_requests_api_key_id", table_name="requests")
    op.drop_index("ix_requests_backend_created_at", table_name="requests")
    op.drop_index("ix_requests_team_created_at", table_name="requests")
    op.drop_index("ix_requests_created_at", table_name="requests")
    op.drop_table("requests")
