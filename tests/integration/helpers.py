"""What several integration test modules share: job payloads, polling, the database's view of a job, the
sweeper, and the Redis key of a queue. Test modules import from here, never from each other."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from services.sweeper.sweeper import Sweeper
from shared.infra.config import Settings
from shared.infra.db import session_factory, session_scope
from shared.messaging.celery_app import make_celery
from shared.models import Job, JobTransition
from tools.processes import ProcessGroup

TINY: dict[str, Any] = {
    "prompt": "a small red boat on a calm lake",
    "width": 64,
    "height": 64,
    "duration_s": 1.0,
    "fps": 8,
    "steps": 4,
    "seed": 1,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sweeper(settings: Settings) -> Sweeper:
    """A sweeper in this process, for tests that drive sweeps one at a time."""
    return Sweeper(settings, celery=make_celery(settings), sessions=session_factory(settings))


def queue_key(settings: Settings, queue: str) -> str:
    """The Redis list holding ``queue``'s messages: kombu prefixes it with this session's broker_key_prefix."""
    return f"{settings.broker_key_prefix}{queue}"


def submit(client: httpx.Client, **overrides: Any) -> dict[str, Any]:
    r = client.post("/v1/jobs", json={**TINY, **overrides})
    assert r.status_code == 202, r.text
    return r.json()


def wait_job(
    client: httpx.Client, job_id: str, statuses: set[str], *, timeout_s: float = 90, min_step: int = 0
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").raise_for_status().json()
        if job["status"] in statuses and job["progress"]["step"] >= min_step:
            return job
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} never reached {statuses} (step ≥ {min_step}): {job}")


def db_job(settings: Settings, job_id: str) -> Job:
    with session_scope(settings) as session:
        job = session.get(Job, uuid.UUID(job_id))
        assert job is not None
        session.expunge(job)
        return job


def transitions(settings: Settings, job_id: str) -> list[tuple[str | None, str, int]]:
    with session_scope(settings) as session:
        rows = session.query(JobTransition).filter_by(job_id=uuid.UUID(job_id)).order_by(JobTransition.id)
        return [(r.from_status, r.to_status, r.attempt) for r in rows]


@contextmanager
def process_env(procs: ProcessGroup, **values: str) -> Iterator[dict[str, str]]:
    """Settings for the processes started inside; the env a probe of them needs is yielded."""
    saved = {key: procs.env.get(key) for key in values}
    procs.env.update(values)
    try:
        yield {**procs.env}
    finally:
        for key, old in saved.items():
            if old is None:
                procs.env.pop(key, None)
            else:
                procs.env[key] = old


def kill_after_test(procs: ProcessGroup, name: str) -> None:
    """A test's process, once the test is over: SIGKILL, as only its being gone matters now. A worker's warm
    shutdown costs ~4 s of Celery's pool join, and is itself what test_worker_faults.py and test_worker_process.py
    check. What a killed worker held unacknowledged lies under the session's broker key prefix, which the next
    test's clean_state empties."""
    procs.kill(name)
