"""The job state machine: every status change goes through this module.

Each transition is one conditional ``UPDATE … WHERE status IN (allowed sources) [AND attempt = token] RETURNING``,
so two processes can never both win, and a worker whose fencing token is stale changes nothing. Each successful
transition writes a ``job_transitions`` row (same transaction) and a structured log line. Helpers only flush; the
caller's ``session_scope`` commits.

    queued ──claim──▶ running ──▶ succeeded | failed | cancelled
      │                  └──lease expired / transient error──▶ queued   (attempt is bumped by the next claim)
      └──cancel / max attempts──▶ cancelled | failed

A job served from the result cache is inserted ``succeeded`` (the API's submit): it never runs, and its
audit row is the one transition ``NULL → succeeded``, reason ``RESULT_CACHE``, written with ``audit``.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, case, func, select, update
from sqlalchemy.orm import Session

from shared.errors import InvalidTransition
from shared.jobs import repository
from shared.jobs.status import ALLOWED, JobStatus
from shared.models import Job

log = logging.getLogger("vidq.states")


def _sources(dst: JobStatus) -> list[str]:
    return [s.value for s, targets in ALLOWED.items() if dst in targets]


# The reason recorded for a job born succeeded: it reuses the video of an identical succeeded job.
RESULT_CACHE = "result_cache"


def audit(*, job_id: uuid.UUID, src: str | None, dst: JobStatus, attempt: int, reason: str) -> dict[str, Any]:
    """One ``job_transitions`` row (the parameters of ``repository.INSERT_TRANSITION``), logged as it is made: for
    both writers of the audit log, this module's transitions and the API's async insert of a job served from the
    result cache."""
    row = {"job_id": job_id, "from_status": src, "to_status": dst.value, "attempt": attempt, "reason": reason[:200]}
    log.info(
        "job transition",
        extra={"job_id": str(job_id), "from": src, "to": dst.value, "attempt": attempt, "reason": row["reason"]},
    )
    return row


def _finished(**values: Any) -> dict[str, Any]:
    """The values of every transition into a terminal status. ``webhook_pending_since`` marks a job whose event
    is still to be delivered, in the very UPDATE that finishes it; the webhook task clears it with its first
    attempt on record, and the sweeper re-sends through the partial index on it (ix_jobs_webhook_pending)."""
    return {
        **values,
        "finished_at": func.now(),
        "lease_expires_at": None,
        "webhook_pending_since": case((Job.webhook_url.is_not(None), func.now()), else_=None),
    }


def served_from_cache(*, now: datetime, webhook_url: str | None) -> dict[str, Any]:
    """The state of a job inserted ``succeeded`` because it reuses a stored result: what a finishing transition
    leaves (``_finished``), at ``now`` (the inserting transaction's clock, as its ``created_at``): never leased nor
    claimed (attempt 0), and marked for its webhook the same way, so the sweeper hands it over if the send is lost."""
    return {
        "status": JobStatus.SUCCEEDED.value,
        "attempt": 0,
        "started_at": now,
        "finished_at": now,
        "lease_expires_at": None,
        "webhook_pending_since": now if webhook_url is not None else None,
    }


def _transition(
    session: Session,
    job_id: uuid.UUID,
    dst: JobStatus,
    *,
    sources: list[str],
    token: int | None = None,
    reason: str,
    values: dict[str, Any] | None = None,
    extra_where: Any = None,
) -> Job | None:
    """Apply one conditional transition; returns the updated row, or None when the condition did not hold."""
    allowed = [s for s in sources if s in _sources(dst)]
    src_status = select(Job.status).where(Job.id == job_id).scalar_subquery()
    conds = [Job.id == job_id, Job.status.in_(allowed)]
    if token is not None:
        conds.append(Job.attempt == token)
    if extra_where is not None:
        conds.append(extra_where)
    stmt = (
        update(Job)
        .where(and_(*conds))
        .values(status=dst.value, **(values or {}))
        .returning(Job)
        # populate_existing: a row already in the session (e.g. loaded FOR UPDATE) gets the new values.
        .execution_options(synchronize_session=False, populate_existing=True)
    )
    # The source status is read in the same statement snapshot, for the audit row.
    src = session.execute(select(src_status)).scalar()
    job = session.execute(stmt).scalar_one_or_none()
    if job is None:
        return None
    session.execute(
        repository.INSERT_TRANSITION, audit(job_id=job_id, src=src, dst=dst, attempt=job.attempt, reason=reason)
    )
    session.flush()
    return job


# --- worker side --------------------------------------------------------------------------------------------


def claim(session: Session, job_id: uuid.UUID, *, worker_id: str, lease_s: float) -> Job | None:
    """queued → running. Returns the job with its new ``attempt`` (the fencing token), or None if not claimable."""
    return _transition(
        session,
        job_id,
        JobStatus.RUNNING,
        sources=[JobStatus.QUEUED.value],
        reason=f"claimed by {worker_id}",
        values={
            "attempt": Job.attempt + 1,
            "worker_id": worker_id,
            "lease_expires_at": func.now() + timedelta(seconds=lease_s),
            "started_at": func.coalesce(Job.started_at, func.now()),
            "progress_step": 0,
        },
        extra_where=and_(Job.cancel_requested.is_(False), Job.attempt < Job.max_attempts),
    )


@dataclass(frozen=True)
class LeaseState:
    owned: bool
    cancel_requested: bool


def renew_lease(
    session: Session,
    job_id: uuid.UUID,
    *,
    token: int,
    lease_s: float,
    progress: tuple[int, int] | None = None,
) -> LeaseState:
    """Heartbeat: extend the lease (and record progress) while this attempt still owns the job."""
    values: dict[str, Any] = {"lease_expires_at": func.now() + timedelta(seconds=lease_s)}
    if progress is not None:
        values["progress_step"], values["progress_total"] = progress
    row = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status == JobStatus.RUNNING.value, Job.attempt == token)
        .values(**values)
        .returning(Job.cancel_requested)
        .execution_options(synchronize_session=False)
    ).first()
    if row is None:
        return LeaseState(owned=False, cancel_requested=False)
    return LeaseState(owned=True, cancel_requested=bool(row[0]))


def succeed(session: Session, job_id: uuid.UUID, *, token: int, output: dict[str, Any]) -> Job | None:
    return _transition(
        session,
        job_id,
        JobStatus.SUCCEEDED,
        sources=[JobStatus.RUNNING.value],
        token=token,
        reason="rendered",
        values=_finished(**output),
    )


def fail(session: Session, job_id: uuid.UUID, *, token: int | None, code: str, message: str) -> Job | None:
    sources = [JobStatus.RUNNING.value] if token is not None else [JobStatus.QUEUED.value, "running"]
    return _transition(
        session,
        job_id,
        JobStatus.FAILED,
        sources=sources,
        token=token,
        reason=code,
        values=_finished(error_code=code, error_message=message[:2000]),
    )


def cancelled_by_worker(session: Session, job_id: uuid.UUID, *, token: int) -> Job | None:
    return _transition(
        session,
        job_id,
        JobStatus.CANCELLED,
        sources=[JobStatus.RUNNING.value],
        token=token,
        reason="stopped at a denoising step",
        values=_finished(),
    )


def release_for_retry(session: Session, job_id: uuid.UUID, *, token: int, reason: str) -> Job | None:
    """running → queued after a transient failure or a warm shutdown; the next claim bumps the attempt."""
    return _transition(
        session,
        job_id,
        JobStatus.QUEUED,
        sources=[JobStatus.RUNNING.value],
        token=token,
        reason=reason,
        values={"worker_id": None, "lease_expires_at": None, "enqueued_at": None},
        extra_where=Job.attempt < Job.max_attempts,
    )


# --- API side -----------------------------------------------------------------------------------------------


def request_cancel(session: Session, job_id: uuid.UUID, *, tenant_id: uuid.UUID) -> Job:
    """A queued job is cancelled at once (it will never run); a running one is flagged and the worker stops it
    at the next denoising step. A finished job cannot be cancelled (409)."""
    job = repository.get(session, tenant_id=tenant_id, job_id=job_id, for_update=True)
    status = JobStatus(job.status)
    if status is JobStatus.QUEUED:
        done = _transition(
            session,
            job_id,
            JobStatus.CANCELLED,
            sources=[JobStatus.QUEUED.value],
            reason="cancelled while queued",
            values=_finished(cancel_requested=True),
        )
        assert done is not None  # the row is locked FOR UPDATE
        return done
    if status is JobStatus.RUNNING:
        job.cancel_requested = True
        session.flush()
        log.info("cancel requested", extra={"job_id": str(job_id), "attempt": job.attempt})
        return job
    raise InvalidTransition(f"job is already {status.value}", details={"status": status.value})


# --- sweeper side -------------------------------------------------------------------------------------------


def recover_expired(session: Session, job: Job) -> Job | None:
    """A running job whose worker stopped heartbeating: back to queued, or failed once attempts are spent."""
    if job.attempt >= job.max_attempts:
        return _transition(
            session,
            job.id,
            JobStatus.FAILED,
            sources=[JobStatus.RUNNING.value],
            token=job.attempt,
            reason="lease expired; max attempts reached",
            values=_finished(
                error_code="max_attempts_exceeded",
                error_message=f"worker lost {job.attempt} time(s); giving up",
            ),
        )
    if job.cancel_requested:
        return _transition(
            session,
            job.id,
            JobStatus.CANCELLED,
            sources=[JobStatus.RUNNING.value],
            token=job.attempt,
            reason="lease expired after cancel",
            values=_finished(),
        )
    return _transition(
        session,
        job.id,
        JobStatus.QUEUED,
        sources=[JobStatus.RUNNING.value],
        token=job.attempt,
        reason="lease expired",
        values={"worker_id": None, "lease_expires_at": None, "enqueued_at": None},
    )
