"""/v1/jobs routes: thin; the logic is in services/api/jobs/service.py. Submit, read and list are async on the
store's connection pool (the hot paths); cancel is sync, on a session in the thread pool."""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response

from services.api import pagination
from services.api.deps import SessionDep, SettingsDep, TenantDep
from services.api.error_handlers import ERROR_RESPONSES, QUEUE_FULL_DESCRIPTION, RETRY_AFTER_HEADER, ErrorBody
from services.api.jobs import service as jobs_service
from services.api.jobs import submission
from shared.jobs.presenters import present_job
from shared.jobs.schemas import JobCreate, JobOut, JobPage
from shared.jobs.states import request_cancel
from shared.jobs.status import JobStatus
from shared.messaging.dispatch import after_transition_commit

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=ERROR_RESPONSES)


@router.post(
    "",
    status_code=202,
    response_model=JobOut,
    responses={
        429: {
            "model": ErrorBody,
            "description": QUEUE_FULL_DESCRIPTION,
            "headers": {"Retry-After": RETRY_AFTER_HEADER},
        }
    },
)
async def submit_job(
    body: JobCreate,
    request: Request,
    response: Response,
    settings: SettingsDep,
    tenant: TenantDep,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
) -> JobOut:
    job = await submission.submit(
        request,
        response,
        settings,
        tenant=tenant,
        body=body,
        idempotency_key=idempotency_key,
        location=lambda job: f"/v1/jobs/{job.id}",
    )
    estimate = request.app.state.estimator.quote(job)
    return present_job(job, settings=settings, storage=request.app.state.storage, estimate=estimate)


@router.get("", response_model=JobPage)
async def list_jobs(
    request: Request,
    settings: SettingsDep,
    tenant: TenantDep,
    status: JobStatus | None = None,
    limit: Annotated[int, Query(ge=1, le=1000, description="at most VIDQ_PAGE_SIZE_MAX are returned")] = 20,
    cursor: str | None = None,
) -> JobPage:
    jobs, next_cursor = await jobs_service.list_jobs(
        request.app.state.store,
        tenant_id=tenant.id,
        status=status,
        limit=pagination.page_size(limit, settings),
        cursor=cursor,
    )
    storage, quote = request.app.state.storage, request.app.state.estimator.quote
    return JobPage(
        data=[present_job(j, settings=settings, storage=storage, estimate=quote(j)) for j in jobs],
        next_cursor=next_cursor,
    )


@router.get("/{job_id}", response_model=JobOut)
async def get_job(job_id: uuid.UUID, request: Request, settings: SettingsDep, tenant: TenantDep) -> JobOut:
    job = await jobs_service.read(request.app.state.store, tenant_id=tenant.id, job_id=job_id)
    estimate = request.app.state.estimator.quote(job)
    return present_job(job, settings=settings, storage=request.app.state.storage, estimate=estimate)


@router.post("/{job_id}/cancel", status_code=202, response_model=JobOut)
def cancel_job(
    job_id: uuid.UUID, request: Request, session: SessionDep, settings: SettingsDep, tenant: TenantDep
) -> JobOut:
    job = request_cancel(session, job_id, tenant_id=tenant.id)
    if JobStatus(job.status).is_terminal():  # cancelled while queued (a running job stops at its next step)
        after_transition_commit(session, request.app.state.celery, job)
    session.commit()
    return present_job(job, settings=settings, storage=request.app.state.storage)
