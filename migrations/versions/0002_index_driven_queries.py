"""index-driven queries: every query the API and the sweeper send has an index

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 10:00:00.000000

A list page costs O(page) and a sweeper step O(work due), never O(table):
- list pages read (tenant_id[, status], created_at DESC, id DESC) in the ORDER BY's own direction, the keyset
  cursor being a row comparison on (created_at, id);
- each sweeper step reads a partial index that holds only the rows it can act on (running; queued and never sent;
  queued and sent; queued below the high class; finished with a webhook whose first attempt is not on record);
- ``jobs.webhook_pending_since`` is the column behind the last one: shared/jobs/states.py sets it in the UPDATE that
  finishes a job with a webhook URL, services/webhooks/tasks.py clears it with the first delivery attempt.
- ix_jobs_status_created served none of these and goes; ix_jobs_tenant_created is replaced by its DESC twin.

Plain CREATE INDEX, not CONCURRENTLY: Alembic runs each migration in a transaction (env.py also holds an advisory
lock for it), and CONCURRENTLY cannot run inside one. It locks ``jobs`` against writes while it builds (seconds per
million rows); on a large live table, build these indexes CONCURRENTLY by hand first, under the same names, and
this migration's ``IF NOT EXISTS`` leaves them be.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

# name → (columns, partial-index predicate or None); shared/models.py Job.__table_args__ holds the same list.
_INDEXES: dict[str, tuple[list[str], str | None]] = {
    "ix_jobs_tenant_newest": (["tenant_id", "created_at DESC", "id DESC"], None),
    "ix_jobs_tenant_status_newest": (["tenant_id", "status", "created_at DESC", "id DESC"], None),
    "ix_jobs_running": (["id"], "status = 'running'"),
    "ix_jobs_queued_unsent": (["created_at"], "status = 'queued' AND enqueued_at IS NULL"),
    "ix_jobs_queued_sent": (["enqueued_at"], "status = 'queued'"),
    "ix_jobs_queued_agable": (["enqueued_at"], "status = 'queued' AND queue <> 'video.high'"),
    "ix_jobs_webhook_pending": (["webhook_pending_since"], "webhook_pending_since IS NOT NULL"),
}


def upgrade() -> None:
    op.add_column("jobs", sa.Column("webhook_pending_since", sa.DateTime(timezone=True), nullable=True))
    # The webhooks the old sweeper query would still have handed over: finished in the last day, a URL, no attempt.
    op.execute(
        """
        UPDATE jobs SET webhook_pending_since = finished_at
        WHERE status IN ('succeeded', 'failed', 'cancelled')
          AND webhook_url IS NOT NULL
          AND finished_at > now() - interval '1 day'
          AND NOT EXISTS (SELECT 1 FROM webhook_deliveries d WHERE d.job_id = jobs.id)
        """
    )
    for name, (columns, where) in _INDEXES.items():
        op.create_index(
            name,
            "jobs",
            [sa.text(c) for c in columns],
            postgresql_where=sa.text(where) if where else None,
            if_not_exists=True,
        )
    op.drop_index("ix_jobs_status_created", table_name="jobs")
    op.drop_index("ix_jobs_tenant_created", table_name="jobs")
    # The sweeper deletes expired keys in batches by expires_at: ix_idempotency_keys_expires_at (0001) serves it.


def downgrade() -> None:
    op.create_index("ix_jobs_tenant_created", "jobs", ["tenant_id", "created_at", "id"], unique=False)
    op.create_index("ix_jobs_status_created", "jobs", ["status", "created_at"], unique=False)
    for name in reversed(list(_INDEXES)):
        op.drop_index(name, table_name="jobs")
    op.drop_column("jobs", "webhook_pending_since")
