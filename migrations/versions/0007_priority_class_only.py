"""one column for a job's priority: ``jobs.priority_class``; ``jobs.queue`` is gone

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02 12:30:00.000000

A job's class was kept twice: ``priority_class`` (set at submit, never changed) and ``queue`` (rewritten by the
send recorder, moved up by aging). The class is now the one truth: aging moves it up in the sweeper's own
transaction, and the queue a message goes to is derived from it (``Job.queue``).

Upgrade: a job that aging had already moved carries its queue's class over, so nothing waiting loses its place;
the aging index is rebuilt on the class. Downgrade rebuilds ``queue`` from the class.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("UPDATE jobs SET priority_class = substr(queue, 7) WHERE queue <> 'video.' || priority_class")
    op.drop_index("ix_jobs_queued_agable", table_name="jobs")
    op.drop_column("jobs", "queue")
    op.create_index(
        "ix_jobs_queued_agable",
        "jobs",
        ["enqueued_at"],
        postgresql_where=sa.text("status = 'queued' AND priority_class <> 'high'"),
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_queued_agable", table_name="jobs")
    op.add_column("jobs", sa.Column("queue", sa.String(length=32), nullable=True))
    op.execute("UPDATE jobs SET queue = 'video.' || priority_class")
    op.alter_column("jobs", "queue", nullable=False)
    op.create_index(
        "ix_jobs_queued_agable",
        "jobs",
        ["enqueued_at"],
        postgresql_where=sa.text("status = 'queued' AND queue <> 'video.high'"),
    )
