"""Sending a job id to its queue. Always called after the job row is committed (enqueued iff committed); a failed
send is not an error for the caller: the sweeper re-sends jobs whose ``enqueued_at`` is still empty."""

from __future__ import annotations

import logging
import uuid

from celery import Celery
from sqlalchemy import func, update
from sqlalchemy.orm import Session

from shared.config import Settings
from shared.db import session_scope
from shared.models import Job
from shared.queues import TASK_DELIVER_WEBHOOK, TASK_GENERATE, Queue

log = logging.getLogger("vidq.dispatch")

# kombu's publish retry: bounded, so a dead broker costs the caller ~1 s, never a hang.
_RETRY = {"max_retries": 2, "interval_start": 0.1, "interval_step": 0.3, "interval_max": 0.5}


def _send(celery: Celery, task: str, *, job_id: uuid.UUID, queue: str) -> bool:
    try:
        celery.send_task(task, args=[str(job_id)], queue=queue, retry=True, retry_policy=_RETRY)
    except Exception as exc:  # broker down: the sweeper sends it later
        log.warning(
            "send failed; the sweeper will resend", extra={"job_id": str(job_id), "task": task, "error": repr(exc)}
        )
        return False
    log.info("sent", extra={"job_id": str(job_id), "task": task, "queue": queue})
    return True


def send_job(celery: Celery, *, job_id: uuid.UUID, queue: str) -> bool:
    return _send(celery, TASK_GENERATE, job_id=job_id, queue=queue)


def mark_enqueued(session: Session, *, job_id: uuid.UUID, queue: str) -> None:
    session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status == "queued")
        .values(enqueued_at=func.now(), queue=queue)
        .execution_options(synchronize_session=False)
    )


def enqueue(celery: Celery, settings: Settings, *, job_id: uuid.UUID, queue: str) -> bool:
    """Send the job id, then record the send (its own commit). Call only once the job row is committed."""
    if not send_job(celery, job_id=job_id, queue=queue):
        return False
    with session_scope(settings) as session:
        mark_enqueued(session, job_id=job_id, queue=queue)
    return True


def send_webhook(celery: Celery, *, job_id: uuid.UUID) -> bool:
    """Queue the delivery of a finished job's event (the event type follows from its terminal status)."""
    return _send(celery, TASK_DELIVER_WEBHOOK, job_id=job_id, queue=Queue.WEBHOOKS.value)
