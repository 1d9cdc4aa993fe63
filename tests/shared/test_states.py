"""The state machine: its transition table (pure, no service), then against real Postgres: conditional
transitions, fencing tokens, lease recovery, and the webhook mark a finishing transition sets. The Postgres tests
are marked integration by tests/conftest.py, through the ``settings`` fixture they use."""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta

import pytest
from sqlalchemy import func, select, update

from services.api.jobs.service import create_job
from shared.errors import InvalidTransition, NotFound
from shared.infra.db import session_scope
from shared.jobs.repository import expired_leases
from shared.jobs.schemas import JobCreate
from shared.jobs.states import claim, fail, recover_expired, renew_lease, request_cancel, succeed
from shared.jobs.status import ALLOWED, TERMINAL, JobStatus, can_transition
from shared.models import Job
from shared.tenants import get_or_create_tenant

BODY = {"prompt": "a boat", "width": 64, "height": 64, "duration_s": 1.0, "fps": 8, "steps": 2}


@pytest.fixture
def job_id(settings, clean_state) -> uuid.UUID:
    with session_scope(settings) as session:
        tenant = get_or_create_tenant(session, "states")
        return create_job(session, settings, tenant=tenant, body=JobCreate(**BODY)).id


def tenant_of(settings, job_id):
    with session_scope(settings) as session:
        return session.get(Job, job_id).tenant_id


def test_terminal_states_allow_nothing():
    for status in JobStatus:
        assert status.is_terminal() == (ALLOWED[status] == frozenset())
    assert not can_transition(JobStatus.SUCCEEDED, JobStatus.RUNNING)
    assert can_transition(JobStatus.RUNNING, JobStatus.QUEUED)


def test_transition_table_is_the_documented_diagram():
    # The diagram in shared/jobs/states.py, edge by edge; anything else must be refused.
    documented = {
        ("queued", "running"),  # claim
        ("queued", "cancelled"),  # cancel before it runs
        ("queued", "failed"),  # max attempts
        ("running", "succeeded"),
        ("running", "failed"),
        ("running", "cancelled"),
        ("running", "queued"),  # lease expired / transient error
    }
    allowed = {(src.value, dst.value) for src in JobStatus for dst in JobStatus if can_transition(src, dst)}
    assert allowed == documented
    assert set(ALLOWED) == set(JobStatus)  # every status has a row
    assert {s.value for s in TERMINAL} == {"succeeded", "failed", "cancelled"}
    assert [s for s in JobStatus if s.is_terminal()] == [s for s in JobStatus if s in TERMINAL]


def test_only_one_of_many_concurrent_claims_wins(settings, job_id):
    wins: list[int] = []
    barrier = threading.Barrier(8)

    def worker(n: int) -> None:
        barrier.wait()
        with session_scope(settings) as session:
            job = claim(session, job_id, worker_id=f"w{n}", lease_s=30)
            if job is not None:
                wins.append(job.attempt)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wins == [1]


def test_stale_token_cannot_finalize(settings, job_id):
    with session_scope(settings) as session:
        token = claim(session, job_id, worker_id="w", lease_s=30).attempt
    with session_scope(settings) as session:
        assert succeed(session, job_id, token=token + 1, output={}) is None
        assert renew_lease(session, job_id, token=token + 1, lease_s=30).owned is False
    with session_scope(settings) as session:
        assert succeed(session, job_id, token=token, output={}) is not None
    with session_scope(settings) as session:  # a second finalize, even with the right token, is refused
        assert succeed(session, job_id, token=token, output={}) is None


def test_expired_lease_goes_back_to_queued_then_fails_past_max_attempts(settings, job_id):
    for attempt in range(1, settings.max_attempts + 1):
        with session_scope(settings) as session:
            assert claim(session, job_id, worker_id="w", lease_s=30).attempt == attempt
            session.execute(
                update(Job).where(Job.id == job_id).values(lease_expires_at=func.now() - timedelta(seconds=1))
            )
        with session_scope(settings) as session:
            now = session.execute(select(func.now())).scalar_one()
            (job,) = [j for j in expired_leases(session, now=now, limit=100) if j.id == job_id]
            after = recover_expired(session, job)
        expected = "failed" if attempt == settings.max_attempts else "queued"
        assert after.status == expected
    with session_scope(settings) as session:
        assert claim(session, job_id, worker_id="w", lease_s=30) is None
        job = session.get(Job, job_id)
        assert (job.error_code, job.attempt) == ("max_attempts_exceeded", settings.max_attempts)


def test_cancel_rules(settings, job_id):
    tenant = tenant_of(settings, job_id)
    with session_scope(settings) as session, pytest.raises(NotFound):
        request_cancel(session, job_id, tenant_id=uuid.uuid4())
    with session_scope(settings) as session:
        token = claim(session, job_id, worker_id="w", lease_s=30).attempt
    with session_scope(settings) as session:
        job = request_cancel(session, job_id, tenant_id=tenant)
        assert job.status == "running" and job.cancel_requested
    with session_scope(settings) as session:
        assert renew_lease(session, job_id, token=token, lease_s=30).cancel_requested is True
        succeed(session, job_id, token=token, output={})
    with session_scope(settings) as session, pytest.raises(InvalidTransition):
        request_cancel(session, job_id, tenant_id=tenant)


# --- the webhook mark: set by the UPDATE that finishes a job (the sweeper's side: tests/services/sweeper/) ---------


def _job(settings, **body) -> uuid.UUID:
    with session_scope(settings) as session:
        tenant = get_or_create_tenant(session, "states")
        return create_job(session, settings, tenant=tenant, body=JobCreate(**{**BODY, **body})).id


def _mark(settings, job_id: uuid.UUID):
    with session_scope(settings) as session:
        return session.execute(select(Job.webhook_pending_since).where(Job.id == job_id)).scalar_one()


def test_finishing_a_job_with_a_webhook_marks_it_in_the_same_update(settings, clean_state):
    url = "https://example.com/hook"
    succeeded, failed, cancelled = _job(settings, webhook_url=url), _job(settings), _job(settings, webhook_url=url)
    with session_scope(settings) as session:
        running = claim(session, succeeded, worker_id="w", lease_s=30)
        assert running is not None and running.webhook_pending_since is None  # nothing to deliver yet
        assert succeed(session, succeeded, token=running.attempt, output={}) is not None
        assert fail(session, failed, token=None, code="x", message="y") is not None
        request_cancel(session, cancelled, tenant_id=running.tenant_id)
    assert _mark(settings, succeeded) is not None and _mark(settings, cancelled) is not None
    assert _mark(settings, failed) is None  # no URL: nothing to deliver, and not in the index
