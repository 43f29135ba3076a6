"""Buy versus host: cost-attribution columns, measured engine uptime, and the analysts' views.

Revision ID: 0003_buy_vs_host
Revises: 0002_shadow_evals
Create Date: 2026-12-01

- `requests` gains device_hour_usd, device_kind, utilisation, cost_note and cache_savings_usd; the
  `cost_ledger` view appends them after its existing columns (its contract: names only ever appended).
- `engine_uptime`: one engine's up and busy seconds per interval, from its own counters.
- Views (documented in docs/sql-cookbook.md): engine_minutes (one row per engine and minute, however many
  gateways recorded it), daily_spend, engine_utilisation_hourly,
  route_cost_per_1k_requests, realised_savings_daily, prefix_cache_savings_daily, engine_idle_daily.

Days and hours are UTC whatever the session's time zone: PostgreSQL converts with AT TIME ZONE 'UTC';
SQLite stores the UTC timestamp as text, so its prefix is the UTC day or hour.
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003_buy_vs_host"
down_revision: str | None = "0002_shadow_evals"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COST_LEDGER_COLUMNS = """
    request_id, created_at, api_key_id, team, requested_model, route, backend, served_model,
    prompt_tokens, cached_prompt_tokens, completion_tokens, cost_usd, cost_basis, gpu_seconds,
    counterfactual_cost_usd, ttft_ms, latency_ms, status, policy_version, difficulty, threshold,
    input_cost_usd, output_cost_usd, error_type, price_table_version, route_reason, endpoint, stream,
    http_status, attempts"""

_NEW_COLUMNS = ("device_hour_usd", "device_kind", "utilisation", "cost_note", "cache_savings_usd")


def _buckets(dialect: str) -> tuple[str, str]:
    """SQL for the UTC day ('YYYY-MM-DD') and hour ('YYYY-MM-DD HH') of `created_at`."""
    if dialect == "postgresql":
        return ("to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD')",
                "to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24')")
    return "SUBSTR(created_at, 1, 10)", "SUBSTR(created_at, 1, 13)"


def _views(dialect: str) -> dict[str, str]:
    day, hour = _buckets(dialect)
    return {
        # Several gateway replicas may scrape one engine: each records the same minute. One row per
        # engine and minute, the largest of the recordings, is what the other views and reports read.
        "engine_minutes": """
SELECT backend, created_at,
       MAX(seconds) AS seconds, MAX(busy_seconds) AS busy_seconds, MAX(device_hour_usd) AS device_hour_usd,
       MAX(devices) AS devices, MAX(device_kind) AS device_kind, COUNT(*) AS recorders
FROM engine_uptime
GROUP BY backend, created_at""",
        "daily_spend": f"""
SELECT {day} AS day, team, backend, cost_basis,
       COUNT(*) AS requests,
       SUM(prompt_tokens) AS prompt_tokens,
       SUM(cached_prompt_tokens) AS cached_prompt_tokens,
       SUM(completion_tokens) AS completion_tokens,
       SUM(cost_usd) AS spend_usd
FROM requests
GROUP BY {day}, team, backend, cost_basis""",
        # Up and busy time from the engine's own counters; requests and tokens from the ledger rows.
        "engine_utilisation_hourly": f"""
SELECT hour, backend,
       SUM(up_seconds) AS up_seconds,
       SUM(busy_seconds) AS busy_seconds,
       CASE WHEN SUM(up_seconds) > 0 THEN SUM(busy_seconds) / SUM(up_seconds) END AS utilisation,
       SUM(paid_usd) AS paid_usd,
       SUM(busy_usd) AS busy_usd,
       SUM(paid_usd) - SUM(busy_usd) AS idle_usd,
       SUM(requests) AS requests,
       SUM(prompt_tokens) AS prompt_tokens,
       SUM(completion_tokens) AS completion_tokens,
       SUM(attributed_seconds) AS attributed_seconds
FROM (
    SELECT {hour} AS hour, backend, seconds AS up_seconds, busy_seconds,
           seconds * device_hour_usd / 3600.0 AS paid_usd, busy_seconds * device_hour_usd / 3600.0 AS busy_usd,
           0 AS requests, 0 AS prompt_tokens, 0 AS completion_tokens, 0.0 AS attributed_seconds
    FROM engine_minutes
    UNION ALL
    SELECT {hour} AS hour, backend, 0.0, 0.0, 0.0, 0.0,
           1, prompt_tokens, completion_tokens, COALESCE(gpu_seconds, 0.0)
    FROM requests
    WHERE cost_basis = 'gpu_amortized' AND backend IS NOT NULL
) AS parts
GROUP BY hour, backend""",
        "route_cost_per_1k_requests": """
SELECT route,
       COUNT(*) AS requests,
       SUM(cost_usd) AS spend_usd,
       1000.0 * SUM(cost_usd) / COUNT(*) AS usd_per_1k_requests
FROM requests
WHERE route IS NOT NULL
GROUP BY route""",
        "realised_savings_daily": f"""
SELECT {day} AS day, backend,
       COUNT(*) AS requests,
       SUM(cost_usd) AS cost_usd,
       SUM(counterfactual_cost_usd) AS api_alternative_usd,
       SUM(counterfactual_cost_usd - cost_usd) AS savings_usd
FROM requests
WHERE cost_basis = 'gpu_amortized' AND counterfactual_cost_usd IS NOT NULL
GROUP BY {day}, backend""",
        "prefix_cache_savings_daily": f"""
SELECT {day} AS day, backend,
       SUM(prompt_tokens) AS prompt_tokens,
       SUM(cached_prompt_tokens) AS cached_prompt_tokens,
       SUM(COALESCE(cache_savings_usd, 0.0)) AS savings_usd
FROM requests
WHERE cached_prompt_tokens > 0 AND backend IS NOT NULL
GROUP BY {day}, backend""",
        "engine_idle_daily": f"""
SELECT {day} AS day, backend,
       SUM(seconds) / 3600.0 AS paid_hours,
       SUM(busy_seconds) / 3600.0 AS busy_hours,
       (SUM(seconds) - SUM(busy_seconds)) / 3600.0 AS idle_hours,
       SUM(seconds * device_hour_usd) / 3600.0 AS paid_usd,
       SUM(busy_seconds * device_hour_usd) / 3600.0 AS busy_usd,
       SUM((seconds - busy_seconds) * device_hour_usd) / 3600.0 AS idle_usd,
       CASE WHEN SUM(seconds) > 0 THEN SUM(busy_seconds) / SUM(seconds) END AS utilisation
FROM engine_minutes
GROUP BY {day}, backend""",
    }


VIEW_NAMES = ("engine_minutes", "daily_spend", "engine_utilisation_hourly", "route_cost_per_1k_requests", "realised_savings_daily",
              "prefix_cache_savings_daily", "engine_idle_daily")


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    op.execute("DROP VIEW IF EXISTS cost_ledger")
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("device_hour_usd", sa.Float()))
        batch.add_column(sa.Column("device_kind", sa.String(16)))
        batch.add_column(sa.Column("utilisation", sa.Float()))
        batch.add_column(sa.Column("cost_note", sa.String(64)))
        batch.add_column(sa.Column("cache_savings_usd", sa.Float()))
    op.execute(f"CREATE VIEW cost_ledger AS SELECT {_COST_LEDGER_COLUMNS},\n    {', '.join(_NEW_COLUMNS)}\n"
               "FROM requests")

    big_id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
    op.create_table(
        "engine_uptime",
        sa.Column("id", big_id, primary_key=True, autoincrement=True),
        sa.Column("interval_id", sa.String(200), nullable=False, unique=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("backend", sa.String(128), nullable=False),
        sa.Column("seconds", sa.Float(), nullable=False),
        sa.Column("busy_seconds", sa.Float(), nullable=False),
        sa.Column("device_hour_usd", sa.Float(), nullable=False),
        sa.Column("devices", sa.Integer(), nullable=False),
        sa.Column("device_kind", sa.String(16), nullable=False),
    )
    op.create_index("ix_engine_uptime_backend_created_at", "engine_uptime", ["backend", "created_at"])
    for name, body in _views(dialect).items():
        op.execute(f"CREATE VIEW {name} AS {body}")


def downgrade() -> None:
    for name in reversed(VIEW_NAMES):
        op.execute(f"DROP VIEW IF EXISTS {name}")
    op.drop_index("ix_engine_uptime_backend_created_at", table_name="engine_uptime")
    op.drop_table("engine_uptime")
    op.execute("DROP VIEW IF EXISTS cost_ledger")
    with op.batch_alter_table("requests") as batch:
        for column in reversed(_NEW_COLUMNS):
            batch.drop_column(column)
    op.execute(f"CREATE VIEW cost_ledger AS SELECT {_COST_LEDGER_COLUMNS}\nFROM requests")
