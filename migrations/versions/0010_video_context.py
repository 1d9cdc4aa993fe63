"""what a video is about: keyframe embeddings (pgvector, HNSW) and motion prototypes

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03 18:00:00.000000

- ``video_contexts``: one row per finished video that the worker described — its 512-d keyframe embedding (the
  ``vector`` type of the pgvector extension, which this revision creates), the embedding's space (version and model:
  vectors of two spaces are never compared), its motion tokens, descriptor and readable label.
  ``ix_video_contexts_embedding`` is an HNSW index over cosine distance: a tenant's nearest videos in O(log n).
  ``ix_video_contexts_tenant_motion``: a tenant's videos of one motion in the list's order (the job's
  ``created_at``, copied as ``job_created_at``, then its id), so a filtered page reads O(page) entries.
- ``motion_prototype_sets``: one row per refit of the motion prototypes (version, when, from how many videos,
  with which parameters); ``motion_prototypes``: the set's global prototypes and the variants per class;
  ``motion_assignments``: each described video's prototype and variant in each set. Sets are never rewritten: an
  assignment of an older set stays readable until that set is pruned.

New tables only: nothing existing is rewritten. The server must offer the ``vector`` extension (pgvector 0.5 or
later; the pgvector/pgvector images and the embedded pgserver ship it).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from pgvector.sqlalchemy import Vector
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("CREATE EXTENSION IF NOT EXISTS vector")
    op.create_table(
        "video_contexts",
        sa.Column("job_id", UUID(as_uuid=True), sa.ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("tenant_id", UUID(as_uuid=True), nullable=False),
        sa.Column("space", sa.String(length=120), nullable=False),
        sa.Column("embedding", Vector(512), nullable=False),
        sa.Column("keyframes", sa.Integer(), nullable=False),
        sa.Column("motion_label", sa.String(length=16), nullable=False),
        sa.Column("motion_descriptor", ARRAY(sa.Float()), nullable=False),
        sa.Column("motion_tokens", JSONB(), nullable=False),
        sa.Column("job_created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    )
    op.create_index(
        "ix_video_contexts_embedding",
        "video_contexts",
        ["embedding"],
        postgresql_using="hnsw",
        postgresql_with={"m": 16, "ef_construction": 64},
        postgresql_ops={"embedding": "vector_cosine_ops"},
    )
    op.create_index("ix_video_contexts_tenant_space", "video_contexts", ["tenant_id", "space", "created_at"])
    op.create_index(
        "ix_video_contexts_tenant_motion", "video_contexts", ["tenant_id", "motion_label", "job_created_at", "job_id"]
    )
    op.create_table(
        "motion_prototype_sets",
        sa.Column("version", sa.Integer(), sa.Identity(), primary_key=True),
        sa.Column("fitted_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.Column("videos", sa.Integer(), nullable=False),
        sa.Column("params", JSONB(), nullable=False),
    )
    op.create_table(
        "motion_prototypes",
        sa.Column(
            "version",
            sa.Integer(),
            sa.ForeignKey("motion_prototype_sets.version", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("class_label", sa.String(length=16), primary_key=True),  # '' for a global prototype
        sa.Column("index", sa.Integer(), primary_key=True),
        sa.Column("descriptor", ARRAY(sa.Float()), nullable=False),
        sa.Column("label", sa.String(length=16), nullable=False),
        sa.Column("members", sa.Integer(), nullable=False),
    )
    op.create_table(
        "motion_assignments",
        sa.Column("job_id", UUID(as_uuid=True), sa.ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column(
            "version",
            sa.Integer(),
            sa.ForeignKey("motion_prototype_sets.version", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("prototype", sa.Integer(), nullable=False),
        sa.Column("variant_class", sa.String(length=16), nullable=False),
        sa.Column("variant", sa.Integer(), nullable=True),
    )
    op.create_index("ix_motion_assignments_prototype", "motion_assignments", ["version", "prototype", "job_id"])
    op.create_index(
        "ix_motion_assignments_variant", "motion_assignments", ["version", "variant_class", "variant", "job_id"]
    )


def downgrade() -> None:
    op.drop_table("motion_assignments")
    op.drop_table("motion_prototypes")
    op.drop_table("motion_prototype_sets")
    op.drop_table("video_contexts")
