"""a tenant's failing webhook deliveries by index: ``webhook_deliveries.tenant_id``

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-04 10:00:00.000000

``GET /v1/webhooks/deliveries`` read ix_webhook_deliveries_failed, the latest failed attempts of every tenant, and
threw away the other tenants' rows through a join on ``jobs``: a page cost O(every tenant's failures). Now each
attempt carries its job's tenant (a job never changes tenant) and the list reads one of two indexes that lead with
it, one per state the endpoint asks for:
- ix_webhook_deliveries_tenant_failed: the latest attempts that failed with no retry planned (given up, or gone);
- ix_webhook_deliveries_tenant_retrying: the latest attempts that failed with the next attempt planned.
A page reads O(page) entries, whatever the other tenants hold. ix_webhook_deliveries_failed has no reader left and
is dropped.

Upgrade fills ``tenant_id`` from ``jobs`` (one pass over the delivery log) before making it NOT NULL. Plain CREATE
INDEX, as in 0002 (build them CONCURRENTLY by hand first on a large live table; ``IF NOT EXISTS`` then leaves them
be). Downgrade restores the old index and drops the column.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

# name → (columns, partial-index predicate); shared/models.py WebhookDelivery.__table_args__ holds the same list.
_INDEXES: dict[str, tuple[list[str], str]] = {
    "ix_webhook_deliveries_tenant_failed": (
        ["tenant_id", "id DESC"],
        "NOT ok AND NOT superseded AND next_attempt_at IS NULL",
    ),
    "ix_webhook_deliveries_tenant_retrying": (
        ["tenant_id", "id DESC"],
        "NOT ok AND NOT superseded AND next_attempt_at IS NOT NULL",
    ),
}
_OLD = ("ix_webhook_deliveries_failed", ["id DESC"], "NOT ok AND NOT superseded")


def upgrade() -> None:
    op.add_column("webhook_deliveries", sa.Column("tenant_id", sa.UUID(), nullable=True))
    op.execute("UPDATE webhook_deliveries d SET tenant_id = j.tenant_id FROM jobs j WHERE j.id = d.job_id")
    op.alter_column("webhook_deliveries", "tenant_id", nullable=False)
    for name, (columns, where) in _INDEXES.items():
        op.create_index(
            name,
            "webhook_deliveries",
            [sa.text(c) for c in columns],
            postgresql_where=sa.text(where),
            if_not_exists=True,
        )
    op.drop_index(_OLD[0], table_name="webhook_deliveries")


def downgrade() -> None:
    name, columns, where = _OLD
    op.create_index(
        name, "webhook_deliveries", [sa.text(c) for c in columns], postgresql_where=sa.text(where), if_not_exists=True
    )
    for index in reversed(list(_INDEXES)):
        op.drop_index(index, table_name="webhook_deliveries")
    op.drop_column("webhook_deliveries", "tenant_id")
