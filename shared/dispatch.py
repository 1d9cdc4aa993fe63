"""Sending a job id to its queue. Always called after the job row is committed (enqueued iff committed); a failed
send is not an error for the caller: the sweeper re-sends jobs whose ``enqueued_at`` is still empty."""

from __future__ import annotations

import logging
import uuid

from celery import Celery
from sqlalchemy import func, update
from sqlalchemy.orm import Session

from shared.models import Job
from shared.queues import TASK_DELIVER_WEBHOOK, TASK_GENERATE, Queue

log = logging.getLogger("vidq.dispatch")

# kombu's publish retry: bounded, so a dead broker costs the caller ~1 s, never a hang.
_RETRY = {"max_retries": 2, "interval_start": 0.1, "interval_step": 0.3, "interval_max": 0.5}


def send_job(celery: Celery, *, job_id: uuid.UUID, queue: str) -> bool:
    try:
        celery.send_task(TASK_GENERATE, args=[str(job_id)], queue=queue, retry=True, retry_policy=_RETRY)
    except Exception as exc:  # broker down: the sweeper will send it
        log.warning("send failed; sweeper will resend", extra={"job_id": str(job_id), "error": repr(exc)})
        return False
    log.info("job sent", extra={"job_id": str(job_id), "queue": queue})
    return True


def mark_enqueued(session: Session, *, job_id: uuid.UUID, queue: str) -> None:
    session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status == "queued")
        .values(enqueued_at=func.now(), queue=queue)
        .execution_options(synchronize_session=False)
    )


def send_webhook(celery: Celery, *, job_id: uuid.UUID) -> bool:
    """Queue the delivery of a finished job's event (the event type follows from its terminal status)."""
    try:
        celery.send_task(
            TASK_DELIVER_WEBHOOK,
            args=[str(job_id)],
            queue=Queue.WEBHOOKS.value,
            retry=True,
            retry_policy=_RETRY,
        )
    except Exception as exc:  # the sweeper re-sends deliveries that never started
        log.warning("webhook send failed", extra={"job_id": str(job_id), "error": repr(exc)})
        return False
    return True
