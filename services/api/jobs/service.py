"""Submitting and reading jobs: the API's logic, kept out of the route functions.

The hot paths (submit, read, list) run on the async store (services/api/store.py): a plain submit is two statements,
each its own transaction (the result-cache lookup, then the INSERT); reads are one statement. A job's
row is built in one place, ``job_values``; ``create_job`` inserts the same row through a SQLAlchemy session for
callers that have one (the sweeper's tests, tools).

Result cache: a submit whose resolved spec equals that of a succeeded job of the same tenant (the same
``result_key``, shared/spec.py) is inserted ``succeeded``, pointing at that job's stored objects (``result_of``, no
bytes copied), unless the request says ``"cache": false``. One S3 HEAD first confirms the video is still stored
(it may have been deleted, expired, or the bucket reset); otherwise, or if S3 does not answer in
``result_cache_check_timeout_s``, the job renders. Nothing is sent to a video queue for a cached job; its webhook
goes out as any finished job's."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from psycopg import AsyncConnection
from psycopg.rows import TupleRow
from sqlalchemy.orm import Session

from services.api import pagination
from services.api.store import JobStore, ResultSource
from shared.errors import Conflict, IdempotencyKeyReused, InvalidRequest, NotFound
from shared.infra.config import Settings
from shared.infra.tracing import current_traceparent
from shared.jobs.schemas import JobCreate
from shared.jobs.scoring import score_job
from shared.jobs.states import RESULT_CACHE, audit, served_from_cache
from shared.jobs.status import JobStatus
from shared.models import ApiFlavour, Job
from shared.pools.rules import DEFAULT_ROUTE, Route
from shared.queues import PriorityClass
from shared.spec import GenerationSpec

log = logging.getLogger("vidq.api.jobs")

if TYPE_CHECKING:
    from services.api.deps import Caller


def job_values(
    settings: Settings,
    *,
    tenant_id: uuid.UUID,
    body: JobCreate,
    spec: GenerationSpec,
    flavour: ApiFlavour = ApiFlavour.VIDQ,
    job_id: uuid.UUID | None = None,
    route: Route = DEFAULT_ROUTE,
) -> dict[str, Any]:
    """A new job's row (attribute names of ``Job``): queued, scored, with its resolved spec and its result key (every
    job has one, whether or not its request used the cache, so that later identical requests can match it), the
    API it came through (``flavour``: the shape of its webhook), and its worker pool (``route``)."""
    score = score_job(settings, prompt=spec.prompt, width=spec.width, height=spec.height, duration_s=body.duration_s)
    return {
        "id": job_id or uuid.uuid4(),
        "tenant_id": tenant_id,
        "status": JobStatus.QUEUED.value,
        "spec": spec.to_dict(),
        "result_key": spec.result_key(),
        "duration_s": body.duration_s,
        "webhook_url": body.webhook_url,
        "metadata_": body.metadata,
        "score": score.value,
        "score_complexity": score.complexity,
        "score_resolution": score.resolution,
        "score_duration": score.duration,
        "priority_class": score.priority_class.value,
        "attempt": 0,
        "max_attempts": settings.max_attempts,
        "timings": {},
        "api_flavour": flavour.value,
        "pool": route.pool,
        "routed_by": route.routed_by.value,
        "traceparent": current_traceparent(),  # the creating request's trace: every later hop of the job continues it
    }


def create_job(session: Session, settings: Settings, *, tenant: Caller, body: JobCreate) -> Job:
    """Insert the job row through a session (flush only; the caller registers the send and commits): always
    queued, with its result key but no result-cache lookup (that is the API's submit)."""
    job = Job(**job_values(settings, tenant_id=tenant.id, body=body, spec=body.to_spec(settings)))
    session.add(job)
    session.flush()
    return job


# Whether an object is still stored (the result cache reuses a job's video only while it is): the route passes the
# process's S3 client, run in a thread.
Stored = Callable[[str], Awaitable[bool]]
# The admission check of a job of a class that would wait in its queue (services/api/jobs/watermark.py): returns, or
# raises QueueFull.
Admit = Callable[[PriorityClass, uuid.UUID], Awaitable[None]]
# The worker pool of a new job, given its id (services/api/pools.py): raises for a pool header the tenant may not
# send.
Router = Callable[[uuid.UUID], Route]


async def submit(
    store: JobStore,
    settings: Settings,
    *,
    tenant: Caller,
    body: JobCreate,
    idempotency_key: str | None,
    stored: Stored | None = None,
    admit: Admit | None = None,
    flavour: ApiFlavour = ApiFlavour.VIDQ,
    route: Router | None = None,
) -> tuple[Job, bool]:
    """Returns (job, created), committed. With an Idempotency-Key, the same key and body return the first job; the
    same key with another body is refused. The key row and the job row commit together, in one transaction.
    ``admit``: asked before a job that would wait in its queue is written (not for a replay, nor for a job served
    from the result cache); a refusal writes nothing. ``flavour``: the API the request came through (``/v1/jobs``
    or ``/v1/videos``). ``route``: the new job's worker pool by its id (none: stable); a pool the tenant may not
    choose is refused before anything is written."""
    spec = body.to_spec(settings)  # a body over the caps is refused before anything is looked up or written
    if idempotency_key is not None and not 1 <= len(idempotency_key) <= 200:
        raise InvalidRequest("Idempotency-Key must be 1..200 characters")
    job_id = uuid.uuid4()
    values = job_values(
        settings,
        tenant_id=tenant.id,
        body=body,
        spec=spec,
        flavour=flavour,
        job_id=job_id,
        route=DEFAULT_ROUTE if route is None else route(job_id),
    )
    # The result-cache candidate is checked before the insert's transaction (no connection held across an S3 call).
    source = await _reusable_source(store, values, stored) if body.cache else None
    queued = admit if source is None else None  # a job served from the result cache never waits
    if idempotency_key is None:
        if source is not None:
            async with store.transaction() as conn:
                return await _insert(store, conn, values, source=source), True
        if queued is not None:
            await queued(PriorityClass(values["priority_class"]), values["id"])
        async with store.connection() as conn:  # one INSERT: its own transaction
            return await store.insert(conn, values), True
    fingerprint = body.fingerprint()
    try:
        async with store.transaction() as conn:
            existing = await store.live_key(conn, tenant_id=tenant.id, key=idempotency_key)
            if existing is None:
                if queued is not None:  # a new job: only now is it known that it will wait (a replay does not)
                    await queued(PriorityClass(values["priority_class"]), values["id"])
                job = await _insert(store, conn, values, source=source)
                expires_at = datetime.now(UTC) + timedelta(seconds=settings.idempotency_ttl_s)
                if not await store.claim_key(
                    conn,
                    tenant_id=tenant.id,
                    key=idempotency_key,
                    request_hash=fingerprint,
                    job_id=job.id,
                    expires_at=expires_at,
                ):
                    raise _KeyTaken  # rolls back our job row
                return job, True
    except _KeyTaken:
        # A concurrent request with the same key won the race: answer with theirs.
        async with store.transaction() as conn:
            existing = await store.live_key(conn, tenant_id=tenant.id, key=idempotency_key)
        if existing is None:  # theirs expired in the same instant: let the client retry
            raise Conflict("this Idempotency-Key is being reused concurrently; retry the request") from None
    return await _replay(store, tenant=tenant, existing=existing, fingerprint=fingerprint), False


async def _reusable_source(store: JobStore, values: dict[str, Any], stored: Stored | None) -> ResultSource | None:
    """The tenant's succeeded job with the same result key, if its video is still stored. A video that is gone
    (deleted, expired, a bucket that was reset) or that S3 cannot confirm now means a render, never a broken link."""
    async with store.connection() as conn:
        source = await store.result_source(conn, tenant_id=values["tenant_id"], result_key=values["result_key"])
    if source is None or stored is None:
        return source
    key = source.output.get("output_key")
    try:
        if key and await stored(str(key)):
            return source
    except Exception as exc:  # S3 unreachable or refusing: render instead
        log.warning("result cache: stored video not confirmed; rendering", extra={"error": repr(exc)[:200]})
    return None


async def _insert(
    store: JobStore, conn: AsyncConnection[TupleRow], values: dict[str, Any], *, source: ResultSource | None
) -> Job:
    """Insert the new job in the caller's transaction: served from the result cache when ``source`` (a succeeded job
    of the tenant with the same result key, its video still stored) is given, else queued (the caller sends it after
    the commit)."""
    if source is not None:
        # Read again in this transaction: its clock stamps the new row (created = started = finished), and the
        # source is the one whose video was confirmed.
        current = await store.result_source(conn, tenant_id=values["tenant_id"], result_key=values["result_key"])
        if current is not None and current.job_id == source.job_id:
            return await _insert_cached(store, conn, values, current)
    return await store.insert(conn, values)


async def _insert_cached(
    store: JobStore, conn: AsyncConnection[TupleRow], values: dict[str, Any], source: ResultSource
) -> Job:
    """The job inserted succeeded, with ``source``'s stored objects (the same keys) and a reference to it; scored
    like any job (the same row shape). Its one audit row: created succeeded, reason ``result_cache``."""
    steps = int(values["spec"]["steps"])
    job = await store.insert(
        conn,
        {
            **values,
            **served_from_cache(now=source.now, webhook_url=values["webhook_url"]),
            **source.output,
            "result_of": source.job_id,
            "progress_step": steps,
            "progress_total": steps,
            "timings": {"result_cache": True},  # no render stage ran
        },
    )
    await store.record_transition(
        conn, audit(job_id=job.id, src=None, dst=JobStatus.SUCCEEDED, attempt=0, reason=RESULT_CACHE)
    )
    return job


class _KeyTaken(Exception):
    """Another transaction holds this Idempotency-Key: ours must roll back."""


async def _replay(store: JobStore, *, tenant: Caller, existing: tuple[str, uuid.UUID], fingerprint: str) -> Job:
    request_hash, job_id = existing
    if request_hash != fingerprint:
        raise IdempotencyKeyReused(
            "this Idempotency-Key was used with a different request body", details={"job_id": str(job_id)}
        )
    return await read(store, tenant_id=tenant.id, job_id=job_id)


async def read(store: JobStore, *, tenant_id: uuid.UUID, job_id: uuid.UUID) -> Job:
    async with store.connection() as conn:
        job = await store.get(conn, tenant_id=tenant_id, job_id=job_id)
    if job is None:  # another tenant's id is indistinguishable from a missing one (404, never 403)
        raise NotFound("job not found")
    return job


async def list_jobs(
    store: JobStore, *, tenant_id: uuid.UUID, status: JobStatus | None, limit: int, cursor: str | None
) -> tuple[list[Job], str | None]:
    """Newest first, ``limit`` a page, with the cursor of the next page (keyset: stable while jobs are added)."""
    after = pagination.decode_cursor(cursor) if cursor is not None else None
    async with store.connection() as conn:
        rows = await store.page(
            conn, tenant_id=tenant_id, status=status, limit=pagination.read_size(limit), after=after
        )
    page, more = pagination.split(rows, limit)
    return page, pagination.encode_cursor(page[-1].created_at, page[-1].id) if more else None
