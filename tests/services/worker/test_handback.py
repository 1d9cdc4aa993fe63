"""An unclaimable message handed back while the broker is down is never dropped (services/worker/handback.py): the
video task's own Celery retry, run in a task request as a worker runs it, against a real Redis address. A closed port
is the broker down; a redis-server started on that port mid-wait is the broker back."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery.exceptions import Reject, Retry

from services.worker.handback import PublishFailed, broker_unreachable, hand_back
from services.worker.runner import ClaimDeferred
from shared.infra.config import Settings
from shared.messaging.broker import job_id_of
from shared.messaging.celery_app import VidqCelery, make_celery
from shared.queues import TASK_GENERATE, Queue
from tools.devstack.embedded import EmbeddedRedis
from tools.processes import free_ports

QUEUE = Queue.LOW.value


@pytest.fixture
def port() -> int:
    return free_ports(1)[0]  # nothing listens there: connections are refused, as by a broker that is down


def _app(port: int) -> VidqCelery:
    settings = Settings(  # type: ignore[call-arg]
        broker_url=f"redis://127.0.0.1:{port}/0",  # type: ignore[arg-type]
        broker_key_prefix=f"handback-{uuid.uuid4().hex[:8]}:",
        redis_socket_timeout_s=2.0,
        worker_db_retry_base_s=0.05,
        worker_db_retry_max_s=0.2,
    )
    import services.worker.tasks  # noqa: F401  # registers the video task on every app

    return make_celery(settings)


@pytest.fixture
def running_task(port: int) -> Iterator[tuple[Any, str]]:
    """The video task inside a request as a worker pool runs it (so Celery's retry publishes), for one job."""
    app = _app(port)
    task = app.tasks[TASK_GENERATE]
    job_id = str(uuid.uuid4())
    task.push_request(
        id=str(uuid.uuid4()),
        args=[job_id],
        kwargs={},
        retries=0,
        called_directly=False,
        delivery_info={"exchange": "", "routing_key": QUEUE},
    )
    try:
        yield task, job_id
    finally:
        task.pop_request()
        app.close()


def test_a_broker_down_until_the_end_leaves_the_message_to_be_requeued(running_task: tuple[Any, str]) -> None:
    """Celery's own retry would reject the message for good (requeue=False) when its copy cannot be published;
    the hand-back keeps trying until its time is up, then rejects it with requeue: the message goes back."""
    task, _ = running_task
    with pytest.raises(Reject) as rejected:
        hand_back(task, ClaimDeferred("Postgres unreachable"), until=_now_plus(1.0))
    assert rejected.value.requeue is True
    assert isinstance(rejected.value.reason, PublishFailed) and broker_unreachable(rejected.value.reason)


def test_a_broker_back_during_the_wait_gets_the_copy(running_task: tuple[Any, str], port: int, tmp_path: Path) -> None:
    """The broker comes back after the hand-back has met it down: the copy is published (Celery's Retry ends the
    task, acknowledging the original only now), and the job's message is on its queue."""
    task, job_id = running_task
    met_down = threading.Event()
    broker = EmbeddedRedis(tmp_path / "redis", port=port)
    handler = _OnRecord("broker unreachable", met_down)
    logging.getLogger("vidq.worker.handback").addHandler(handler)

    def bring_back() -> None:
        if met_down.wait(timeout=60):
            broker.start()

    starter = threading.Thread(target=bring_back, daemon=True)
    starter.start()
    try:
        with pytest.raises(Retry):
            hand_back(task, ClaimDeferred("Postgres unreachable"), until=_now_plus(120.0))
        assert met_down.is_set()  # the first publish did fail: the copy went out on a later try
        with redis.Redis.from_url(broker.url, socket_timeout=5) as client:
            queued = client.lrange(f"{task.app.settings.broker_key_prefix}{QUEUE}", 0, -1)
        assert [str(job_id_of(raw)) for raw in queued] == [job_id]
    finally:
        logging.getLogger("vidq.worker.handback").removeHandler(handler)
        met_down.set()
        starter.join(timeout=30)
        broker.stop()


class _OnRecord(logging.Handler):
    """Sets ``event`` when a record whose message contains ``needle`` is logged."""

    def __init__(self, needle: str, event: threading.Event) -> None:
        super().__init__(level=logging.DEBUG)
        self.needle, self.event = needle, event

    def emit(self, record: logging.LogRecord) -> None:
        if self.needle in record.getMessage():
            self.event.set()


def _now_plus(seconds: float) -> float:
    return time.monotonic() + seconds
