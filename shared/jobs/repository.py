"""Every query on the jobs aggregate (``jobs``, its audit log ``job_transitions`` and the submit's
``idempotency_keys``), written once for both of vidq's drivers.

- The API's hot paths (submit, read, list) run on psycopg's async pool: services/api/store.py compiles the
  statements below once at import and executes them.
- Everything else (cancel, delete, the sweeper) runs in a SQLAlchemy session and calls the functions below.

The rules live here alone: which jobs a tenant sees (``visible``: its own, not deleted), how an audit row is
written (``INSERT_TRANSITION``), and the sweeper's queries, each of which reads one partial index of
shared/models.py that holds only the rows it may act on and stops at ``limit``, so a sweep with nothing due costs a
few index probes whatever the size of ``jobs``. Status changes themselves are the state machine's
(shared/jobs/states.py).
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Insert,
    Integer,
    Select,
    String,
    and_,
    bindparam,
    delete,
    func,
    insert,
    literal,
    literal_column,
    select,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from shared.errors import NotFound
from shared.jobs.status import JobStatus
from shared.models import IdempotencyKey, Job, JobTransition, Tenant
from shared.queues import PriorityClass

# --- which jobs a tenant sees ----------------------------------------------------------------------------------

# A deleted job (DELETE /v1/videos/{id}, jobs.deleted_at) is gone for its tenant: no read, list or change finds it.
LIVE = Job.deleted_at.is_(None)


def visible(tenant_id: Any, job_id: Any) -> ColumnElement[bool]:
    """The tenant's job, not deleted. Another tenant's id matches nothing, as a missing one does (404, never 403)."""
    return and_(Job.id == job_id, Job.tenant_id == tenant_id, LIVE)


def has_status(status: JobStatus) -> ColumnElement[bool]:
    """``status = '<value>'`` with the value written into the SQL, not bound: a partial index (``WHERE status =
    'queued'``) is usable only when the planner can prove its predicate from the query's constants, and psycopg
    prepares a statement run five times, whose generic plan knows no parameter values."""
    return Job.status == literal(status.value, literal_execute=True)


def get(session: Session, *, tenant_id: uuid.UUID, job_id: uuid.UUID, for_update: bool = False) -> Job:
    """The tenant's job, or NotFound (404)."""
    query = select(Job).where(visible(tenant_id, job_id))
    job = session.execute(query.with_for_update() if for_update else query).scalar_one_or_none()
    if job is None:
        raise NotFound("job not found")
    return job


def soft_delete(session: Session, *, tenant_id: uuid.UUID, job_id: uuid.UUID) -> bool:
    """Mark the job deleted; False when it is not there (another tenant's, or deleted by a concurrent request)."""
    deleted = session.execute(
        update(Job)
        .where(visible(tenant_id, job_id))
        .values(deleted_at=func.now())
        .returning(Job.id)
        .execution_options(synchronize_session=False)
    ).first()
    return deleted is not None


# --- the API's async statements (bind parameters by name; services/api/store.py executes them) ------------------

GET_JOB = select(Job.__table__).where(visible(bindparam("tenant_id"), bindparam("id")))
# Where a list page continues after a given job (GET /v1/videos?after=<id>): its place in the keyset order, deleted
# or not (a client may delete the last video of the page it is reading).
POSITION = select(Job.created_at, Job.id).where(Job.id == bindparam("id"), Job.tenant_id == bindparam("tenant_id"))

# What a job served from the result cache takes over from the job whose render it reuses: the stored objects and
# what is known of them. The objects are the same (no copy); result_of names their owner.
RESULT_COLUMNS = ("output_key", "poster_key", "output_bytes", "output_sha256", "output_frames")
# The tenant's newest succeeded job with this result key (ix_jobs_result_cache, one entry read). The job that
# rendered it: a match that was itself served from the cache points at its source (no chains of result_of). The
# status is a literal, so a prepared statement's generic plan can still prove the partial index's predicate; now()
# is the transaction's clock, the one the new row's created_at gets.
RESULT_SOURCE = (
    select(
        func.coalesce(Job.result_of, Job.id),
        *(Job.__table__.c[name] for name in RESULT_COLUMNS),
        func.now(),
    )
    .where(
        Job.tenant_id == bindparam("tenant_id"),
        Job.result_key == bindparam("result_key"),
        Job.status == literal_column(f"'{JobStatus.SUCCEEDED.value}'"),
        LIVE,  # a deleted video is not offered again
    )
    .order_by(Job.created_at.desc())
    .limit(literal_column("1"))
)


def page(*, status: JobStatus | None, after: bool, ascending: bool = False) -> Select[Any]:
    """One list page: newest first (or oldest first); keyset pagination on (created_at, id). The cursor is a row
    comparison, which Postgres turns into the start of a range scan of ix_jobs_tenant_newest (or
    ix_jobs_tenant_status_newest) read in the ORDER BY's direction (backwards for oldest first): a page at any depth
    reads ``limit + 1`` entries, plus any deleted jobs among them. The status is written into the SQL as a literal
    so that a prepared statement's generic plan still picks the status index (see ``has_status``)."""
    stmt = select(Job.__table__).where(Job.tenant_id == bindparam("tenant_id"), LIVE)
    if status is not None:
        stmt = stmt.where(Job.status == literal_column(f"'{status.value}'"))  # an enum value: safe to inline
    key, cursor = tuple_(Job.created_at, Job.id), tuple_(bindparam("ts"), bindparam("jid"))
    if after:
        stmt = stmt.where(key > cursor if ascending else key < cursor)
    if ascending:
        stmt = stmt.order_by(Job.created_at.asc(), Job.id.asc())
    else:
        stmt = stmt.order_by(Job.created_at.desc(), Job.id.desc())
    return stmt.limit(bindparam("limit"))


# The audit log: one row per state change, from either driver (the row: shared/jobs/states.py ``audit``).
INSERT_TRANSITION: Insert = insert(JobTransition).values(
    {c: bindparam(c) for c in ("job_id", "from_status", "to_status", "attempt", "reason")}
)

# --- idempotency keys --------------------------------------------------------------------------------------------


# The work the ETA quotes count (services/api/jobs/estimates.py): the oldest queued jobs (ix_jobs_queued_fair; the
# admission watermark bounds how many a class holds), each with its tenant's name (fair-share weights are by name),
# and every running job (ix_jobs_running: as many as there are GPUs).
# Each job's shape and steps are read out of its spec by Postgres (the API never parses a whole spec for this).
def _spec_text(name: str) -> ColumnElement[str]:
    """``spec ->> 'name'``, the key written into the statement (the async store compiles it with no parameters)."""
    return Job.spec.op("->>", return_type=String)(literal_column(f"'{name}'"))


_SHAPE = (
    _spec_text("model"),
    *(_spec_text(name).cast(Integer) for name in ("num_frames", "height", "width", "steps")),
)
QUEUED_WORK = (
    select(Job.priority_class, Job.tenant_id, Tenant.name, Job.created_at, *_SHAPE)
    .join(Tenant, Tenant.id == Job.tenant_id)
    .where(Job.status == bindparam("status"))
    .order_by(Job.created_at, Job.id)
    .limit(bindparam("limit"))
)
# How many jobs each class holds queued (an index-only count of ix_jobs_queued_fair): what QUEUED_WORK's limit left
# unread is counted from it.
QUEUED_COUNTS = (
    select(Job.priority_class, func.count()).where(Job.status == bindparam("status")).group_by(Job.priority_class)
)
RUNNING_WORK = select(Job.progress_step, *_SHAPE).where(Job.status == bindparam("status"))

LIVE_KEY = select(IdempotencyKey.request_hash, IdempotencyKey.job_id).where(
    IdempotencyKey.tenant_id == bindparam("tenant_id"),
    IdempotencyKey.key == bindparam("key"),
    IdempotencyKey.expires_at > func.now(),
)
_key_row = pg_insert(IdempotencyKey)
# An expired key the sweeper has not deleted yet behaves as a new key: it is taken over.
CLAIM_KEY = _key_row.on_conflict_do_update(
    index_elements=[IdempotencyKey.tenant_id, IdempotencyKey.key],
    set_={
        "request_hash": _key_row.excluded.request_hash,
        "job_id": _key_row.excluded.job_id,
        "expires_at": _key_row.excluded.expires_at,
        "created_at": func.now(),
    },
    where=IdempotencyKey.expires_at <= func.now(),
).returning(IdempotencyKey.key)


def expire_keys(session: Session, *, now: datetime, limit: int) -> int:
    """Delete up to ``limit`` expired idempotency keys (ix_idempotency_keys_expires_at, then the primary key)."""
    batch = (
        select(IdempotencyKey.tenant_id, IdempotencyKey.key)
        .where(IdempotencyKey.expires_at < now)
        .order_by(IdempotencyKey.expires_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    result = session.execute(
        delete(IdempotencyKey).where(tuple_(IdempotencyKey.tenant_id, IdempotencyKey.key).in_(batch))
    )
    return int(getattr(result, "rowcount", 0) or 0)


# --- the sweeper's queries ---------------------------------------------------------------------------------------


def expired_leases(session: Session, *, now: datetime, limit: int) -> list[Job]:
    """Running jobs whose worker stopped heartbeating (ix_jobs_running: the running set, as large as the fleet)."""
    return list(
        session.execute(
            select(Job)
            .where(has_status(JobStatus.RUNNING), Job.lease_expires_at < now)
            .order_by(Job.lease_expires_at)
            .limit(limit)
            .with_for_update(skip_locked=True)
        ).scalars()
    )


def unsent_or_lost(session: Session, *, now: datetime, grace_s: float, resend_s: float, limit: int) -> list[Job]:
    """Queued jobs never sent (crash between commit and send) or sent long ago and never claimed. Two queries, not
    one with an OR: each is a range scan of its own partial index in that index's order, so LIMIT stops it."""
    queued = has_status(JobStatus.QUEUED)
    unsent = session.execute(
        select(Job)
        .where(queued, Job.enqueued_at.is_(None), Job.created_at < now - timedelta(seconds=grace_s))
        .order_by(Job.created_at)  # ix_jobs_queued_unsent
        .limit(limit)
        .with_for_update(skip_locked=True)
    ).scalars()
    jobs = list(unsent)
    if len(jobs) < limit:
        lost = session.execute(
            select(Job)
            .where(queued, Job.enqueued_at < now - timedelta(seconds=resend_s))
            .order_by(Job.enqueued_at)  # ix_jobs_queued_sent
            .limit(limit - len(jobs))
            .with_for_update(skip_locked=True)
        ).scalars()
        jobs.extend(lost)
    return jobs


def promotion_due(session: Session, *, now: datetime, after_s: float, limit: int) -> list[Job]:
    """Queued below the high class since its last send for ``after_s``, longest waiting first
    (ix_jobs_queued_agable). The class is a literal so that the partial index's predicate is provable even in a
    prepared statement's generic plan."""
    return list(
        session.execute(
            select(Job)
            .where(
                has_status(JobStatus.QUEUED),
                Job.priority_class != literal(PriorityClass.HIGH.value, literal_execute=True),
                Job.enqueued_at < now - timedelta(seconds=after_s),
            )
            .order_by(Job.enqueued_at)
            .limit(limit)
            .with_for_update(skip_locked=True)
        ).scalars()
    )


def promote(session: Session, job: Job) -> None:
    """Move a queued job (locked by ``promotion_due``) one class up. Its send to the new class's queue is owed
    from now (``enqueued_at`` cleared): the send after the commit stamps it, and if that send is lost the sweeper's
    never-sent query finds the job again."""
    job.priority_class = PriorityClass(job.priority_class).promoted().value
    job.enqueued_at = None
    session.flush()


def webhooks_due(session: Session, *, now: datetime, grace_s: float, limit: int) -> list[Job]:
    """Finished with a webhook URL ``grace_s`` ago and no delivery attempt on record yet, oldest first: the mark
    set by the finishing transition and cleared by the first attempt (ix_jobs_webhook_pending)."""
    return list(
        session.execute(
            select(Job)
            .where(Job.webhook_pending_since < now - timedelta(seconds=grace_s))
            .order_by(Job.webhook_pending_since)
            .limit(limit)
            .with_for_update(skip_locked=True)
        ).scalars()
    )


def clear_webhook_pending(session: Session, job_ids: list[uuid.UUID]) -> None:
    """No webhook will be handed over for these jobs any more: an attempt is on record, or the sweeper gave up."""
    session.execute(
        update(Job)
        .where(Job.id.in_(job_ids), Job.webhook_pending_since.is_not(None))
        .values(webhook_pending_since=None)
        .execution_options(synchronize_session=False)
    )
