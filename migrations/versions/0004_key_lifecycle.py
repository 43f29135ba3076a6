"""Key lifecycle: per-key allowed routes, and when a key was revoked, rotated or last changed.

Revision ID: 0004_key_lifecycle
Revises: 0003_buy_vs_host
Create Date: 2026-12-03

- `api_keys.routes`: a JSON array of the route names the key may use; NULL means every route.
- `api_keys.revoked_at`, `rotated_at`, `updated_at`: audit times (UTC). A rotation keeps the key's id (so its
  spend, budget and ledger rows carry on) and replaces `key_hash`; the old secret no longer matches any row.

Plain `ADD COLUMN`s of nullable columns: the same on SQLite and PostgreSQL, no table rebuild.
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004_key_lifecycle"
down_revision: str | None = "0003_buy_vs_host"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COLUMNS = (
    ("routes", sa.Text()),
    ("revoked_at", sa.DateTime(timezone=True)),
    ("rotated_at", sa.DateTime(timezone=True)),
    ("updated_at", sa.DateTime(timezone=True)),
)


def upgrade() -> None:
    for name, type_ in _COLUMNS:
        op.add_column("api_keys", sa.Column(name, type_, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:  # SQLite drops columns by rebuilding the table
        for name, _ in reversed(_COLUMNS):
            batch.drop_column(name)
