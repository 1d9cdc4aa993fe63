"""Messages that must follow a commit, in one place: a job is sent if and only if it is committed
(docs/architecture.md, invariant 2).

Code that changes a job registers the message in its unit of work (``send_job_after_commit``,
``send_webhook_after_commit``); nothing is sent before the transaction commits, nothing at all when it rolls back.
After the commit each message goes to the broker (the API's async submit, which commits without a session, hands
it to a sender thread: ``send_committed``); the sends are then recorded (``jobs.enqueued_at``) off the hot
path, by one background thread per process that writes them in batches (one UPDATE a batch, every few tens of
milliseconds), so a submit costs one transaction. Neither step raises: a failed send or a lost record leaves
``enqueued_at`` behind the truth, and the sweeper re-sends — a duplicate message is a turn of its class with nothing
more to claim (shared/jobs/fairness.py), a lost one would strand the job.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass

from sqlalchemy import event, func, update
from sqlalchemy.orm import Session

from shared.infra.db import session_scope
from shared.jobs.status import JobStatus
from shared.messaging.broker import TaskMessage, publisher
from shared.messaging.celery_app import VidqCelery
from shared.models import Job
from shared.queues import TASK_DELIVER_WEBHOOK, TASK_GENERATE, Queue

log = logging.getLogger("vidq.dispatch")

_PENDING = "vidq.after_commit"  # key in Session.info


@dataclass(frozen=True, slots=True)
class Message:
    celery: VidqCelery
    task: str
    job_id: uuid.UUID
    queue: str
    traceparent: str | None = None  # the job's stored trace (shared/infra/tracing.py): the message continues it

    @property
    def records_send(self) -> bool:
        return self.task == TASK_GENERATE  # only video sends are tracked (the sweeper re-sends those)


def _video(celery: VidqCelery, job: Job) -> Message:
    return Message(celery, TASK_GENERATE, job.id, job.queue, job.traceparent)


def _webhook(celery: VidqCelery, job: Job) -> Message | None:
    """The delivery of a finished job's event; None when there is nothing to deliver (no webhook URL, or the job is
    not finished)."""
    if job.webhook_url and JobStatus(job.status).is_terminal():
        return Message(celery, TASK_DELIVER_WEBHOOK, job.id, Queue.WEBHOOKS.value, job.traceparent)
    return None


def follow_ups(celery: VidqCelery, job: Job) -> list[Message]:
    """What a committed job's state calls for, whoever committed it: a queued job goes to its class's queue; a
    finished one with a webhook URL to the webhook queue; a running one, nothing."""
    if JobStatus(job.status) is JobStatus.QUEUED:
        return [_video(celery, job)]
    webhook = _webhook(celery, job)
    return [] if webhook is None else [webhook]


def send_job_after_commit(session: Session, celery: VidqCelery, job: Job) -> None:
    """Send the job to its class's queue once ``session`` commits (the sweeper's re-sends)."""
    _register(session, _video(celery, job))


def send_webhook_after_commit(session: Session, celery: VidqCelery, job: Job) -> None:
    """Queue the delivery of a finished job's event once ``session`` commits; nothing when there is nothing to
    deliver (no webhook URL, or the job is not finished)."""
    if (webhook := _webhook(celery, job)) is not None:
        _register(session, webhook)


@dataclass(frozen=True, slots=True)
class _StreamNotice:
    """Tell open progress streams (shared/messaging/progress.py) that a job left ``running``: they re-read
    Postgres."""

    celery: VidqCelery
    job_id: uuid.UUID
    status: str


def after_transition_commit(session: Session, celery: VidqCelery, job: Job) -> None:
    """Everything that must follow a transition out of ``running`` once ``session`` commits: its ``follow_ups``
    (the job's next message when it is queued again, its webhook when it finished), and a notice to its open
    progress streams."""
    for message in follow_ups(celery, job):
        _register(session, message)
    status = JobStatus(job.status)
    if status is JobStatus.QUEUED or status.is_terminal():
        session.info.setdefault(_PENDING, []).append(_StreamNotice(celery, job.id, job.status))


def send_committed(celery: VidqCelery, job: Job) -> None:
    """For code that committed a new job without a SQLAlchemy session (the API's async submit): its ``follow_ups``
    (a job created finished, served from the result cache, sends no video message, only its webhook when it has a
    URL). The messages go out from a background thread of this process, so the response never waits on the
    broker. A full backlog (the broker down for long) drops the message: the sweeper sends every job left unsent,
    and every webhook still marked pending (``jobs.webhook_pending_since``)."""
    for message in follow_ups(celery, job):
        _sender(celery).put(message)


def _register(session: Session, message: Message) -> None:
    session.info.setdefault(_PENDING, []).append(message)


@event.listens_for(Session, "after_commit")
def _after_commit(session: Session) -> None:
    pending: list[Message | _StreamNotice] = session.info.pop(_PENDING, [])
    for message in _send([m for m in pending if isinstance(m, Message)]):
        if message.records_send:
            _recorder(message.celery).add(message)
    for notice in pending:
        if isinstance(notice, _StreamNotice):  # best effort, never raises: streams also re-read on their own
            notice.celery.progress.finished(notice.job_id, status=notice.status)


def flush_send_records(celery: VidqCelery) -> None:
    """Write the sends recorded so far now (the sweeper does, so each tick leaves the table up to date)."""
    _recorder(celery).flush()


@event.listens_for(Session, "after_rollback")
def _after_rollback(session: Session) -> None:
    session.info.pop(_PENDING, None)  # the change is gone, so is its message


def _send(messages: list[Message]) -> list[Message]:
    """Publish ``messages`` (one round trip); returns those sent. Never raises: the sweeper resends what failed."""
    if not messages:
        return []
    try:
        publisher(messages[0].celery).publish([TaskMessage(m.task, m.job_id, m.queue, m.traceparent) for m in messages])
    except Exception as exc:  # broker down: the sweeper sends them later
        log.warning(
            "send failed; the sweeper will resend",
            extra={"jobs": [str(m.job_id) for m in messages], "error": repr(exc)},
        )
        return []
    for m in messages:  # one per job: at INFO it would cost the hot path a JSON log line each
        log.debug("sent", extra={"job_id": str(m.job_id), "task": m.task, "queue": m.queue})
    return messages


class _SendRecorder:
    """Collects sent job ids and records them in batches from a daemon thread."""

    BATCH_WAIT_S = 0.05
    MAX_BATCH = 500

    def __init__(self, celery: VidqCelery) -> None:
        self._celery = celery
        self._queue: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._lock = threading.Lock()  # one writer at a time (the thread, or a caller's flush)
        threading.Thread(target=self._run, name="vidq-send-records", daemon=True).start()

    def add(self, message: Message) -> None:
        self._queue.put(message)

    def flush(self) -> None:
        with self._lock:
            _record_sends(self._drain(), celery=self._celery)

    def _drain(self) -> list[Message]:
        batch: list[Message] = []
        while len(batch) < self.MAX_BATCH:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return batch

    def _run(self) -> None:
        while True:
            first = self._queue.get()  # blocks until there is something to record
            time.sleep(self.BATCH_WAIT_S)  # let a burst gather into one UPDATE
            with self._lock:
                _record_sends([first, *self._drain()], celery=self._celery)


class _Sender:
    """Sends committed messages from a daemon thread, then hands them to the recorder."""

    MAX_BACKLOG = 10_000
    MAX_BATCH = 200

    def __init__(self, celery: VidqCelery) -> None:
        self._queue: queue.Queue[Message] = queue.Queue(maxsize=self.MAX_BACKLOG)
        threading.Thread(target=self._run, name="vidq-sender", daemon=True).start()

    def put(self, message: Message) -> None:
        try:
            self._queue.put_nowait(message)
        except queue.Full:
            log.warning("send backlog full; the sweeper will send this job", extra={"job_id": str(message.job_id)})

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]  # blocks until there is something to send
            while len(batch) < self.MAX_BATCH:  # and takes whatever else is waiting: one round trip for all
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            for message in _send(batch):
                if message.records_send:
                    _recorder(message.celery).add(message)


def _sender(celery: VidqCelery) -> _Sender:
    return celery.resource("sender", lambda: _Sender(celery))


def _recorder(celery: VidqCelery) -> _SendRecorder:
    return celery.resource("send-recorder", lambda: _SendRecorder(celery))


def _record_sends(messages: list[Message], *, celery: VidqCelery) -> None:
    """Record the sends: one UPDATE for the batch."""
    if not messages:
        return
    try:
        with session_scope(celery.settings) as session:
            session.execute(
                update(Job)
                .where(Job.id.in_([m.job_id for m in messages]), Job.status == JobStatus.QUEUED.value)
                .values(enqueued_at=func.now())
                .execution_options(synchronize_session=False)
            )
    except Exception as exc:  # the messages are out; the sweeper's resend is a harmless duplicate
        log.warning("could not record sends", extra={"jobs": [str(m.job_id) for m in messages], "error": repr(exc)})
