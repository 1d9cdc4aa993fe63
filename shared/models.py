"""Postgres tables. Postgres owns job state; the broker only ever carries a job id."""

from __future__ import annotations

import enum
import uuid
from datetime import datetime
from typing import Any

from pgvector.sqlalchemy import Vector
from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Identity,
    Index,
    Integer,
    String,
    Text,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from shared.queues import STABLE_POOL, PriorityClass, video_queue


class Base(DeclarativeBase):
    pass


def _uuid() -> uuid.UUID:
    return uuid.uuid4()


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True, default=_uuid)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    webhook_secret: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True, default=_uuid)
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    prefix: Mapped[str] = mapped_column(String(32))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the whole key
    name: Mapped[str] = mapped_column(String(200), default="")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class ApiFlavour(enum.StrEnum):
    """Which API created a job (``jobs.api_flavour``): it decides the shape of the job's webhook only."""

    VIDQ = "vidq"  # POST /v1/jobs
    OPENAI = "openai"  # POST /v1/videos (OpenAI's videos API)


class Job(Base):
    __tablename__ = "jobs"
    # Every query the API and the sweeper send has its index here (migrations/versions/0002): a list page costs
    # O(page), a sweeper step O(work due), never O(table). tests/services/{api,sweeper}/test_query_plans.py check
    # the plans.
    __table_args__ = (
        # GET /v1/jobs, newest first; the keyset cursor is a row comparison on (created_at, id).
        Index("ix_jobs_tenant_newest", "tenant_id", text("created_at DESC"), text("id DESC")),
        # GET /v1/jobs?status=…
        Index("ix_jobs_tenant_status_newest", "tenant_id", "status", text("created_at DESC"), text("id DESC")),
        # Sweeper, expired leases. Keyed on id, not lease_expires_at: heartbeats rewrite the lease several times a
        # second per running job, and an indexed lease would make each of those writes a non-HOT update of
        # every index. The running set is as large as the GPU fleet, so reading all of it is O(work in flight).
        Index("ix_jobs_running", "id", postgresql_where=text("status = 'running'")),
        # Sweeper, never sent (crash between commit and send): normally empty.
        Index(
            "ix_jobs_queued_unsent", "created_at", postgresql_where=text("status = 'queued' AND enqueued_at IS NULL")
        ),
        # Sweeper, sent long ago and never claimed (lost message).
        Index("ix_jobs_queued_sent", "enqueued_at", postgresql_where=text("status = 'queued'")),
        # Worker, fair share (shared/jobs/fairness.py): the oldest queued job of each tenant in a class.
        Index(
            "ix_jobs_queued_fair",
            "priority_class",
            "pool",
            "tenant_id",
            "created_at",
            "id",
            postgresql_where=text("status = 'queued'"),
        ),
        # Roll back and the sweeper (shared/pools): the queued jobs of a pool other than 'stable' (normally few).
        Index("ix_jobs_queued_pooled", "pool", postgresql_where=text("status = 'queued' AND pool <> 'stable'")),
        # A pool's finished jobs in a window: its failure-rate breaker and `vidq pools compare`.
        Index("ix_jobs_pool_finished", "pool", "finished_at", postgresql_where=text("finished_at IS NOT NULL")),
        # Sweeper, aging: only what can still move up a class ('high' is shared.queues.PriorityClass.HIGH).
        Index(
            "ix_jobs_queued_agable",
            "enqueued_at",
            postgresql_where=text("status = 'queued' AND priority_class <> 'high'"),
        ),
        # Sweeper, webhooks never attempted: holds only finished jobs whose first attempt is not on record yet.
        Index(
            "ix_jobs_webhook_pending",
            "webhook_pending_since",
            postgresql_where=text("webhook_pending_since IS NOT NULL"),
        ),
        # Submit, result cache (migrations/versions/0004): the tenant's newest succeeded job with the same result
        # key, one entry read however often that request was served (created_at is the index's own order).
        Index(
            "ix_jobs_result_cache",
            "tenant_id",
            "result_key",
            text("created_at DESC"),
            postgresql_where=text("status = 'succeeded' AND result_key IS NOT NULL"),
        ),
        # The jobs reusing a job's video: what the foreign key's ON DELETE SET NULL (and whoever deletes stored
        # objects) looks up; holds only the jobs served from the result cache.
        Index("ix_jobs_result_of", "result_of", postgresql_where=text("result_of IS NOT NULL")),
    )
    __mapper_args__ = {"eager_defaults": True}  # created_at comes back with the INSERT

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True, default=_uuid)
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    status: Mapped[str] = mapped_column(String(16), default="queued")
    spec: Mapped[dict[str, Any]] = mapped_column(JSONB)  # shared.spec.GenerationSpec
    duration_s: Mapped[float] = mapped_column(Float)
    webhook_url: Mapped[str | None] = mapped_column(Text)
    metadata_: Mapped[dict[str, Any]] = mapped_column("metadata", JSONB, default=dict)

    # routing (shared/jobs/scoring.py)
    score: Mapped[float] = mapped_column(Float)
    score_complexity: Mapped[float] = mapped_column(Float)
    score_resolution: Mapped[float] = mapped_column(Float)
    score_duration: Mapped[float] = mapped_column(Float)
    # The job's class: set by its score at submit, moved up only by aging (the sweeper, in its own transaction).
    # It alone decides the queue a message of the job goes to (``queue``).
    priority_class: Mapped[str] = mapped_column(String(8))

    # execution: attempt is the fencing token; lease_expires_at is the heartbeat deadline
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    max_attempts: Mapped[int] = mapped_column(Integer)
    worker_id: Mapped[str | None] = mapped_column(String(200))
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    progress_step: Mapped[int] = mapped_column(Integer, default=0)
    progress_total: Mapped[int] = mapped_column(Integer, default=0)

    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    enqueued_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Set by the UPDATE that finishes a job with a webhook URL, cleared with the first delivery attempt on record:
    # the sweeper finds undelivered webhooks through a partial index on it instead of scanning finished jobs.
    webhook_pending_since: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    error_code: Mapped[str | None] = mapped_column(String(64))
    error_message: Mapped[str | None] = mapped_column(Text)

    output_key: Mapped[str | None] = mapped_column(Text)
    poster_key: Mapped[str | None] = mapped_column(Text)
    output_bytes: Mapped[int | None] = mapped_column(BigInteger)
    output_sha256: Mapped[str | None] = mapped_column(String(64))
    output_frames: Mapped[int | None] = mapped_column(Integer)
    timings: Mapped[dict[str, Any]] = mapped_column(JSONB, default=dict)

    # Result cache: every job's GenerationSpec.result_key (sha256 hex of its whole spec; null only for jobs made
    # before migration 0004); result_of names the job whose stored video (output_key, poster_key) this one reuses
    # instead of rendering, null when it rendered its own.
    result_key: Mapped[str | None] = mapped_column(String(64))
    result_of: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"))

    # Which API created the job (migrations/versions/0005). The database's default is 'vidq' too; here the default
    # stays on the Python side, because the API's async store inserts only the columns without a server default.
    api_flavour: Mapped[str] = mapped_column(String(16), default=ApiFlavour.VIDQ.value)
    # DELETE /v1/videos/{id}: the job answers 404 and leaves every list from then on (its S3 objects stay).
    deleted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    # The W3C traceparent of the request that created the job (shared/infra/tracing.py); every later message of the job
    # continues that trace. Null when tracing was off (and for jobs made before migration 0006).
    traceparent: Mapped[str | None] = mapped_column(String(55))

    # The worker pool the job renders in (shared/pools; migrations/versions/0011) and what routed it there. Python-side
    # defaults, as for api_flavour: the async store inserts only columns without a server default.
    pool: Mapped[str] = mapped_column(String(32), default=STABLE_POOL)
    routed_by: Mapped[str] = mapped_column(String(16), default="default")

    @property
    def queue(self) -> str:
        """The video queue of the job's class in its pool, where its next message goes."""
        return video_queue(PriorityClass(self.priority_class), self.pool or STABLE_POOL)


class FairShare(Base):
    """A tenant's place in the fair order of one class (shared/jobs/fairness.py): the virtual time its next job
    would start at. A tenant without a row starts at the class's clock."""

    __tablename__ = "fair_shares"

    priority_class: Mapped[str] = mapped_column(String(8), primary_key=True)
    pool: Mapped[str] = mapped_column(String(32), primary_key=True, default=STABLE_POOL)
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    pass_: Mapped[float] = mapped_column("pass", Float)


class FairClock(Base):
    """A class's virtual time in a pool: the start time of the job of that class and pool claimed last
    (shared/jobs/fairness.py)."""

    __tablename__ = "fair_clocks"

    priority_class: Mapped[str] = mapped_column(String(8), primary_key=True)
    pool: Mapped[str] = mapped_column(String(32), primary_key=True, default=STABLE_POOL)
    vtime: Mapped[float] = mapped_column(Float)


class Pool(Base):
    """A worker pool's routing rule (shared/pools): its share of the split and whether it is in routing. A pool
    without a row takes no split share; ``stable`` always has one and is always routable (it is the fallback)."""

    __tablename__ = "pools"
    __table_args__ = (CheckConstraint("split_percent >= 0 AND split_percent <= 100", name="ck_pools_split_percent"),)

    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    split_percent: Mapped[float] = mapped_column(Float, default=0.0, server_default=text("0"))
    # routable | rolled_back (an operator's roll back) | tripped (its failure-rate breaker)
    state: Mapped[str] = mapped_column(String(16), default="routable", server_default=text("'routable'"))
    state_reason: Mapped[str] = mapped_column(Text, default="", server_default=text("''"))
    state_changed_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class TenantPool(Base):
    """A tenant's routing: the pool it is assigned to (null: the split decides), and whether it may choose a pool
    with the ``X-Vidq-Pool`` header."""

    __tablename__ = "tenant_pools"

    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    pool: Mapped[str | None] = mapped_column(ForeignKey("pools.name", ondelete="SET NULL"))
    may_choose: Mapped[bool] = mapped_column(Boolean, default=False, server_default=text("false"))


class JobTransition(Base):
    """Audit log: one row per state change (built by shared.jobs.states only: its transitions, and the row of a job
    created succeeded from the result cache, which the API's async store inserts)."""

    __tablename__ = "job_transitions"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    job_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    from_status: Mapped[str | None] = mapped_column(String(16))
    to_status: Mapped[str] = mapped_column(String(16))
    attempt: Mapped[int] = mapped_column(Integer)
    reason: Mapped[str] = mapped_column(String(200), default="")
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class IdempotencyKey(Base):
    __tablename__ = "idempotency_keys"

    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    key: Mapped[str] = mapped_column(String(200), primary_key=True)
    request_hash: Mapped[str] = mapped_column(String(64))
    job_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)


class WebhookDelivery(Base):
    """One delivery attempt. The latest attempt of a job and event (the one not ``superseded``) says what happens
    next: ``next_attempt_at`` set = a retry is planned (the sweeper hands it over when due), null = done
    (delivered, or given up). migrations/versions/0003 explains the columns and indexes."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        # Sweeper: the latest attempts with a retry planned, by due time (O(due), not O(table)).
        Index(
            "ix_webhook_deliveries_due",
            "next_attempt_at",
            postgresql_where=text("next_attempt_at IS NOT NULL AND NOT superseded"),
        ),
        # GET /v1/webhooks/deliveries (migrations/versions/0008): one tenant's latest attempts that failed, newest
        # first, one index per state, so a page reads O(page) entries however many other tenants' failures exist.
        Index(
            "ix_webhook_deliveries_tenant_failed",
            "tenant_id",
            text("id DESC"),
            postgresql_where=text("NOT ok AND NOT superseded AND next_attempt_at IS NULL"),
        ),
        Index(
            "ix_webhook_deliveries_tenant_retrying",
            "tenant_id",
            text("id DESC"),
            postgresql_where=text("NOT ok AND NOT superseded AND next_attempt_at IS NOT NULL"),
        ),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    job_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    # The job's tenant, copied from the job when the attempt is recorded (a job never changes tenant), so the
    # tenant's failing deliveries are found by index. No foreign key of its own: the job's cascades delete the row.
    tenant_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True))
    event_type: Mapped[str] = mapped_column(String(32))
    msg_id: Mapped[str] = mapped_column(String(64))
    attempt: Mapped[int] = mapped_column(Integer)
    url: Mapped[str] = mapped_column(Text)
    ok: Mapped[bool] = mapped_column(Boolean)
    status_code: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(String(64))
    duration_ms: Mapped[int] = mapped_column(Integer)
    response_excerpt: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    next_attempt_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    handed_over_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))  # by the sweeper (a lease)
    superseded: Mapped[bool] = mapped_column(Boolean, default=False, server_default=text("false"))


class VideoContext(Base):
    """What a finished video is about (shared/context): its keyframe embedding, and how the camera and subjects
    move. Written by the worker after the job succeeded; a job without a row simply has no context."""

    __tablename__ = "video_contexts"
    __table_args__ = (
        Index(
            "ix_video_contexts_embedding",
            "embedding",
            postgresql_using="hnsw",
            postgresql_with={"m": 16, "ef_construction": 64},
            postgresql_ops={"embedding": "vector_cosine_ops"},
        ),
        Index("ix_video_contexts_tenant_space", "tenant_id", "space", "created_at"),
        # GET /v1/jobs?motion=<label>: the tenant's videos of one motion in the list's keyset order.
        Index("ix_video_contexts_tenant_motion", "tenant_id", "motion_label", "job_created_at", "job_id"),
    )

    job_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    # The job's tenant, copied (a job never changes tenant): the tenant's videos are searched without a join.
    tenant_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True))
    space: Mapped[str] = mapped_column(String(120))  # embedding.space(): version and model
    embedding: Mapped[Any] = mapped_column(Vector(512))
    keyframes: Mapped[int] = mapped_column(Integer)
    motion_label: Mapped[str] = mapped_column(String(16))
    motion_descriptor: Mapped[list[float]] = mapped_column(ARRAY(Float))
    motion_tokens: Mapped[list[list[float]]] = mapped_column(JSONB)
    job_created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))  # the job's, for the list's order
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class MotionPrototypeSet(Base):
    """One refit of the motion prototypes (shared/context/prototypes.py). Never rewritten."""

    __tablename__ = "motion_prototype_sets"

    version: Mapped[int] = mapped_column(Integer, Identity(), primary_key=True)
    fitted_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    videos: Mapped[int] = mapped_column(Integer)
    params: Mapped[dict[str, Any]] = mapped_column(JSONB)


class MotionPrototype(Base):
    """A global prototype (``class_label`` '') or a variant of one motion class, with its centroid in raw
    descriptor units and its readable label."""

    __tablename__ = "motion_prototypes"

    version: Mapped[int] = mapped_column(
        ForeignKey("motion_prototype_sets.version", ondelete="CASCADE"), primary_key=True
    )
    class_label: Mapped[str] = mapped_column(String(16), primary_key=True)
    index: Mapped[int] = mapped_column(Integer, primary_key=True)
    descriptor: Mapped[list[float]] = mapped_column(ARRAY(Float))
    label: Mapped[str] = mapped_column(String(16))
    members: Mapped[int] = mapped_column(Integer)


class MotionAssignment(Base):
    """A video's global prototype and its variant (within ``variant_class``, its motion label) in one set."""

    __tablename__ = "motion_assignments"
    __table_args__ = (
        Index("ix_motion_assignments_prototype", "version", "prototype", "job_id"),
        Index("ix_motion_assignments_variant", "version", "variant_class", "variant", "job_id"),
    )

    job_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    version: Mapped[int] = mapped_column(
        ForeignKey("motion_prototype_sets.version", ondelete="CASCADE"), primary_key=True
    )
    prototype: Mapped[int] = mapped_column(Integer)
    variant_class: Mapped[str] = mapped_column(String(16))
    variant: Mapped[int | None] = mapped_column(Integer)
