"""``GET /v1/jobs/{id}/events``: progress as Server-Sent Events, so clients see each denoising step without polling.

Events: ``progress`` (status, step, total, percent, attempt) whenever one of them changes, then one ``job`` event
with the whole job (as ``GET /v1/jobs/{id}`` returns it) once the job is finished, and the stream ends. A comment
line goes out every 15 s so proxies keep the connection open (sse-starlette frames the events, sends the pings
and stops the stream when the client goes away).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from sse_starlette import EventSourceResponse, ServerSentEvent

from services.api import jobs_service
from services.api.deps import SessionDep, TenantDep
from shared.db import session_scope
from shared.presenters import present_job
from shared.schemas import ERROR_RESPONSES
from shared.states import JobStatus

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=ERROR_RESPONSES)
KEEPALIVE_S = 15.0


def _event(event: str, data: dict[str, Any]) -> ServerSentEvent:
    return ServerSentEvent(data=json.dumps(data, default=str), event=event)


@router.get(
    "/{job_id}/events",
    response_class=EventSourceResponse,
    responses={200: {"content": {"text/event-stream": {}}, "description": "progress events, then the finished job"}},
)
def job_events(job_id: uuid.UUID, request: Request, session: SessionDep, tenant: TenantDep) -> EventSourceResponse:
    jobs_service.get_job(session, tenant_id=tenant.id, job_id=job_id)  # 404 before the stream starts
    settings = request.app.state.settings
    storage = request.app.state.storage
    tenant_id = tenant.id

    def snapshot() -> dict[str, Any]:
        with session_scope(settings) as s:
            job = jobs_service.get_job(s, tenant_id=tenant_id, job_id=job_id)
            return present_job(job, settings=settings, storage=storage).model_dump(mode="json")

    async def stream() -> AsyncIterator[ServerSentEvent]:
        started = time.monotonic()
        last: dict[str, Any] | None = None
        while time.monotonic() - started < settings.events_max_s:
            job = await run_in_threadpool(snapshot)
            progress = {"status": job["status"], "attempt": job["attempt"], **job["progress"]}
            if progress != last:
                yield _event("progress", progress)
                last = progress
            if JobStatus(job["status"]).is_terminal():
                yield _event("job", job)
                return
            await asyncio.sleep(settings.events_poll_s)

    return EventSourceResponse(stream(), ping=KEEPALIVE_S, headers={"Cache-Control": "no-cache"})
