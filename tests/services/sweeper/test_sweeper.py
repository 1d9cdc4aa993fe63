"""The sweeper in this process, one sweep at a time, against real Postgres: it hands marked webhooks over and gives
up on them after a day, and expires idempotency keys. Marked integration through ``settings``."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import func, select, update

from services.api.jobs.service import create_job
from shared.infra.config import Settings
from shared.infra.db import session_scope
from shared.jobs.schemas import JobCreate
from shared.jobs.states import fail
from shared.models import IdempotencyKey, Job
from shared.tenants import get_or_create_tenant
from tests.integration.helpers import TINY, sweeper


def _job(settings: Settings, **body: Any) -> uuid.UUID:
    with session_scope(settings) as session:
        tenant = get_or_create_tenant(session, "sweeper")
        return create_job(session, settings, tenant=tenant, body=JobCreate(**{**TINY, **body})).id


def _mark(settings: Settings, job_id: uuid.UUID) -> Any:
    with session_scope(settings) as session:
        return session.execute(select(Job.webhook_pending_since).where(Job.id == job_id)).scalar_one()


def test_the_sweeper_hands_marked_jobs_over_and_gives_up_after_a_day(settings, clean_state):
    recent, stale = _job(settings, webhook_url="https://example.com/h"), _job(settings, webhook_url="https://e.x/h")
    with session_scope(settings) as session:
        for job_id, age in ((recent, timedelta(minutes=5)), (stale, timedelta(days=2))):
            fail(session, job_id, token=None, code="x", message="y")
            session.execute(update(Job).where(Job.id == job_id).values(webhook_pending_since=func.now() - age))
    report = sweeper(settings).sweep_once()
    assert report.webhooks == [recent]
    assert _mark(settings, stale) is None  # given up: out of the index
    assert _mark(settings, recent) is not None  # still marked until an attempt is on record
    # Handed over once per grace period, not once per tick: a webhook worker that is down for long finds one message
    # per job waiting, not thousands.
    assert sweeper(settings).sweep_once().webhooks == []


def test_sweeper_expires_idempotency_keys(settings, clean_state):
    job_id = _job(settings)
    with session_scope(settings) as session:
        tenant_id = session.execute(select(Job.tenant_id).where(Job.id == job_id)).scalar_one()
        for key, expires_at in (
            ("old", datetime.now(UTC) - timedelta(seconds=1)),
            ("fresh", datetime.now(UTC) + timedelta(hours=1)),
        ):
            session.add(
                IdempotencyKey(tenant_id=tenant_id, key=key, request_hash="x", job_id=job_id, expires_at=expires_at)
            )
    report = sweeper(settings).sweep_once()
    assert report.keys_expired == 1
    with session_scope(settings) as session:
        keys = session.execute(select(IdempotencyKey.key)).scalars().all()
        assert keys == ["fresh"]
        assert session.execute(select(func.count()).select_from(Job)).scalar_one() == 1
