"""trace context: a job's W3C traceparent, so that every message of the job continues one trace

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 01:00:00.000000

- ``jobs.traceparent``: the W3C ``traceparent`` (``00-<trace id>-<span id>-<flags>``, 55 characters) of the request
  that created the job, written with the row when tracing is on (shared/infra/tracing.py). The sweeper's re-sends, a
  retry's new message and every webhook hand-over start their spans from it, so all attempts of a job and its
  webhook deliveries are one trace. Null when tracing was off, and for jobs made before this revision.

Nullable without a default and never indexed (nothing looks a job up by its trace): adding it rewrites nothing.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("traceparent", sa.String(length=55), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "traceparent")
