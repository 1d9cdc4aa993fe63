"""/v1/jobs routes: thin; the logic is in services/api/jobs/service.py. Submit, read and list are async on the
store's connection pool (the hot paths); cancel is sync, on a session in the thread pool."""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response

from services.api import pagination
from services.api.context import service as context_service
from services.api.deps import PoolHeader, SessionDep, SettingsDep, TenantDep
from services.api.error_handlers import (
    ERROR_RESPONSES,
    POOL_NOT_ALLOWED_DESCRIPTION,
    QUEUE_FULL_DESCRIPTION,
    RETRY_AFTER_HEADER,
    ErrorBody,
)
from services.api.jobs import service as jobs_service
from services.api.jobs import submission
from shared.jobs.presenters import present_job
from shared.jobs.schemas import JobCreate, JobOut, JobPage, SimilarPage, SimilarVideo
from shared.jobs.states import request_cancel
from shared.jobs.status import JobStatus
from shared.messaging.dispatch import after_transition_commit
from shared.models import Job

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=ERROR_RESPONSES)


@router.post(
    "",
    status_code=202,
    response_model=JobOut,
    responses={
        403: {"model": ErrorBody, "description": POOL_NOT_ALLOWED_DESCRIPTION},
        429: {
            "model": ErrorBody,
            "description": QUEUE_FULL_DESCRIPTION,
            "headers": {"Retry-After": RETRY_AFTER_HEADER},
        },
    },
)
async def submit_job(
    body: JobCreate,
    request: Request,
    response: Response,
    settings: SettingsDep,
    tenant: TenantDep,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
    pool: PoolHeader = None,
) -> JobOut:
    job = await submission.submit(
        request,
        response,
        settings,
        tenant=tenant,
        body=body,
        idempotency_key=idempotency_key,
        location=lambda job: f"/v1/jobs/{job.id}",
        pool=pool,
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
    motion: Annotated[
        str | None,
        Query(
            max_length=64,
            description="only videos of this motion: a label (pan_left, zoom_in, static, …), a prototype (m3.17) "
            "or a variant (m3.pan_left.2); only succeeded jobs have one",
        ),
    ] = None,
) -> JobPage:
    store, size = request.app.state.store, pagination.page_size(limit, settings)
    jobs: list[Job]
    next_cursor: str | None
    if motion is not None:
        if status is not None and status is not JobStatus.SUCCEEDED:
            jobs, next_cursor = [], None  # only succeeded jobs are described
        else:
            jobs, next_cursor = await context_service.list_by_motion(
                store, tenant_id=tenant.id, motion=motion, limit=size, cursor=cursor
            )
    else:
        jobs, next_cursor = await jobs_service.list_jobs(
            store, tenant_id=tenant.id, status=status, limit=size, cursor=cursor
        )
    contexts = await context_service.contexts(store, tenant_id=tenant.id, jobs=jobs)
    storage, quote = request.app.state.storage, request.app.state.estimator.quote
    return JobPage(
        data=[
            present_job(j, settings=settings, storage=storage, estimate=quote(j), context=contexts.get(j.id))
            for j in jobs
        ],
        next_cursor=next_cursor,
    )


@router.get("/{job_id}", response_model=JobOut)
async def get_job(job_id: uuid.UUID, request: Request, settings: SettingsDep, tenant: TenantDep) -> JobOut:
    job = await jobs_service.read(request.app.state.store, tenant_id=tenant.id, job_id=job_id)
    estimate = request.app.state.estimator.quote(job)
    contexts = await context_service.contexts(request.app.state.store, tenant_id=tenant.id, jobs=[job])
    return present_job(
        job, settings=settings, storage=request.app.state.storage, estimate=estimate, context=contexts.get(job.id)
    )


@router.get(
    "/{job_id}/similar",
    response_model=SimilarPage,
    responses={409: {"model": ErrorBody, "description": "the job's video has no context (yet)"}},
)
async def similar_jobs(
    job_id: uuid.UUID,
    request: Request,
    settings: SettingsDep,
    tenant: TenantDep,
    limit: Annotated[int, Query(ge=1, le=context_service.SIMILAR_LIMIT_MAX)] = 10,
) -> SimilarPage:
    """The tenant's videos that look most like this one (cosine similarity of their keyframe embeddings, through an
    HNSW index), most similar first. Never another tenant's; only videos of the same model and embedding version."""
    store = request.app.state.store
    space, found = await context_service.similar(store, tenant_id=tenant.id, job_id=job_id, limit=limit)
    contexts = await context_service.contexts(store, tenant_id=tenant.id, jobs=[job for job, _ in found])
    storage = request.app.state.storage
    return SimilarPage(
        job_id=job_id,
        space=space,
        data=[
            SimilarVideo(
                similarity=round(similarity, 6),
                job=present_job(job, settings=settings, storage=storage, context=contexts.get(job.id)),
            )
            for job, similarity in found
        ],
    )


@router.post("/{job_id}/cancel", status_code=202, response_model=JobOut)
def cancel_job(
    job_id: uuid.UUID, request: Request, session: SessionDep, settings: SettingsDep, tenant: TenantDep
) -> JobOut:
    job = request_cancel(session, job_id, tenant_id=tenant.id)
    if JobStatus(job.status).is_terminal():  # cancelled while queued (a running job stops at its next step)
        after_transition_commit(session, request.app.state.celery, job)
    session.commit()
    return present_job(job, settings=settings, storage=request.app.state.storage)
