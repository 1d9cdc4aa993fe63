"""``GET /v1/jobs/{id}/events``: progress as Server-Sent Events, so clients see each denoising step without polling.

Events: ``progress`` (status, attempt, step, total, percent) whenever one of them moves forward, then one ``job``
event with the whole job (as ``GET /v1/jobs/{id}`` returns it) once the job is finished, and the stream ends. A
comment line goes out every 15 s so proxies keep the connection open (sse-starlette frames the events, sends the
pings and stops the stream when the client goes away).

An open stream holds no database connection and does not poll: the worker publishes each step to Redis and the
process's ``ProgressHub`` (shared/messaging/progress.py) hands it to the stream. Postgres is read in short
transactions only: the caller's key and the job at open, and the job again when the worker says it finished, or after
``events_resync_s`` without a message (a message lost to a Redis restart; the sweeper's recoveries publish
nothing, and this re-read is what ends or updates their streams).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.types import Receive, Scope, Send

from services.api.deps import TenantDep
from services.api.error_handlers import ERROR_RESPONSES
from services.api.jobs import service as jobs_service
from services.api.jobs.progress_hub import ProgressHub, Subscription
from services.api.store import JobStore
from shared.errors import NotFound
from shared.infra.config import Settings
from shared.infra.storage import Storage
from shared.jobs.presenters import present_job
from shared.jobs.status import JobStatus
from shared.messaging.progress import ProgressUpdate, Signal

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=ERROR_RESPONSES)
log = logging.getLogger("vidq.api.events")
KEEPALIVE_S = 15.0
# A failed re-read (a database blip) is retried this soon, not after a whole resync period: the stream owes its
# client the final ``job`` event.
RETRY_READ_S = 1.0

# Same attempt: running < queued again (a release for retry) < finished.
_STATUS_ORDER = {JobStatus.RUNNING.value: 0, JobStatus.QUEUED.value: 1}


def _event(event: str, data: dict[str, Any]) -> ServerSentEvent:
    return ServerSentEvent(data=json.dumps(data, default=str), event=event)


async def _read_job(
    *, store: JobStore, settings: Settings, storage: Storage, tenant_id: uuid.UUID, job_id: uuid.UUID
) -> dict[str, Any]:
    """The job as GET /v1/jobs/{id} shows it, in one short transaction of the API's async pool."""
    job = await jobs_service.read(store, tenant_id=tenant_id, job_id=job_id)
    return present_job(job, settings=settings, storage=storage).model_dump(mode="json")


def _from_job(job: dict[str, Any]) -> dict[str, Any]:
    return {"status": job["status"], "attempt": job["attempt"], **job["progress"]}


def _from_update(update: ProgressUpdate) -> dict[str, Any]:
    total = update.total
    percent = round(100.0 * update.step / total, 1) if total else 0.0  # as shared/jobs/presenters.py computes it
    return {"status": update.status, "attempt": update.attempt, "step": update.step, "total": total, "percent": percent}


def _order(progress: dict[str, Any]) -> tuple[int, int, int]:
    return progress["attempt"], _STATUS_ORDER.get(progress["status"], 2), progress["step"]


class _Progress:
    """What the client has seen. Messages and reads can arrive out of order (a step published before the read that
    already includes it; Postgres's step lags the published one, its writes are throttled), so only progress that
    moves forward goes out: a later attempt, a later state of the same attempt, or a later step."""

    def __init__(self) -> None:
        self.last: dict[str, Any] | None = None

    def advance(self, progress: dict[str, Any]) -> bool:
        if self.last is not None and _order(progress) <= _order(self.last):
            return False
        self.last = progress
        return True


class _StreamResponse(EventSourceResponse):
    """Releases the stream's subscription however the response ends, also when its body never started (a HEAD
    request, a client gone before the first byte)."""

    def __init__(self, content: AsyncIterator[ServerSentEvent], *, subscription: Subscription, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._subscription = subscription

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._subscription.close()


@router.get(
    "/{job_id}/events",
    response_class=EventSourceResponse,
    responses={200: {"content": {"text/event-stream": {}}, "description": "progress events, then the finished job"}},
)
async def job_events(job_id: uuid.UUID, request: Request, tenant: TenantDep) -> EventSourceResponse:
    settings: Settings = request.app.state.settings
    hub: ProgressHub = request.app.state.progress_hub
    read = partial(
        _read_job,
        store=request.app.state.store,
        settings=settings,
        storage=request.app.state.storage,
        tenant_id=tenant.id,
        job_id=job_id,
    )
    # Subscribe before the first read: whatever the worker publishes after that read reaches this stream.
    subscription = await hub.subscribe(job_id)
    try:
        job = await read()  # 404 here, before the stream starts
    except BaseException:
        subscription.close()
        raise
    return _StreamResponse(
        _stream(job, subscription=subscription, read=read, settings=settings, job_id=job_id),
        subscription=subscription,
        ping=KEEPALIVE_S,
        headers={"Cache-Control": "no-cache"},
    )


async def _stream(
    job: dict[str, Any] | None,
    *,
    subscription: Subscription,
    read: Callable[[], Awaitable[dict[str, Any]]],
    settings: Settings,
    job_id: uuid.UUID,
) -> AsyncIterator[ServerSentEvent]:
    seen = _Progress()
    deadline = time.monotonic() + settings.events_max_s
    wait_s = settings.events_resync_s
    try:
        while True:
            if job is not None:
                if seen.advance(progress := _from_job(job)):
                    yield _event("progress", progress)
                if JobStatus(job["status"]).is_terminal():
                    yield _event("job", job)
                    return
                job = None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return  # the client reconnects
            message = await subscription.get(timeout=min(wait_s, remaining))
            if isinstance(message, ProgressUpdate):
                if seen.advance(progress := _from_update(message)):
                    yield _event("progress", progress)
                continue
            if message is Signal.CLOSED or (message is None and time.monotonic() >= deadline):
                return
            # FINISHED, RESYNC or a long silence: Postgres says where the job is.
            try:
                job = await read()
                wait_s = settings.events_resync_s
            except NotFound:
                return
            except Exception as exc:  # a database blip must not end the stream without its final event
                log.warning("progress stream re-read failed", extra={"job_id": str(job_id), "error": repr(exc)})
                wait_s = RETRY_READ_S
    finally:
        subscription.close()
