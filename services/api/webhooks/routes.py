"""Webhook routes: a job's delivery log, the tenant's failing deliveries, and a redelivery on request. Sync, on
the request's session in the thread pool (none of them is a hot path)."""

from __future__ import annotations

import uuid
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from sqlalchemy import func, select

from services.api import pagination
from services.api.deps import SessionDep, SettingsDep, TenantDep
from services.api.error_handlers import ERROR_RESPONSES
from services.api.webhooks.schemas import RedeliveryOut, WebhookDeliveryOut, WebhookDeliveryPage
from shared.errors import Conflict, InvalidRequest
from shared.jobs import repository
from shared.jobs.status import JobStatus
from shared.messaging.dispatch import send_webhook_after_commit
from shared.webhooks import deliveries
from shared.webhooks.events import event_type as webhook_event_type
from shared.webhooks.schedule import message_id

router = APIRouter(tags=["webhooks"], responses=ERROR_RESPONSES)


@router.get("/v1/jobs/{job_id}/webhooks", response_model=list[WebhookDeliveryOut])
def job_webhooks(job_id: uuid.UUID, session: SessionDep, tenant: TenantDep) -> list[WebhookDeliveryOut]:
    """Every delivery attempt of the job, oldest first, each with when the next one was planned."""
    repository.get(session, tenant_id=tenant.id, job_id=job_id)  # 404 for another tenant's job
    return [WebhookDeliveryOut.model_validate(r) for r in deliveries.job_log(session, job_id)]


@router.get("/v1/webhooks/deliveries", response_model=WebhookDeliveryPage)
def failed_deliveries(
    session: SessionDep,
    settings: SettingsDep,
    tenant: TenantDep,
    state: Annotated[
        Literal["failed", "retrying"],
        Query(description="failed: given up (or gone), no retry planned; retrying: failed, the next attempt planned"),
    ] = "failed",
    limit: Annotated[int, Query(ge=1, le=1000, description="at most VIDQ_PAGE_SIZE_MAX are returned")] = 20,
    cursor: str | None = None,
) -> WebhookDeliveryPage:
    """The latest attempt of each of the tenant's failing deliveries, newest first (keyset on the attempt id)."""
    limit = pagination.page_size(limit, settings)
    if cursor is not None and not cursor.isdigit():
        raise InvalidRequest("invalid cursor", details={"cursor": cursor})
    rows = deliveries.failing(
        session,
        tenant_id=tenant.id,
        state=state,
        limit=pagination.read_size(limit),
        before_id=None if cursor is None else int(cursor),
    )
    page, more = pagination.split(rows, limit)
    return WebhookDeliveryPage(
        data=[WebhookDeliveryOut.model_validate(r) for r in page],
        next_cursor=str(page[-1].id) if more else None,
    )


@router.post("/v1/jobs/{job_id}/webhooks/redeliver", status_code=202, response_model=RedeliveryOut)
def redeliver(job_id: uuid.UUID, request: Request, session: SessionDep, tenant: TenantDep) -> RedeliveryOut:
    """One fresh attempt of the finished job's event, now, whatever happened before (delivered, given up, gone,
    or a retry planned for later). A failed redelivery past the end of the schedule is not retried."""
    job = repository.get(session, tenant_id=tenant.id, job_id=job_id)  # 404 for another tenant's job
    if not JobStatus(job.status).is_terminal():
        raise Conflict("the job is not finished: its webhook is sent when it is", details={"status": job.status})
    if not job.webhook_url:
        raise Conflict("the job has no webhook URL")
    event_type = webhook_event_type(job)
    latest = session.execute(deliveries.latest_attempt(job.id, event_type).with_for_update()).scalar_one_or_none()
    if latest is not None:
        # Due now: the task makes the next attempt. Leased as handed over, so the sweeper hands it over again
        # only if this message is lost. With no attempt on record yet, the task's first one is due anyway.
        latest.next_attempt_at = latest.handed_over_at = session.execute(select(func.now())).scalar_one()
    send_webhook_after_commit(session, request.app.state.celery, job)
    session.commit()
    return RedeliveryOut(job_id=job.id, event_type=event_type, msg_id=message_id(job.id, event_type))
