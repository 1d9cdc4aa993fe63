"""shared/messaging/dispatch.py's rule: a message registered in a unit of work is sent only if its transaction
committed, and only after the commit. No services: a SQLite database file holds the unit of work's change, and a
fake Celery app hands dispatch a publisher that records each send together with what another connection sees
committed at that moment."""

from __future__ import annotations

import contextlib
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import Session

from shared.messaging.broker import TaskMessage
from shared.messaging.celery_app import VidqCelery
from shared.messaging.dispatch import Message, send_job_after_commit, send_webhook_after_commit
from shared.models import Job
from shared.queues import TASK_DELIVER_WEBHOOK, TASK_GENERATE, PriorityClass, Queue


class RecordingPublisher:
    """Stands in for shared.messaging.broker.Publisher: records each batch, and the changes committed when it was
    sent."""

    def __init__(self, database: Path) -> None:
        self.database = database
        self.sends: list[tuple[list[TaskMessage], set[str]]] = []

    def committed(self) -> set[str]:
        # Another connection sees only what committed: a send made before the commit would not find its change.
        with contextlib.closing(sqlite3.connect(self.database)) as conn:
            return {row[0] for row in conn.execute("SELECT job_id FROM changes")}

    def publish(self, messages: list[TaskMessage]) -> None:
        self.sends.append((list(messages), self.committed()))


class RecordingRecorder:
    """Stands in for dispatch's send recorder (which writes jobs.enqueued_at to Postgres from a thread)."""

    def __init__(self) -> None:
        self.recorded: list[uuid.UUID] = []

    def add(self, message: Message) -> None:
        self.recorded.append(message.job_id)


class FakeCelery:
    """What dispatch asks of a VidqCelery here: its per-process resources, the publisher and the send recorder."""

    def __init__(self, publisher: RecordingPublisher, recorder: RecordingRecorder) -> None:
        self._resources: dict[str, Any] = {"publisher": publisher, "send-recorder": recorder}

    def resource(self, name: str, factory: Any) -> Any:
        return self._resources[name]  # a KeyError would mean dispatch reached for something real


@pytest.fixture
def database(tmp_path: Path) -> Path:
    return tmp_path / "dispatch.sqlite"


@pytest.fixture
def engine(database: Path) -> Iterator[Engine]:
    engine = create_engine(f"sqlite:///{database}")
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE changes (job_id TEXT PRIMARY KEY)"))
    yield engine
    engine.dispose()


@pytest.fixture
def publisher(database: Path) -> RecordingPublisher:
    return RecordingPublisher(database)


@pytest.fixture
def recorder() -> RecordingRecorder:
    return RecordingRecorder()


@pytest.fixture
def celery(publisher: RecordingPublisher, recorder: RecordingRecorder) -> VidqCelery:
    return cast(VidqCelery, FakeCelery(publisher, recorder))


def _queued_job() -> Job:
    return Job(
        id=uuid.uuid4(), status="queued", priority_class=PriorityClass.HIGH.value, traceparent=None, webhook_url=None
    )


def _change(session: Session, job: Job) -> None:
    """The unit of work's change: a row only a committed transaction leaves behind."""
    session.execute(text("INSERT INTO changes (job_id) VALUES (:id)"), {"id": str(job.id)})


def test_a_committed_unit_of_work_sends_its_message_after_the_commit(
    engine: Engine, celery: VidqCelery, publisher: RecordingPublisher, recorder: RecordingRecorder
) -> None:
    job = _queued_job()
    with Session(engine) as session:
        _change(session, job)
        send_job_after_commit(session, celery, job)
        session.flush()
        assert publisher.sends == [], "sent before the commit"
        session.commit()
        assert publisher.sends == [
            ([TaskMessage(TASK_GENERATE, job.id, Queue.HIGH.value, None)], {str(job.id)})  # its change committed
        ]
        assert recorder.recorded == [job.id]  # a video send is recorded (jobs.enqueued_at)
        # The message went with its transaction: a later commit of the same session sends it again never.
        session.commit()
    assert len(publisher.sends) == 1


def test_a_rolled_back_unit_of_work_sends_nothing(
    engine: Engine, celery: VidqCelery, publisher: RecordingPublisher, recorder: RecordingRecorder
) -> None:
    job = _queued_job()
    with Session(engine) as session:
        _change(session, job)
        send_job_after_commit(session, celery, job)
        session.rollback()
        # The next transaction of the same session commits: the rolled-back one's message must not ride along.
        other = _queued_job()
        _change(session, other)
        send_job_after_commit(session, celery, other)
        session.commit()
    assert publisher.sends == [([TaskMessage(TASK_GENERATE, other.id, Queue.HIGH.value, None)], {str(other.id)})]
    assert recorder.recorded == [other.id]

    # A unit of work that fails inside ``Session.begin()`` (as shared.infra.db.session_scope's do) rolls back too.
    failed = _queued_job()
    with pytest.raises(RuntimeError, match="the change failed"), Session(engine) as session, session.begin():
        _change(session, failed)
        send_job_after_commit(session, celery, failed)
        raise RuntimeError("the change failed")
    assert len(publisher.sends) == 1 and str(failed.id) not in publisher.committed()


def test_a_finished_jobs_webhook_is_sent_after_the_commit_and_not_recorded(
    engine: Engine, celery: VidqCelery, publisher: RecordingPublisher, recorder: RecordingRecorder
) -> None:
    job = Job(
        id=uuid.uuid4(),
        status="succeeded",
        priority_class=PriorityClass.HIGH.value,
        traceparent=None,
        webhook_url="https://e.x",
    )
    with Session(engine) as session:
        _change(session, job)
        send_webhook_after_commit(session, celery, job)
        session.flush()
        assert publisher.sends == [], "sent before the commit"
        session.commit()
    sent = TaskMessage(TASK_DELIVER_WEBHOOK, job.id, Queue.WEBHOOKS.value, None)
    assert publisher.sends == [([sent], {str(job.id)})]
    assert recorder.recorded == []  # only video sends are tracked (the sweeper re-sends those)
