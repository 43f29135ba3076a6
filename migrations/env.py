"""Alembic environment for the ledger schema.

Built for programmatic use (`gateway.db.upgrade(url)`, `switchyard db upgrade`): the URL arrives in
`config.attributes["database_url"]`; there is no alembic.ini. The `alembic` CLI also works with
`-x url=postgresql+psycopg://…` and `-c` pointing at any ini that sets script_location here.
"""
from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool, text

from gateway.ledger.models import Base

# Any fixed number: all gateway replicas take the same lock, so concurrent starts upgrade once.
PG_MIGRATION_LOCK = 0x5317C4

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = config.attributes.get("database_url") or context.get_x_argument(as_dictionary=True).get("url")
    url = url or config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no database URL: call gateway.db.upgrade(url) or pass -x url=…")
    return url


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True,
                      render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = create_engine(_url(), poolclass=pool.NullPool)
    try:
        with engine.connect() as connection:
            # render_as_batch: SQLite cannot ALTER most things; batch mode copies the table instead.
            context.configure(connection=connection, target_metadata=target_metadata,
                              render_as_batch=connection.dialect.name == "sqlite")
            with context.begin_transaction():
                if connection.dialect.name == "postgresql":
                    connection.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": PG_MIGRATION_LOCK})
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
