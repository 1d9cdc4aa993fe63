"""One job, start to end: claim → render → encode → upload → finalize → webhook → context. A plain function the thin
Celery task calls; everything it does is fenced by the attempt number it claimed. Each stage is a span of the job's
trace (shared/infra/tracing.py; no-ops while tracing is off).

The task's part ends with the render: what follows (encode to context) runs on the finisher thread
(services/worker/finisher.py) while the task returns and the next job renders, unless ``worker_overlap`` is off."""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from functools import partial
from typing import TypeVar

from celery.exceptions import SoftTimeLimitExceeded
from opentelemetry import trace
from sqlalchemy.orm import Session
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_delay

from services.worker.batching import Claimed, gather_riders
from services.worker.context import describe
from services.worker.finisher import finisher
from services.worker.lease import Lease
from services.worker.metrics import BUSY, FAILURES, JOBS, QUEUE_WAIT
from services.worker.render import TRANSIENT, Rendered, backoff, render_members, store
from services.worker.scheduling import busy, job_done, render_cost
from shared.errors import EmbeddingsUnavailable, JobCancelled, LeaseLost, ModelUnavailable
from shared.infra.config import Settings
from shared.infra.db import db_unreachable, session_scope
from shared.infra.storage import Storage
from shared.infra.tracing import continuing, stage_span
from shared.jobs.fairness import claim_next
from shared.jobs.states import cancelled_by_worker, claim, fail, release_for_retry, succeed
from shared.jobs.status import JobStatus
from shared.messaging.celery_app import VidqCelery
from shared.messaging.dispatch import after_transition_commit
from shared.messaging.progress import ProgressPublisher
from shared.models import Job
from shared.queues import STABLE_POOL, PriorityClass

log = logging.getLogger("vidq.worker.runner")

T = TypeVar("T")


class ClaimDeferred(Exception):
    """Postgres did not answer for ``worker_claim_wait_s``: the task re-publishes its message (tasks.py)."""


def _retry_db(fn: Callable[[], T], *, settings: Settings, deadline: float, what: str, ctx: dict[str, str]) -> T:
    """``fn()`` again and again while Postgres is unreachable, until ``deadline`` (time.monotonic()); then the
    last error is raised. Any other error is raised at once."""

    def log_wait(state: RetryCallState) -> None:
        if state.attempt_number % 30 == 1:  # once at the start, then about every 30 s at the cap
            error = state.outcome.exception() if state.outcome else None
            log.warning(f"Postgres unreachable at {what}; retrying", extra={**ctx, "error": repr(error)[:300]})

    retrying = Retrying(
        retry=retry_if_exception(db_unreachable),
        stop=stop_after_delay(max(0.0, deadline - time.monotonic())),
        wait=backoff(settings),
        before_sleep=log_wait,
        reraise=True,
    )
    return retrying(fn)


def _settle(settings: Settings, celery: VidqCelery, transition: Callable[[Session], Job | None]) -> Job | None:
    """One transition out of ``running`` in its own unit of work; what must follow it goes out after the commit
    (shared/messaging/dispatch.py ``after_transition_commit``). None when the fencing token no longer holds."""
    with session_scope(settings) as session:
        job = transition(session)
        if job is not None:
            after_transition_commit(session, celery, job)
        return job


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def run_job(
    job_id: uuid.UUID,
    *,
    klass: PriorityClass | None,
    pool: str = STABLE_POOL,
    settings: Settings,
    celery: VidqCelery,
    storage: Storage,
    progress: ProgressPublisher,
) -> str:
    """Returns what happened to the message's job for logs and tests: "rendered" once its render is handed to the
    finisher (``worker_overlap``; its end is counted there), else how it ended ("succeeded", "dropped", "cancelled",
    "failed", …). Every job's end is counted in ``vidq_worker_jobs_total`` where it happens.

    ``klass``: the class whose queue (of ``pool``) the message came from. The message is then that class's turn in
    the pool, and the job claimed is the class's next one in the pool's fair order between tenants
    (shared/jobs/fairness.py), usually ``job_id`` itself. None: exactly ``job_id`` is claimed, or nothing.

    ``progress`` tells the API's progress streams about the claim, each step, and every commit that takes the job
    out of running ("finished": they read Postgres for the rest). It never raises; a lost message only delays a
    stream until its resync."""
    try:
        outcome = _run_job(
            job_id, klass=klass, pool=pool, settings=settings, celery=celery, storage=storage, progress=progress
        )
    except Exception as exc:
        # Only after the claim (a claim that cannot reach Postgres raises ClaimDeferred): the database stayed
        # down through every retry of the release, fail or cancel. The job is left running under a lease nobody
        # renews; the sweeper hands it back when the lease expires. Nothing here may take the worker down.
        if not db_unreachable(exc):
            raise
        log.warning(
            "Postgres unreachable after the claim; the lease expiry hands the job back",
            extra={"job_id": str(job_id), "error": repr(exc)[:300]},
        )
        return _counted("abandoned", celery)
    return outcome


def _counted(outcome: str, celery: VidqCelery) -> str:
    """``outcome``, counted in the metrics and, for a job that left the queue for good or for another attempt, in
    the fleet's service rate."""
    JOBS.labels(outcome, celery.settings.worker_pool).inc()
    if outcome not in ("dropped", "abandoned"):
        job_done(celery)
    return outcome


def _run_job(
    message_job_id: uuid.UUID,
    *,
    klass: PriorityClass | None,
    pool: str,
    settings: Settings,
    celery: VidqCelery,
    storage: Storage,
    progress: ProgressPublisher,
) -> str:
    ctx = {"job_id": str(message_job_id)}

    # 1. Claim: the conditional UPDATE makes a redelivered or duplicate message a no-op, or (a class's turn) the claim
    #    of the class's next job in the fair order.
    def claim_once() -> Claimed | None:
        with session_scope(settings) as session:
            if klass is None:
                job = claim(session, message_job_id, worker_id=worker_id(), lease_s=settings.lease_s)
            else:
                job = claim_next(
                    session,
                    klass,
                    offered=message_job_id,
                    worker_id=worker_id(),
                    lease_s=settings.lease_s,
                    weights=settings.fair_share_weights,
                    pool=pool,
                )
            if job is None:
                return None
            trace.get_current_span().set_attributes(
                {
                    "vidq.job_id": str(job.id),
                    "vidq.attempt": job.attempt,
                    "vidq.model": job.spec.get("model", ""),
                    "vidq.queue": job.queue,
                }
            )
            if job.attempt == 1 and job.started_at is not None:  # a retry's wait would count the failed attempt
                QUEUE_WAIT.labels(job.priority_class, job.pool).observe(
                    (job.started_at - job.created_at).total_seconds()
                )
            return Claimed.of(job)

    # Postgres down: the message is this job's only pointer in the broker (acks_late: it is acked when the task
    # returns), so the worker holds it and retries the claim until the database answers — the job then runs the
    # outage plus at most worker_db_retry_max_s later. Dropping it would leave the job queued with nothing to send
    # it again but the sweeper's queued_resend_s (30 min) or aging. Because the message is never lost, the sweeper
    # needs no new rule for "consumed but never claimed". Past worker_claim_wait_s (below the task's soft time
    # limit) the task re-publishes the message instead. A claim whose COMMIT reached Postgres but whose answer was
    # lost finds the job running on retry and drops the message: the lease (never renewed) expires and the
    # sweeper re-queues the job.
    try:
        with stage_span("claim", {"vidq.job_id": str(message_job_id)}):
            claimed = _retry_db(
                claim_once,
                settings=settings,
                deadline=time.monotonic() + settings.worker_claim_wait_s,
                what="claim",
                ctx=ctx,
            )
    except Exception as exc:
        if db_unreachable(exc):
            raise ClaimDeferred(f"Postgres unreachable for {settings.worker_claim_wait_s:.0f} s") from exc
        raise
    if claimed is None:
        log.info("nothing to claim (already running, finished or cancelled); message dropped", extra=ctx)
        return _counted("dropped", celery)
    # Compatible jobs waiting in the same class ride along in one batch where the batch table says it pays.
    riders = (
        gather_riders(claimed, klass=klass, pool=pool, celery=celery, worker=worker_id()) if klass is not None else []
    )
    # Another job than the message's (its tenant's turn came first): its stages go to its own trace.
    traceparent = claimed.traceparent if claimed.job_id != message_job_id else None
    with continuing(traceparent):
        return _run_members([claimed, *riders], settings=settings, celery=celery, storage=storage, progress=progress)


def _run_members(
    members: list[Claimed], *, settings: Settings, celery: VidqCelery, storage: Storage, progress: ProgressPublisher
) -> str:
    """Render the claimed jobs (one, or a batch), then see each to its end: stored and finalized, or released,
    failed or cancelled on its own — on the finisher thread (``worker_overlap``: the task returns "rendered" and the
    pool process takes its next job meanwhile), or here. Each job has its own lease, fencing token, progress and
    cancel from its claim until its end. Returns the first member's outcome (the message's job)."""
    leases = []
    try:
        for member in members:
            log.info("claimed", extra={"job_id": str(member.job_id), "attempt": str(member.token)})
            progress.progress(
                member.job_id, status=JobStatus.RUNNING.value, step=0, total=member.spec.steps, attempt=member.token
            )
            leases.append(Lease(settings, job_id=member.job_id, token=member.token, progress=progress).__enter__())
        with BUSY.track_inprogress(), busy():
            rendered = render_members(members, leases, celery=celery)
        finish = partial(
            _finish,
            members,
            leases,
            rendered,
            rendered_at=time.monotonic(),
            settings=settings,
            celery=celery,
            storage=storage,
        )
        if not settings.worker_overlap:
            return finish()[0]
        finisher(settings.worker_overlap_depth).submit(finish)  # waits while the finisher's line is full
    except BaseException:
        # Before the hand-over (a soft time limit, a shutdown): the jobs stay running under leases nobody renews,
        # and the sweeper hands them back when those expire.
        for lease in leases:
            lease.__exit__(None, None, None)
        raise
    return "rendered"


def _finish(
    members: list[Claimed],
    leases: list[Lease],
    rendered: list[Rendered | Exception],
    *,
    rendered_at: float,
    settings: Settings,
    celery: VidqCelery,
    storage: Storage,
) -> list[str]:
    """Each rendered member to its end, in order, each counted; a member whose end could not be written (Postgres
    down through every retry, or a bug) is left to its lease, and the others go on."""
    outcomes = []
    try:
        for member, lease, result in zip(members, leases, rendered, strict=True):
            ctx = {"job_id": str(member.job_id), "attempt": str(member.token)}
            try:
                outcome = _complete(
                    member, lease, result, rendered_at=rendered_at, settings=settings, celery=celery, storage=storage
                )
            except Exception as exc:
                if db_unreachable(exc):
                    log.warning(
                        "Postgres unreachable after the render; the lease expiry hands the job back",
                        extra={**ctx, "error": repr(exc)[:300]},
                    )
                else:
                    log.exception("the job's end failed; the lease expiry hands the job back", extra=ctx)
                outcome = "abandoned"
            outcomes.append(_counted(outcome, celery))
            log.info("job done", extra={**ctx, "outcome": outcome, "batch": len(members)})
    finally:
        for lease in leases:  # those _complete did not close (it raised)
            lease.__exit__(None, None, None)
    return outcomes


def _complete(
    member: Claimed,
    lease: Lease,
    rendered: Rendered | Exception,
    *,
    rendered_at: float,
    settings: Settings,
    celery: VidqCelery,
    storage: Storage,
) -> str:
    """One rendered job's end: its video stored and the job finalized, or what its error calls for. ``rendered_at``
    (time.monotonic()): when its render ended, so its time on the GPU is known apart from its finish."""
    job_id, token, tenant_id, spec = member.job_id, member.token, member.tenant_id, member.spec
    ctx = {"job_id": str(job_id), "attempt": str(token)}
    try:
        try:
            if isinstance(rendered, Exception):
                raise rendered
            outcome = store(spec, rendered, celery=celery, storage=storage, lease=lease, tenant_id=tenant_id)
            # The seconds this job held the worker, claim to stored video (a batch's member: the batch's so far).
            worker_s = round(time.monotonic() - member.claimed_at, 4)
            timings = outcome["timings"]
            assert isinstance(timings, dict)
            timings["worker"] = worker_s
            # The seconds it held the worker's render path, claim to rendered: what the next job waited for while
            # finishes overlap (what its ETA cost sample records then).
            timings["occupied"] = round(rendered_at - member.claimed_at, 4)
        finally:
            lease.__exit__(None, None, None)

        # 5. Finalize only with our fencing token: a stale attempt changes nothing, so retrying it while Postgres
        #    is down is safe (for up to a lease: by then the sweeper may have handed the job to another attempt).
        def finalize() -> Job | None:
            return _settle(settings, celery, lambda s: succeed(s, job_id, token=token, output=outcome))

        with stage_span("finalize", {"vidq.job_id": str(job_id), "vidq.attempt": token}):
            done = _retry_db(
                finalize, settings=settings, deadline=time.monotonic() + settings.lease_s, what="finalize", ctx=ctx
            )
        if done is None:
            log.warning("finalize refused: fencing token is stale", extra=ctx)
            return "stale"
        # What this job cost the worker, for the ETA quotes (a batch member: its share): claim to stored video, or,
        # while finishes overlap the next render, claim to rendered (the next job starts then).
        occupied = timings["occupied"] if settings.worker_overlap else worker_s
        render_cost(celery, spec, {**rendered.result.timings_s, "elapsed": occupied})
        # 6. What the video is about: after the job is final and its webhook on its way; never fails the job.
        with stage_span("context", {"vidq.job_id": str(job_id)}):
            describe(
                settings,
                job_id=job_id,
                tenant_id=uuid.UUID(str(tenant_id)),
                model=spec.model,
                frames=rendered.result.frames,
                keyframes=rendered.result.keyframes,
            )
        return "succeeded"
    except JobCancelled:
        _settle(settings, celery, lambda s: cancelled_by_worker(s, job_id, token=token))
        log.info("cancelled at a denoising step", extra=ctx)
        return "cancelled"
    except LeaseLost:
        log.warning("lease lost; another attempt owns the job", extra=ctx)
        return "stale"
    except SoftTimeLimitExceeded:
        return _fail(
            settings,
            celery,
            job_id=job_id,
            token=token,
            code="time_limit",
            message="task time limit",
        )
    except TRANSIENT as exc:
        # Transient (DB, S3, network, no text encoder answering): hand the job back for another attempt, or fail
        # once attempts are spent.
        log.warning("transient failure", extra={**ctx, "error": repr(exc)})
        unavailable = isinstance(exc, EmbeddingsUnavailable)
        reason = "embeddings_unavailable" if unavailable else f"transient: {type(exc).__name__}"

        def release() -> Job | None:
            return _settle(settings, celery, lambda s: release_for_retry(s, job_id, token=token, reason=reason))

        # The release needs Postgres too: retried for up to a lease; past that run_job leaves the job to its lease.
        released = _retry_db(
            release, settings=settings, deadline=time.monotonic() + settings.lease_s, what="release", ctx=ctx
        )
        if released is not None:  # queued again: its next message and a notice to its streams follow the commit
            return "retrying"
        return _fail(
            settings,
            celery,
            job_id=job_id,
            token=token,
            code="embeddings_unavailable" if unavailable else "transient_exhausted",
            message=str(exc) if unavailable else repr(exc),
        )
    except Exception as exc:
        from shared.render.pipeline import PermanentRenderError, RenderOutOfMemory

        if isinstance(exc, RenderOutOfMemory):
            code = "out_of_memory"
        elif isinstance(exc, ModelUnavailable):
            code = "model_unavailable"
        elif isinstance(exc, PermanentRenderError):
            code = "invalid_for_model"
        else:
            code = "render_failed"
        if code == "model_unavailable":
            log.warning("model unavailable: its breaker is open", extra={**ctx, "error": str(exc)})
        else:
            log.exception("render failed", extra=ctx)
        return _fail(settings, celery, job_id=job_id, token=token, code=code, message=f"{exc}")


def _fail(
    settings: Settings,
    celery: VidqCelery,
    *,
    job_id: uuid.UUID,
    token: int,
    code: str,
    message: str,
) -> str:
    FAILURES.labels(code, settings.worker_pool).inc()
    _settle(settings, celery, lambda s: fail(s, job_id, token=token, code=code, message=message))
    return "failed"
