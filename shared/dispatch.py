"""Messages that must follow a commit, in one place (invariant 2: enqueued iff committed).

Code that changes a job registers the message in its unit of work (``send_job_after_commit``,
``send_webhook_after_commit``); nothing is sent before the transaction commits, nothing at all when it rolls back.
After the commit each message goes to the broker and its send is recorded (``jobs.enqueued_at``) in a transaction
of its own. Neither step raises: a failed send or a failed record leaves ``enqueued_at`` behind the truth, and the
sweeper re-sends — a duplicate message is dropped by the worker's claim, a lost one would strand the job.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import event, func, update
from sqlalchemy.orm import Session

from shared.celery_app import VidqCelery
from shared.db import session_scope
from shared.models import Job
from shared.queues import TASK_DELIVER_WEBHOOK, TASK_GENERATE, Queue
from shared.states import JobStatus

log = logging.getLogger("vidq.dispatch")

_PENDING = "vidq.after_commit"  # key in Session.info
# kombu's publish retry: bounded, so a dead broker costs the caller ~1 s, never a hang.
_RETRY = {"max_retries": 2, "interval_start": 0.1, "interval_step": 0.3, "interval_max": 0.5}


@dataclass(frozen=True, slots=True)
class Message:
    celery: VidqCelery
    task: str
    job_id: uuid.UUID
    queue: str

    @property
    def records_send(self) -> bool:
        return self.task == TASK_GENERATE  # only video sends are tracked (the sweeper re-sends those)


def send_job_after_commit(session: Session, celery: VidqCelery, job: Job, *, queue: str | None = None) -> None:
    """Send the job to ``queue`` (its own queue by default) once ``session`` commits."""
    _register(session, Message(celery, TASK_GENERATE, job.id, queue or job.queue))


def send_webhook_after_commit(session: Session, celery: VidqCelery, job: Job) -> None:
    """Queue the delivery of a finished job's event once ``session`` commits; nothing when there is nothing to
    deliver (no webhook URL, or the job is not finished)."""
    if job.webhook_url and JobStatus(job.status).is_terminal():
        _register(session, Message(celery, TASK_DELIVER_WEBHOOK, job.id, Queue.WEBHOOKS.value))


def _register(session: Session, message: Message) -> None:
    session.info.setdefault(_PENDING, []).append(message)


@event.listens_for(Session, "after_commit")
def _after_commit(session: Session) -> None:
    pending: list[Message] = session.info.pop(_PENDING, [])
    sent = [m for m in pending if _send(m)]
    _record_sends([m for m in sent if m.records_send])


@event.listens_for(Session, "after_rollback")
def _after_rollback(session: Session) -> None:
    session.info.pop(_PENDING, None)  # the change is gone, so is its message


def _send(message: Message) -> bool:
    ctx: dict[str, Any] = {"job_id": str(message.job_id), "task": message.task, "queue": message.queue}
    try:
        message.celery.send_task(
            message.task, args=[str(message.job_id)], queue=message.queue, retry=True, retry_policy=_RETRY
        )
    except Exception as exc:  # broker down: the sweeper sends it later
        log.warning("send failed; the sweeper will resend", extra={**ctx, "error": repr(exc)})
        return False
    log.info("sent", extra=ctx)
    return True


def _record_sends(messages: list[Message]) -> None:
    """Record the sends (and the queue each went to) in one transaction of its own."""
    if not messages:
        return
    try:
        with session_scope(messages[0].celery.settings) as session:
            for m in messages:
                session.execute(
                    update(Job)
                    .where(Job.id == m.job_id, Job.status == JobStatus.QUEUED.value)
                    .values(enqueued_at=func.now(), queue=m.queue)
                    .execution_options(synchronize_session=False)
                )
    except Exception as exc:  # the message is out; the sweeper's resend is a harmless duplicate
        log.warning("could not record sends", extra={"jobs": [str(m.job_id) for m in messages], "error": repr(exc)})
