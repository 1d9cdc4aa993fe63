"""A webhook whose receiver host's circuit breaker is open is deferred, not spent (services/webhooks/tasks.py
``attempt_delivery`` on real Postgres, a breaker set on a fake clock): nothing is posted or logged, the due time
moves by the schedule's delay, and the next attempt made has the number the deferred one would have had. Marked
integration by tests/conftest.py through the ``settings`` fixture."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from sqlalchemy import func, select, update

from services.api.jobs.service import create_job
from services.webhooks.tasks import attempt_delivery, host_of
from shared.infra.breakers import BreakerRule, BreakerSet, State
from shared.infra.db import session_scope
from shared.jobs.schemas import JobCreate
from shared.jobs.states import request_cancel
from shared.models import Job, WebhookDelivery
from shared.tenants import get_or_create_tenant
from tests.integration.helpers import free_port


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def refused_url() -> str:
    return f"http://127.0.0.1:{free_port()}/hook"  # nothing listens: connection refused


@pytest.fixture
def cancelled_job(settings, clean_state, refused_url) -> uuid.UUID:
    """A finished job (cancelled while queued) whose event is due, with no attempt on record."""
    with session_scope(settings) as session:
        tenant = get_or_create_tenant(session, "deferral")
        job = create_job(session, settings, tenant=tenant, body=JobCreate(prompt="a boat", webhook_url=refused_url))
        request_cancel(session, job.id, tenant_id=tenant.id)
        return job.id


def attempts(settings, job_id: uuid.UUID) -> list[WebhookDelivery]:
    with session_scope(settings) as session:
        rows = session.execute(
            select(WebhookDelivery).where(WebhookDelivery.job_id == job_id).order_by(WebhookDelivery.id)
        ).scalars()
        return list(rows)


def make_due(settings, job_id: uuid.UUID) -> None:
    with session_scope(settings) as session:
        session.execute(
            update(WebhookDelivery)
            .where(WebhookDelivery.job_id == job_id, ~WebhookDelivery.superseded)
            .values(next_attempt_at=func.now() - timedelta(seconds=1))
        )


def test_an_open_host_defers_the_attempt_without_spending_it(settings, cancelled_job, refused_url):
    clock = Clock()
    rule = BreakerRule(failure_ratio=0.5, min_calls=20, window_s=60, open_s=60)
    hosts = BreakerSet("webhook", rule, max_keys=10, clock=clock)
    breaker = hosts.get(host_of(refused_url))
    for _ in range(20):  # the host kept failing for other deliveries of this process
        breaker.failure()
    assert breaker.state is State.OPEN

    # 1. The first attempt is due: deferred, nothing logged; the job's webhook mark moves so that the sweeper hands
    #    it over after the schedule's first delay (grace included), not spent.
    assert attempt_delivery(cancelled_job, settings=settings, storage=None, hosts=hosts) == "deferred"
    assert attempts(settings, cancelled_job) == []
    with session_scope(settings) as session:
        job = session.get(Job, cancelled_job)
        assert job is not None and job.webhook_pending_since is not None
        due_in = session.execute(
            select(func.extract("epoch", Job.webhook_pending_since - func.now())).where(Job.id == cancelled_job)
        ).scalar_one()
    first_delay = settings.webhook_schedule_s[0] * (1 + settings.webhook_schedule_jitter)
    assert float(due_in) + settings.webhook_resend_grace_s <= first_delay + 1

    # 2. Half-open after open_s: exactly one probe goes out. It is attempt 1 (the deferral spent nothing), it is
    #    refused, and the breaker opens again.
    clock.now += 60
    assert attempt_delivery(cancelled_job, settings=settings, storage=None, hosts=hosts) == "retry_scheduled"
    (first,) = attempts(settings, cancelled_job)
    assert (first.attempt, first.ok, first.error) == (1, False, "connect_error")
    assert breaker.state is State.OPEN

    # 3. Its retry is due, the breaker is open: deferred again, the planned retry moved, still one row, attempt 1.
    make_due(settings, cancelled_job)
    assert attempt_delivery(cancelled_job, settings=settings, storage=None, hosts=hosts) == "deferred"
    (still,) = attempts(settings, cancelled_job)
    assert still.attempt == 1 and still.id == first.id and still.handed_over_at is None
    with session_scope(settings) as session:
        retry_in = session.execute(
            select(func.extract("epoch", WebhookDelivery.next_attempt_at - func.now())).where(
                WebhookDelivery.id == first.id
            )
        ).scalar_one()
    assert 0 < float(retry_in) <= settings.webhook_schedule_s[1] * (1 + settings.webhook_schedule_jitter) + 1

    # 4. Not due yet: the task drops it; once due and the breaker half-open, the next attempt made is attempt 2.
    assert attempt_delivery(cancelled_job, settings=settings, storage=None, hosts=hosts) == "not_due"
    make_due(settings, cancelled_job)
    clock.now += 60
    attempt_delivery(cancelled_job, settings=settings, storage=None, hosts=hosts)
    assert [a.attempt for a in attempts(settings, cancelled_job)] == [1, 2]


def test_a_closed_host_is_attempted_and_its_failures_count(settings, cancelled_job, refused_url):
    hosts = BreakerSet("webhook", BreakerRule(min_calls=1), max_keys=10, clock=Clock())
    assert attempt_delivery(cancelled_job, settings=settings, storage=None, hosts=hosts) == "retry_scheduled"
    assert hosts.get(host_of(refused_url)).state is State.OPEN  # one call, failed: 100% of min_calls=1


def test_host_of_names_host_and_port() -> None:
    assert host_of("https://Example.com/hooks") == "example.com:443"
    assert host_of("http://example.com/hooks") == "example.com:80"
    assert host_of("http://127.0.0.1:9000/h") == "127.0.0.1:9000"
