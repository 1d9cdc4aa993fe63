"""fair share between tenants inside a class: each tenant's virtual time per class, and each class's clock

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02 14:40:00.000000

- ``fair_shares``: per class and tenant, the virtual time the tenant's next job would start at (its ``pass``); a
  claim advances it by 1 / the tenant's weight (shared/jobs/fairness.py).
- ``fair_clocks``: per class, the virtual time of the job claimed last. A tenant that was idle rejoins at the clock,
  so time it did not use is not saved up for later.
- ``ix_jobs_queued_fair``: the oldest queued job of each tenant in a class, read by every claim.

New tables and an index on the queued jobs only: nothing existing is rewritten.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import UUID

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "fair_shares",
        sa.Column("priority_class", sa.String(length=8), primary_key=True),
        sa.Column("tenant_id", UUID(as_uuid=True), sa.ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("pass", sa.Float(), nullable=False),
    )
    op.create_table(
        "fair_clocks",
        sa.Column("priority_class", sa.String(length=8), primary_key=True),
        sa.Column("vtime", sa.Float(), nullable=False),
    )
    op.create_index(
        "ix_jobs_queued_fair",
        "jobs",
        ["priority_class", "tenant_id", "created_at", "id"],
        postgresql_where=sa.text("status = 'queued'"),
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_queued_fair", table_name="jobs")
    op.drop_table("fair_clocks")
    op.drop_table("fair_shares")
