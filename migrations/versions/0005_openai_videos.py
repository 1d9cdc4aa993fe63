"""OpenAI-compatible videos: which API created a job, and deleted jobs

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-04 10:00:00.000000

- ``jobs.api_flavour``: ``vidq`` for a job created through ``/v1/jobs``, ``openai`` through ``/v1/videos``. Both APIs
  show every job of the tenant; the flavour decides only the shape of the job's webhook (``job.*`` events with the
  job's body, or OpenAI's ``video.*`` events). NOT NULL with a server default: existing rows are ``vidq`` without a
  rewrite (a constant default is stored in the catalogue since Postgres 11). The model (shared/models.py) keeps the
  default on the Python side, because the API's async store inserts every column Postgres does not fill itself.
- ``jobs.deleted_at``: set by ``DELETE /v1/videos/{id}``; a deleted job answers 404 on both APIs and leaves both
  lists. Its S3 objects are left in place (the result cache may share them with other jobs: ``jobs.result_of``).
  Nullable without a default: adding it rewrites nothing. No index: every query that filters on it already reads
  one tenant's entries of another index.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "jobs", sa.Column("api_flavour", sa.String(length=16), nullable=False, server_default=sa.text("'vidq'"))
    )
    op.add_column("jobs", sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "deleted_at")
    op.drop_column("jobs", "api_flavour")
