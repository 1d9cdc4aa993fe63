"""Every query on the webhook delivery log (``webhook_deliveries``): the webhook task, the API's log and redelivery
endpoints, and the sweeper read and write it through these."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any, Literal

from sqlalchemy import Select, func, insert, or_, select, update
from sqlalchemy.orm import Session

from shared.jobs import repository
from shared.models import Job, Tenant, WebhookDelivery


def latest_attempt(job_id: uuid.UUID, event_type: str) -> Select[WebhookDelivery]:
    """The newest live attempt of a job's event: the webhook task plans the next one from it, a redelivery makes it
    due now. Superseded rows belong to an earlier event of the job and stay only for the log."""
    return (
        select(WebhookDelivery)
        .where(
            WebhookDelivery.job_id == job_id,
            WebhookDelivery.event_type == event_type,
            ~WebhookDelivery.superseded,
        )
        .order_by(WebhookDelivery.attempt.desc())
        .limit(1)
    )


def retries_due(session: Session, *, now: datetime, grace_s: float, limit: int) -> list[tuple[WebhookDelivery, Job]]:
    """The latest attempts whose retry is due, not handed over in the last ``grace_s``, earliest first
    (ix_webhook_deliveries_due: only the latest attempts with a retry planned are in it)."""
    rows = session.execute(
        select(WebhookDelivery, Job)
        .join(Job, Job.id == WebhookDelivery.job_id)
        .where(
            WebhookDelivery.next_attempt_at.is_not(None),
            ~WebhookDelivery.superseded,
            WebhookDelivery.next_attempt_at <= now,
            or_(
                WebhookDelivery.handed_over_at.is_(None),
                WebhookDelivery.handed_over_at < now - timedelta(seconds=grace_s),
            ),
        )
        .order_by(WebhookDelivery.next_attempt_at)
        .limit(limit)
        .with_for_update(of=WebhookDelivery, skip_locked=True)
    ).all()
    return [(delivery, job) for delivery, job in rows]


def job_and_secret(session: Session, job_id: uuid.UUID) -> tuple[Job, str] | None:
    """The job and its tenant's signing secret, for an attempt."""
    row = session.execute(
        select(Job, Tenant.webhook_secret).join(Tenant, Tenant.id == Job.tenant_id).where(Job.id == job_id)
    ).first()
    return None if row is None else (row[0], row[1])


def latest_and_due(session: Session, job_id: uuid.UUID, event_type: str) -> tuple[WebhookDelivery, bool] | None:
    """The latest live attempt of the event and whether its next attempt is due, on the database's clock (the one
    the sweeper reads); None when no attempt is on record."""
    row = session.execute(
        latest_attempt(job_id, event_type).add_columns(WebhookDelivery.next_attempt_at <= func.now())
    ).first()
    return None if row is None else (row[0], bool(row[1]))


def record_attempt(
    session: Session, *, job_id: uuid.UUID, event_type: str, next_in_s: float | None, **attempt: Any
) -> None:
    """An attempt on record as the latest of its job and event (the earlier ones superseded), with the next one
    planned ``next_in_s`` from now when there is one, and the job's tenant copied onto it (the tenant's list of
    failing deliveries reads it). With an attempt on record the sweeper no longer needs to hand the job over
    (``jobs.webhook_pending_since`` cleared)."""
    session.execute(
        update(WebhookDelivery)
        .where(WebhookDelivery.job_id == job_id, WebhookDelivery.event_type == event_type, ~WebhookDelivery.superseded)
        .values(superseded=True)
        .execution_options(synchronize_session=False)
    )
    session.execute(
        insert(WebhookDelivery).values(
            job_id=job_id,
            tenant_id=select(Job.tenant_id).where(Job.id == job_id).scalar_subquery(),
            event_type=event_type,
            next_attempt_at=None if next_in_s is None else func.now() + timedelta(seconds=next_in_s),
            **attempt,
        )
    )
    repository.clear_webhook_pending(session, [job_id])


def defer(
    session: Session,
    *,
    job_id: uuid.UUID,
    latest: WebhookDelivery | None,
    delay_s: float,
    grace_s: float,
) -> None:
    """An attempt not made (its host's circuit breaker is open) and not spent: it becomes due ``delay_s`` from now,
    and nothing is added to the log. With an attempt on record, that attempt's planned retry moves
    (``next_attempt_at``, its hand-over cleared); before the first attempt, the job's webhook mark moves, so that the
    sweeper, which hands a job over ``grace_s`` after its mark, does so ``delay_s`` from now."""
    if latest is not None:
        session.execute(
            update(WebhookDelivery)
            .where(WebhookDelivery.id == latest.id)
            .values(next_attempt_at=func.now() + timedelta(seconds=delay_s), handed_over_at=None)
            .execution_options(synchronize_session=False)
        )
        return
    session.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(webhook_pending_since=func.now() + timedelta(seconds=delay_s - grace_s))
        .execution_options(synchronize_session=False)
    )


def job_log(session: Session, job_id: uuid.UUID) -> list[WebhookDelivery]:
    """Every attempt of the job, oldest first."""
    query = select(WebhookDelivery).where(WebhookDelivery.job_id == job_id).order_by(WebhookDelivery.id)
    return list(session.execute(query).scalars())


def failing(
    session: Session,
    *,
    tenant_id: uuid.UUID,
    state: Literal["failed", "retrying"],
    limit: int,
    before_id: int | None,
) -> list[WebhookDelivery]:
    """The latest attempt of each of the tenant's failing deliveries, newest first, after the attempt ``before_id``
    (keyset on the attempt id). ``failed``: no retry planned (given up, or gone); ``retrying``: the next attempt
    planned. Each state has its index, led by the tenant (ix_webhook_deliveries_tenant_failed, …_retrying), whose
    predicate is this query's: a page reads O(page) entries, whatever other tenants hold."""
    planned = WebhookDelivery.next_attempt_at.is_not(None)
    query = (
        select(WebhookDelivery)
        .where(
            ~WebhookDelivery.ok,
            ~WebhookDelivery.superseded,
            planned if state == "retrying" else WebhookDelivery.next_attempt_at.is_(None),
            WebhookDelivery.tenant_id == tenant_id,
        )
        .order_by(WebhookDelivery.id.desc())
        .limit(limit)
    )
    if before_id is not None:
        query = query.where(WebhookDelivery.id < before_id)
    return list(session.execute(query).scalars())
