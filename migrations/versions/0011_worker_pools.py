"""worker pools: each job's pool, the routing rules, and fair share per pool

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-04 03:30:00.000000

- ``jobs.pool``: the worker pool the job is routed to (``stable`` for every job made before this revision);
  ``jobs.routed_by``: what decided it (``default``, ``header``, ``tenant``, ``split``, ``fallback``, ``rerouted``).
- ``pools``: one row per pool other than the default's rules: its share of the split (percent of jobs, by a stable
  hash of the job id) and its state (``routable``, ``rolled_back``, ``tripped`` by its failure-rate breaker), with
  the reason and time of the last change. The ``stable`` row is inserted here and always routable.
- ``tenant_pools``: per tenant, the pool it is assigned to (null: the split decides) and whether it may choose a
  pool itself with the ``X-Vidq-Pool`` request header.
- ``fair_shares`` / ``fair_clocks`` gain ``pool`` in their keys: each pool keeps its own fair order per class.
- ``ix_jobs_queued_fair`` is rebuilt with the pool after the class (a claim reads the heads of one class in one
  pool); ``ix_jobs_queued_pooled`` holds the queued jobs of pools other than ``stable`` (what a roll back or the
  sweeper moves); ``ix_jobs_pool_finished`` the finished jobs by pool and time (the breaker's window and
  ``vidq pools compare``).

The new job columns have server defaults (no table rewrite on Postgres 11+).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import UUID

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("pool", sa.String(length=32), nullable=False, server_default=sa.text("'stable'")))
    op.add_column(
        "jobs", sa.Column("routed_by", sa.String(length=16), nullable=False, server_default=sa.text("'default'"))
    )
    op.create_table(
        "pools",
        sa.Column("name", sa.String(length=32), primary_key=True),
        sa.Column("split_percent", sa.Float(), nullable=False, server_default=sa.text("0")),
        sa.Column("state", sa.String(length=16), nullable=False, server_default=sa.text("'routable'")),
        sa.Column("state_reason", sa.Text(), nullable=False, server_default=sa.text("''")),
        sa.Column("state_changed_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.CheckConstraint("split_percent >= 0 AND split_percent <= 100", name="ck_pools_split_percent"),
    )
    op.execute("INSERT INTO pools (name) VALUES ('stable')")
    op.create_table(
        "tenant_pools",
        sa.Column("tenant_id", UUID(as_uuid=True), sa.ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("pool", sa.String(length=32), sa.ForeignKey("pools.name", ondelete="SET NULL"), nullable=True),
        sa.Column("may_choose", sa.Boolean(), nullable=False, server_default=sa.text("false")),
    )
    for table, columns in (
        ("fair_shares", ["priority_class", "pool", "tenant_id"]),
        ("fair_clocks", ["priority_class", "pool"]),
    ):
        op.add_column(
            table, sa.Column("pool", sa.String(length=32), nullable=False, server_default=sa.text("'stable'"))
        )
        op.drop_constraint(f"{table}_pkey", table, type_="primary")
        op.create_primary_key(f"{table}_pkey", table, columns)
    op.drop_index("ix_jobs_queued_fair", table_name="jobs")
    op.create_index(
        "ix_jobs_queued_fair",
        "jobs",
        ["priority_class", "pool", "tenant_id", "created_at", "id"],
        postgresql_where=sa.text("status = 'queued'"),
    )
    op.create_index(
        "ix_jobs_queued_pooled", "jobs", ["pool"], postgresql_where=sa.text("status = 'queued' AND pool <> 'stable'")
    )
    op.create_index(
        "ix_jobs_pool_finished", "jobs", ["pool", "finished_at"], postgresql_where=sa.text("finished_at IS NOT NULL")
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_pool_finished", table_name="jobs")
    op.drop_index("ix_jobs_queued_pooled", table_name="jobs")
    op.drop_index("ix_jobs_queued_fair", table_name="jobs")
    op.create_index(
        "ix_jobs_queued_fair",
        "jobs",
        ["priority_class", "tenant_id", "created_at", "id"],
        postgresql_where=sa.text("status = 'queued'"),
    )
    for table, columns in (("fair_shares", ["priority_class", "tenant_id"]), ("fair_clocks", ["priority_class"])):
        op.execute(f"DELETE FROM {table} WHERE pool <> 'stable'")
        op.drop_constraint(f"{table}_pkey", table, type_="primary")
        op.create_primary_key(f"{table}_pkey", table, columns)
        op.drop_column(table, "pool")
    op.drop_table("tenant_pools")
    op.drop_table("pools")
    op.drop_column("jobs", "routed_by")
    op.drop_column("jobs", "pool")
