"""result cache: a job identical to a succeeded one of its tenant reuses that job's video

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03 10:00:00.000000

- ``jobs.result_key``: sha256 (hex) of the job's whole resolved spec (shared/spec.py ``GenerationSpec.result_key``),
  set on every job the API creates from now on, whether or not its request used the cache. Jobs made before this
  revision keep null and are never matched: the key is computed in Python over canonical JSON, which SQL cannot
  reproduce byte for byte, and rewriting every row of a large table to backfill it is not worth a cache miss each.
- ``jobs.result_of``: the job whose stored objects (output_key, poster_key) a job served from the cache reuses, null
  when the job rendered its own. ON DELETE SET NULL: deleting a job row must not delete the jobs that point at its
  objects; whoever deletes or expires stored objects must first look for jobs pointing at them (ix_jobs_result_of).
- ix_jobs_result_cache holds only succeeded jobs with a key: the submit's lookup (this tenant, this key, newest
  first, LIMIT 1) reads one entry, however many jobs were served that same request (created_at is in the index).
- ix_jobs_result_of holds only the jobs served from the cache: the foreign key's ON DELETE action and any "who
  still uses this video" question read it instead of the whole table.

Plain CREATE INDEX, as in 0002 (build them CONCURRENTLY by hand first on a large live table; ``IF NOT EXISTS`` then
leaves them be). The two columns are nullable without a default: adding them rewrites nothing.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

# name → (columns, partial-index predicate); shared/models.py Job.__table_args__ holds the same list.
_INDEXES: dict[str, tuple[list[str], str]] = {
    "ix_jobs_result_cache": (
        ["tenant_id", "result_key", "created_at DESC"],
        "status = 'succeeded' AND result_key IS NOT NULL",
    ),
    "ix_jobs_result_of": (["result_of"], "result_of IS NOT NULL"),
}


def upgrade() -> None:
    op.add_column("jobs", sa.Column("result_key", sa.String(length=64), nullable=True))
    op.add_column("jobs", sa.Column("result_of", sa.UUID(), nullable=True))
    op.create_foreign_key("jobs_result_of_fkey", "jobs", "jobs", ["result_of"], ["id"], ondelete="SET NULL")
    for name, (columns, where) in _INDEXES.items():
        op.create_index(
            name,
            "jobs",
            [sa.text(c) for c in columns],
            postgresql_where=sa.text(where),
            if_not_exists=True,
        )


def downgrade() -> None:
    for name in reversed(list(_INDEXES)):
        op.drop_index(name, table_name="jobs")
    op.drop_constraint("jobs_result_of_fkey", "jobs", type_="foreignkey")
    op.drop_column("jobs", "result_of")
    op.drop_column("jobs", "result_key")
