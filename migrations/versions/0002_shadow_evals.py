"""Shadow evaluations: labelled (weak_correct, strong_correct) pairs from mirrored traffic.

Revision ID: 0002_shadow_evals
Revises: 0001_ledger_schema
Create Date: 2025-01-02

Written by hand, like 0001; the cost_ledger view is unchanged.
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002_shadow_evals"
down_revision: str | None = "0001_ledger_schema"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    big_id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
    op.create_table(
        "shadow_evals",
        sa.Column("id", big_id, primary_key=True, autoincrement=True),
        sa.Column("request_id", sa.String(64), nullable=False, unique=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("route", sa.String(256), nullable=False),
        sa.Column("endpoint", sa.String(32), nullable=False),
        sa.Column("prompt_text", sa.Text(), nullable=False),
        sa.Column("messages_json", sa.Text()),
        sa.Column("easy_backend", sa.String(128), nullable=False),
        sa.Column("hard_backend", sa.String(128), nullable=False),
        sa.Column("served_backend", sa.String(128), nullable=False),
        sa.Column("weak_answer", sa.Text()),
        sa.Column("strong_answer", sa.Text()),
        sa.Column("weak_correct", sa.Boolean(), nullable=False),
        sa.Column("strong_correct", sa.Boolean(), nullable=False),
        sa.Column("judge", sa.String(128), nullable=False),
        sa.Column("difficulty", sa.Float()),
        sa.Column("threshold", sa.Float()),
        sa.Column("model_version", sa.String(64)),
        sa.Column("policy_version", sa.String(64)),
    )
    op.create_index("ix_shadow_evals_route_created_at", "shadow_evals", ["route", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_shadow_evals_route_created_at", table_name="shadow_evals")
    op.drop_table("shadow_evals")
