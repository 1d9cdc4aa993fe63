"""webhook schedule in Postgres: each delivery attempt records when the next one is due

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02 10:00:00.000000

Retries used to sleep in a Celery countdown, lost with the worker (and a 10 h countdown outlives Redis' visibility
timeout). Now the attempt row says when the next attempt is due and the sweeper hands it over:
- ``next_attempt_at``: set on a retryable failure from the schedule (shared/webhooks/schedule.py), null once
  delivered or given up; kept on older attempts, so the delivery log shows when each retry was planned;
- ``superseded``: true on every attempt but the latest of its job and event, so only the latest can be due;
- ``handed_over_at``: when the sweeper last handed the due attempt to the webhook queue (a lease: a lost message
  is handed over again after ``webhook_resend_grace_s``);
- ix_webhook_deliveries_due holds only the latest attempts with a retry planned: the sweeper's step costs O(due);
  ix_webhook_deliveries_failed only the latest attempts that failed: the tenant's list of failed deliveries.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

# name → (columns, partial-index predicate); shared/models.py WebhookDelivery.__table_args__ holds the same list.
_INDEXES: dict[str, tuple[list[str], str]] = {
    "ix_webhook_deliveries_due": (["next_attempt_at"], "next_attempt_at IS NOT NULL AND NOT superseded"),
    "ix_webhook_deliveries_failed": (["id DESC"], "NOT ok AND NOT superseded"),
}


def upgrade() -> None:
    op.add_column("webhook_deliveries", sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("webhook_deliveries", sa.Column("handed_over_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column(
        "webhook_deliveries", sa.Column("superseded", sa.Boolean(), nullable=False, server_default=sa.false())
    )
    # Attempts made before this revision: only the latest of each job and event stays current. None has a retry
    # planned (their retries, if any, were countdowns in the broker).
    op.execute(
        """
        UPDATE webhook_deliveries d SET superseded = true
        WHERE EXISTS (
            SELECT 1 FROM webhook_deliveries later
            WHERE later.job_id = d.job_id AND later.event_type = d.event_type AND later.attempt > d.attempt
        )
        """
    )
    for name, (columns, where) in _INDEXES.items():
        op.create_index(
            name,
            "webhook_deliveries",
            [sa.text(c) for c in columns],
            postgresql_where=sa.text(where),
            if_not_exists=True,
        )


def downgrade() -> None:
    for name in reversed(list(_INDEXES)):
        op.drop_index(name, table_name="webhook_deliveries")
    op.drop_column("webhook_deliveries", "superseded")
    op.drop_column("webhook_deliveries", "handed_over_at")
    op.drop_column("webhook_deliveries", "next_attempt_at")
