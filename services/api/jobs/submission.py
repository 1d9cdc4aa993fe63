"""What both submit endpoints (``POST /v1/jobs`` and OpenAI's ``POST /v1/videos``) do: the service's submit, with the
result cache's check that a video is still stored, then what follows the commit."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable

from fastapi import Request, Response

from services.api.deps import Caller
from services.api.jobs import service as jobs_service
from services.api.metrics import RESULT_CACHE_HITS, SUBMITS
from shared.infra.config import Settings
from shared.infra.storage import Storage
from shared.jobs.schemas import JobCreate
from shared.messaging.dispatch import send_committed
from shared.models import ApiFlavour, Job
from shared.pools.rules import HEADER as POOL_HEADER
from shared.pools.rules import Route


async def submit(
    request: Request,
    response: Response,
    settings: Settings,
    *,
    tenant: Caller,
    body: JobCreate,
    idempotency_key: str | None,
    location: Callable[[Job], str],
    flavour: ApiFlavour = ApiFlavour.VIDQ,
    pool: str | None = None,
) -> Job:
    """The job, committed (the row and its idempotency key), its message sent and ``Location`` set to
    ``location(job)``. ``pool``: the request's ``X-Vidq-Pool`` header (shared/pools/rules.py)."""
    router = request.app.state.pools
    routes: list[Route] = []

    def route(job_id: uuid.UUID) -> Route:
        routes.append(router.route(tenant.id, job_id, requested=pool or None))
        return routes[-1]

    job, created = await jobs_service.submit(
        request.app.state.store,
        settings,
        tenant=tenant,
        body=body,
        idempotency_key=idempotency_key,
        stored=video_stored(request.app.state.storage, settings),
        admit=request.app.state.watermark.check,
        flavour=flavour,
        route=route,
    )
    after_submit(request, response, job, created=created, location=location(job))
    if created and routes:
        router.routed(routes[-1])
    return job


def video_stored(storage: Storage, settings: Settings) -> Callable[[str], Awaitable[bool]]:
    """Whether the object ``key`` is stored: the result cache reuses a video only while it is (bounded in time)."""

    async def stored(key: str) -> bool:
        return await asyncio.wait_for(asyncio.to_thread(storage.exists, key), settings.result_cache_check_timeout_s)

    return stored


def after_submit(request: Request, response: Response, job: Job, *, created: bool, location: str) -> None:
    """What follows a committed submit: a new job's message and counts, or the replay header for an idempotent
    repeat; and where the job lives."""
    if created:
        # The message follows the commit: the video queue for a queued job; for one served from the result cache
        # (created succeeded) no render, only its webhook when it has a URL.
        send_committed(request.app.state.celery, job)
        request.app.state.estimator.admitted(job)  # the quotes of the next submits count it ahead of them
        SUBMITS.labels(priority_class=job.priority_class).inc()
        if job.result_of is not None:
            RESULT_CACHE_HITS.inc()
    else:
        response.headers["Idempotent-Replayed"] = "true"
    response.headers["Location"] = location
    response.headers[POOL_HEADER] = job.pool  # the worker pool, for either API's clients
