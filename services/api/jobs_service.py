"""Submitting and reading jobs: the API's logic, kept out of the route functions."""

from __future__ import annotations

import base64
import uuid
from datetime import UTC, datetime, timedelta

from sqlalchemy import func, select, tuple_
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from services.api.deps import Caller
from shared.config import Settings
from shared.errors import Conflict, IdempotencyKeyReused, InvalidRequest, NotFound
from shared.models import IdempotencyKey, Job
from shared.schemas import JobCreate
from shared.scoring import score_job
from shared.spec import GenerationSpec
from shared.states import JobStatus


def create_job(
    session: Session, settings: Settings, *, tenant: Caller, body: JobCreate, spec: GenerationSpec | None = None
) -> Job:
    """Insert the job row (flush only; the caller registers the send and commits)."""
    spec = spec or body.to_spec(settings)
    score = score_job(settings, prompt=spec.prompt, width=spec.width, height=spec.height, duration_s=body.duration_s)
    job = Job(
        id=uuid.uuid4(),
        tenant_id=tenant.id,
        status=JobStatus.QUEUED.value,
        spec=spec.to_dict(),
        duration_s=body.duration_s,
        webhook_url=body.webhook_url,
        metadata_=body.metadata,
        score=score.value,
        score_complexity=score.complexity,
        score_resolution=score.resolution,
        score_duration=score.duration,
        priority_class=score.priority_class.value,
        queue=score.priority_class.queue.value,
        attempt=0,
        max_attempts=settings.max_attempts,
        timings={},
    )
    session.add(job)
    session.flush()
    return job


def submit(
    session: Session,
    settings: Settings,
    *,
    tenant: Caller,
    body: JobCreate,
    idempotency_key: str | None,
) -> tuple[Job, bool]:
    """Returns (job, created). With an Idempotency-Key, the same key and body return the first job; the same key
    with another body is refused. The key row and the job row commit together."""
    spec = body.to_spec(settings)  # a body over the caps is refused before anything is looked up or written
    if idempotency_key is None:
        return create_job(session, settings, tenant=tenant, body=body, spec=spec), True
    if not 1 <= len(idempotency_key) <= 200:
        raise InvalidRequest("Idempotency-Key must be 1..200 characters")
    fingerprint = body.fingerprint()
    existing = _live_key(session, tenant_id=tenant.id, key=idempotency_key)
    if existing is None:
        job = create_job(session, settings, tenant=tenant, body=body, spec=spec)
        key_row = pg_insert(IdempotencyKey).values(
            tenant_id=tenant.id,
            key=idempotency_key,
            request_hash=fingerprint,
            job_id=job.id,
            expires_at=datetime.now(UTC) + timedelta(seconds=settings.idempotency_ttl_s),
        )
        # An expired key the sweeper has not deleted yet behaves as a new key: it is taken over.
        inserted = session.execute(
            key_row.on_conflict_do_update(
                index_elements=[IdempotencyKey.tenant_id, IdempotencyKey.key],
                set_={
                    "request_hash": key_row.excluded.request_hash,
                    "job_id": key_row.excluded.job_id,
                    "expires_at": key_row.excluded.expires_at,
                    "created_at": func.now(),
                },
                where=IdempotencyKey.expires_at <= func.now(),
            ).returning(IdempotencyKey.key)
        ).first()
        if inserted is not None:
            return job, True
        # A concurrent request with the same key won the race: drop ours, answer with theirs.
        session.delete(job)
        session.flush()
        existing = _live_key(session, tenant_id=tenant.id, key=idempotency_key)
        if existing is None:  # theirs expired in the same instant: let the client retry
            raise Conflict("this Idempotency-Key is being reused concurrently; retry the request")
    if existing.request_hash != fingerprint:
        raise IdempotencyKeyReused(
            "this Idempotency-Key was used with a different request body",
            details={"job_id": str(existing.job_id)},
        )
    return get_job(session, tenant_id=tenant.id, job_id=existing.job_id), False


def _live_key(session: Session, *, tenant_id: uuid.UUID, key: str) -> IdempotencyKey | None:
    return session.execute(
        select(IdempotencyKey).where(
            IdempotencyKey.tenant_id == tenant_id,
            IdempotencyKey.key == key,
            IdempotencyKey.expires_at > datetime.now(UTC),
        )
    ).scalar_one_or_none()


def get_job(session: Session, *, tenant_id: uuid.UUID, job_id: uuid.UUID) -> Job:
    # Another tenant's id is indistinguishable from a missing one (404, never 403).
    job = session.execute(select(Job).where(Job.id == job_id, Job.tenant_id == tenant_id)).scalar_one_or_none()
    if job is None:
        raise NotFound("job not found")
    return job


def encode_cursor(job: Job) -> str:
    return base64.urlsafe_b64encode(f"{job.created_at.isoformat()}|{job.id}".encode()).decode()


def decode_cursor(cursor: str) -> tuple[datetime, uuid.UUID]:
    try:
        ts, _, jid = base64.urlsafe_b64decode(cursor.encode()).decode().partition("|")
        return datetime.fromisoformat(ts), uuid.UUID(jid)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest("invalid cursor") from exc


def list_jobs(
    session: Session,
    *,
    tenant_id: uuid.UUID,
    status: JobStatus | None,
    limit: int,
    cursor: str | None,
) -> tuple[list[Job], str | None]:
    """Newest first; keyset pagination on (created_at, id) so pages stay stable while jobs are added. The cursor is
    a row comparison, which Postgres turns into the start of a range scan of ix_jobs_tenant_newest (or
    ix_jobs_tenant_status_newest) read in the ORDER BY's own direction: a page at any depth reads ``limit + 1``
    entries. The equivalent ``created_at < ts OR (created_at = ts AND id < jid)`` is only a filter, so the scan
    began at the newest job and read through every row above the cursor."""
    stmt = select(Job).where(Job.tenant_id == tenant_id)
    if status is not None:
        stmt = stmt.where(Job.status == status.value)
    if cursor is not None:
        ts, jid = decode_cursor(cursor)
        stmt = stmt.where(tuple_(Job.created_at, Job.id) < tuple_(ts, jid))
    rows = list(session.execute(stmt.order_by(Job.created_at.desc(), Job.id.desc()).limit(limit + 1)).scalars())
    next_cursor = encode_cursor(rows[limit - 1]) if len(rows) > limit else None
    return rows[:limit], next_cursor
