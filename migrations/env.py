"""Alembic environment: the URL comes from vidq's Settings (or the config's main option when set)."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool

from shared.infra.config import get_settings
from shared.models import Base

config = context.config
url = config.get_main_option("sqlalchemy.url") or get_settings().sqlalchemy_url


def run_migrations_offline() -> None:
    context.configure(url=url, target_metadata=Base.metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = create_engine(url, poolclass=pool.NullPool, connect_args={"connect_timeout": 10})
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=Base.metadata, compare_type=True)
        with context.begin_transaction():
            # Two services starting at once must not both migrate: serialise on an advisory lock.
            connection.exec_driver_sql("SELECT pg_advisory_xact_lock(7669647100)")
            context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
