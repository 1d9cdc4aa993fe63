"""One job, start to end: claim → render → encode → upload → finalize → webhook. A plain function the thin
Celery task calls; everything it does is fenced by the attempt number it claimed. Each stage is a span of the job's
trace (shared/infra/tracing.py; no-ops while tracing is off)."""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeVar

from celery.exceptions import SoftTimeLimitExceeded
from minio.error import InvalidResponseError, S3Error, ServerError
from opentelemetry import trace
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_delay, wait_random_exponential
from urllib3.exceptions import HTTPError as Urllib3Error

from services.worker.lease import Lease
from services.worker.metrics import BUSY, FAILURES, JOBS, QUEUE_WAIT, STAGE_SECONDS
from shared.errors import EmbeddingsUnavailable, JobCancelled, LeaseLost, ModelUnavailable
from shared.infra.breakers import BreakerRule, BreakerSet, CircuitBreaker, CircuitOpen
from shared.infra.config import Settings
from shared.infra.db import session_scope
from shared.infra.retries import backoff
from shared.infra.storage import Storage, StoredObject, poster_key, s3_unreachable, video_key
from shared.infra.tracing import stage_span
from shared.jobs.states import cancelled_by_worker, claim, fail, release_for_retry, succeed
from shared.jobs.status import JobStatus
from shared.messaging.celery_app import VidqCelery
from shared.messaging.dispatch import after_transition_commit
from shared.messaging.progress import ProgressPublisher
from shared.models import Job
from shared.spec import GenerationSpec, Precision

if TYPE_CHECKING:  # the render code (torch) is imported where a job renders, not when the task module loads
    from shared.render.degrade import Degradation
    from shared.render.pipeline import RenderResult, VideoPipeline

log = logging.getLogger("vidq.worker.runner")

T = TypeVar("T")


class ClaimDeferred(Exception):
    """Postgres did not answer for ``worker_claim_wait_s``: the task re-publishes its message (tasks.py)."""


def db_unreachable(exc: BaseException) -> bool:
    """Postgres is down or unreachable (refused, reset, timed out, no pooled connection), not a bad statement."""
    if isinstance(exc, OperationalError | PoolTimeout):
        return True
    return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)


def _backoff(settings: Settings) -> wait_random_exponential:
    """Exponential from ``worker_db_retry_base_s``, ×2, capped at ``worker_db_retry_max_s``, full jitter
    (shared/infra/retries.py): a dependency that comes back is seen within about the cap."""
    return backoff(settings.worker_db_retry_base_s, settings.worker_db_retry_max_s)


# Circuit breakers of this worker process (shared/infra/breakers.py: in memory, per process): S3, and each model
# and shape it renders. Made on first use, from the settings of the first job.
_breakers_lock = threading.Lock()
_s3_breaker: list[CircuitBreaker] = []
_model_breakers: list[BreakerSet] = []


def s3_breaker(settings: Settings) -> CircuitBreaker:
    with _breakers_lock:
        if not _s3_breaker:
            _s3_breaker.append(CircuitBreaker("s3", BreakerRule.from_settings(settings)))
        return _s3_breaker[0]


def model_breaker(settings: Settings, spec: GenerationSpec) -> CircuitBreaker:
    """The breaker of the spec's model and shape (``model:HEIGHTxWIDTHxFRAMES``)."""
    with _breakers_lock:
        if not _model_breakers:
            rule = BreakerRule.from_settings(settings)
            _model_breakers.append(BreakerSet("model", rule, max_keys=settings.breaker_max_keys))
        breakers = _model_breakers[0]
    return breakers.get(f"{spec.model}:{spec.height}x{spec.width}x{spec.num_frames}")


# Failures that hand the job back for another attempt (DB, S3, network, no text encoder answering, S3's breaker
# open past worker_upload_retry_s): they say nothing about the render, so they never count against a model.
TRANSIENT: tuple[type[BaseException], ...] = (
    EmbeddingsUnavailable,
    CircuitOpen,
    OperationalError,
    S3Error,
    Urllib3Error,
    ConnectionError,
    TimeoutError,
    OSError,
)


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
        wait=_backoff(settings),
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
    job_id: uuid.UUID, *, settings: Settings, celery: VidqCelery, storage: Storage, progress: ProgressPublisher
) -> str:
    """Returns what happened ("succeeded", "dropped", "cancelled", "failed", …) for logs, metrics and tests.

    ``progress`` tells the API's progress streams about the claim, each step, and every commit that takes the job
    out of running ("finished": they read Postgres for the rest). It never raises; a lost message only delays a
    stream until its resync."""
    try:
        outcome = _run_job(job_id, settings=settings, celery=celery, storage=storage, progress=progress)
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
        outcome = "abandoned"
    JOBS.labels(outcome).inc()
    return outcome


def _run_job(
    job_id: uuid.UUID, *, settings: Settings, celery: VidqCelery, storage: Storage, progress: ProgressPublisher
) -> str:
    ctx = {"job_id": str(job_id)}

    # 1. Claim: the conditional UPDATE makes a redelivered or duplicate message a no-op.
    def claim_once() -> tuple[int, str, GenerationSpec] | None:
        with session_scope(settings) as session:
            job = claim(session, job_id, worker_id=worker_id(), lease_s=settings.lease_s)
            if job is None:
                return None
            trace.get_current_span().set_attributes(
                {"vidq.attempt": job.attempt, "vidq.model": job.spec.get("model", ""), "vidq.queue": job.queue}
            )
            if job.attempt == 1 and job.started_at is not None:  # a retry's wait would count the failed attempt
                QUEUE_WAIT.labels(job.priority_class).observe((job.started_at - job.created_at).total_seconds())
            return job.attempt, str(job.tenant_id), GenerationSpec.from_dict(job.spec)

    # Postgres down: the message is this job's only pointer in the broker (acks_late: it is acked when the task
    # returns), so the worker holds it and retries the claim until the database answers — the job then runs the
    # outage plus at most worker_db_retry_max_s later. Dropping it would leave the job queued with nothing to send
    # it again but the sweeper's queued_resend_s (30 min) or aging. Because the message is never lost, the sweeper
    # needs no new rule for "consumed but never claimed". Past worker_claim_wait_s (below the task's soft time
    # limit) the task re-publishes the message instead. A claim whose COMMIT reached Postgres but whose answer was
    # lost finds the job running on retry and drops the message: the lease (never renewed) expires and the
    # sweeper re-queues the job.
    try:
        with stage_span("claim", {"vidq.job_id": str(job_id)}):
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
        log.info("not claimable (already running, finished or cancelled); message dropped", extra=ctx)
        return "dropped"
    token, tenant_id, spec = claimed
    ctx["attempt"] = str(token)
    log.info("claimed", extra=ctx)
    progress.progress(job_id, status=JobStatus.RUNNING.value, step=0, total=spec.steps, attempt=token)

    try:
        with Lease(settings, job_id=job_id, token=token, progress=progress) as lease, BUSY.track_inprogress():
            outcome = _render_and_store(
                spec, celery=celery, storage=storage, lease=lease, tenant_id=tenant_id, job_id=job_id
            )

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
    FAILURES.labels(code).inc()
    _settle(settings, celery, lambda s: fail(s, job_id, token=token, code=code, message=message))
    return "failed"


def _upload(
    storage: Storage, key: str, path: Path, *, content_type: str, settings: Settings, lease: Lease, ctx: dict[str, str]
) -> StoredObject:
    """Upload under a deterministic key, retried while S3 is unreachable for up to ``worker_upload_retry_s`` (the
    lease keeps being renewed meanwhile): an S3 outage delays the job, it does not spend one of its attempts.

    Every call goes through this process's S3 breaker: while it is open the wait goes on without calling S3 (the
    lease and a cancel are still checked at every backoff step), and the half-open probe is this upload or
    another's. Only an outage counts against S3; a refused request is S3 answering."""
    breaker = s3_breaker(settings)

    def log_wait(state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome else None
        if isinstance(error, CircuitOpen) and state.attempt_number % 30 != 1:
            return  # the breaker's wait is logged when it starts, then about every 30 s
        log.warning("S3 unreachable at upload; retrying", extra={**ctx, "key": key, "error": repr(error)[:300]})

    def once() -> StoredObject:
        lease.check()  # a cancel or a lost lease ends the wait
        breaker.check()  # open: no call; the wait goes on
        try:
            stored = storage.upload(key, path, content_type=content_type)
        except (S3Error, ServerError, InvalidResponseError) as exc:  # S3 answered, or a proxy for it
            breaker.failure() if s3_unreachable(exc) else breaker.success()
            raise
        except BaseException as exc:
            breaker.failure() if s3_unreachable(exc) else breaker.release()
            raise
        breaker.success()
        return stored

    retrying = Retrying(
        retry=retry_if_exception(lambda exc: isinstance(exc, CircuitOpen) or s3_unreachable(exc)),
        stop=stop_after_delay(settings.worker_upload_retry_s),
        wait=_backoff(settings),
        before_sleep=log_wait,
        reraise=True,
    )
    return retrying(once)


def _render_and_store(
    spec: GenerationSpec,
    *,
    celery: VidqCelery,
    storage: Storage,
    lease: Lease,
    tenant_id: str,
    job_id: uuid.UUID,
) -> dict[str, object]:
    from shared.render.tiers import resolve_tier
    from shared.render.video import encode_mp4, write_poster

    # 2. Render (the pipeline is loaded once per process and kept warm); the prompt embeddings come from the
    #    embedding cache (services/worker/embeddings.py); on_step reports progress and stops the denoising loop at
    #    the next step when the job is cancelled.
    settings = celery.settings
    tier, tier_note = resolve_tier(spec.precision, settings.worker_precision)
    pipeline, result, degradation = _render(spec, celery=celery, lease=lease, tier=tier, job_id=job_id)
    lease.check()
    timings: dict[str, float] = {k: round(v, 4) for k, v in result.timings_s.items()}
    with tempfile.TemporaryDirectory(prefix="vidq-") as tmp:
        # 3. Encode H.264 yuv420p MP4 and a JPEG poster.
        t0 = time.perf_counter()
        mp4, jpg = Path(tmp) / "video.mp4", Path(tmp) / "poster.jpg"
        with stage_span("encode", {**_job_attributes(lease), "vidq.fps": spec.fps}):
            encode_mp4(result.frames, fps=spec.fps, path=mp4)
            write_poster(result.frames, jpg)
        timings["encode"] = round(time.perf_counter() - t0, 4)
        # 4. Upload under deterministic keys: a retried attempt overwrites, never duplicates.
        t0 = time.perf_counter()
        lease.check()
        upload = partial(_upload, storage, settings=settings, lease=lease, ctx={"job_id": str(job_id)})
        with stage_span("upload", {**_job_attributes(lease), "vidq.bucket": settings.s3_bucket}) as span:
            video = upload(video_key(tenant_id, str(job_id)), mp4, content_type="video/mp4")
            poster = upload(poster_key(tenant_id, str(job_id)), jpg, content_type="image/jpeg")
            span.set_attribute("vidq.output_bytes", video.size)
        timings["upload"] = round(time.perf_counter() - t0, 4)
    for stage, seconds in timings.items():
        STAGE_SECONDS.labels(stage).observe(seconds)
    # Stored with the job: stage seconds plus where the render ran.
    record: dict[str, object] = {
        **timings,
        "device": result.device,
        "dtype": result.dtype,
        "memory_mode": pipeline.memory_mode,
        # The tier that rendered it, its levers and module table, the attention kernel; why, if not the one asked.
        "precision": result.precision.with_request(spec.precision, tier_note).to_dict(),
    }
    if result.peak_vram_bytes is not None:
        record["peak_vram_bytes"] = result.peak_vram_bytes
    steps = spec.steps
    output: dict[str, object] = {}
    if degradation is not None:
        # What was asked and what rendered (shared/render/degrade.py); the job's result key is cleared, so the result
        # cache never serves this lower-tier video to a later request.
        record["degraded"] = degradation.record()
        steps = degradation.rendered.steps
        output["result_key"] = None
    return {
        **output,
        "output_key": video.key,
        "poster_key": poster.key,
        "output_bytes": video.size,
        "output_sha256": video.sha256,
        "output_frames": int(result.frames.shape[0]),
        "timings": record,
        "progress_step": steps,
        "progress_total": steps,
    }


def _render(
    spec: GenerationSpec, *, celery: VidqCelery, lease: Lease, tier: Precision, job_id: uuid.UUID
) -> tuple[VideoPipeline, RenderResult, Degradation | None]:
    """The job's render as asked; for a job that allows it, at the next lower tier when its model and shape are
    unavailable (breaker open) or out of memory even in low_vram (shared/render/degrade.py). The lower tier is
    tried once: its own failure fails the job with its code."""
    from shared.render.degrade import Degradation, lower_tier
    from shared.render.pipeline import RenderOutOfMemory

    settings = celery.settings
    try:
        pipeline, result = _render_guarded(spec, celery=celery, lease=lease, tier=tier, job_id=job_id)
        return pipeline, result, None
    except (ModelUnavailable, RenderOutOfMemory) as exc:
        lower = lower_tier(spec, settings) if spec.allow_degraded else None
        if lower is None:
            raise
        reason: Literal["model_unavailable", "out_of_memory"] = (
            "model_unavailable" if isinstance(exc, ModelUnavailable) else "out_of_memory"
        )
        log.warning(
            "rendering at the lower tier (allow_degraded)",
            extra={
                "job_id": str(job_id),
                "reason": reason,
                "asked": f"{spec.steps} steps {spec.width}x{spec.height}",
                "lower": f"{lower.steps} steps {lower.width}x{lower.height}",
            },
        )
    try:
        pipeline, result = _render_guarded(lower, celery=celery, lease=lease, tier=tier, job_id=job_id)
    except (ModelUnavailable, RenderOutOfMemory) as again:
        raise type(again)(f"{again} (at the lower tier too, allow_degraded)"[:500]) from again
    return pipeline, result, Degradation(reason, spec, lower)


def _render_guarded(
    spec: GenerationSpec, *, celery: VidqCelery, lease: Lease, tier: Precision, job_id: uuid.UUID
) -> tuple[VideoPipeline, RenderResult]:
    """One render of ``spec`` through its model+shape breaker: refused at once (``ModelUnavailable``) while the
    breaker is open. A render that fails (out of memory even in low_vram, an error of the model or the pipeline)
    counts against it; a cancel, a lost lease, the time limit and transient infrastructure errors count neither
    way."""
    from services.worker.gpu_thread import RenderAbandoned

    breaker = model_breaker(celery.settings, spec)
    if not breaker.allow():
        shape = f"{spec.height}x{spec.width}x{spec.num_frames}"
        raise ModelUnavailable(
            f"{spec.model} at {shape} keeps failing on this worker; it is tried again in "
            f"{breaker.retry_after_s():.0f} s"
        )
    try:
        rendered = _render_with_fallback(spec, celery=celery, lease=lease, tier=tier, job_id=job_id)
    except (JobCancelled, LeaseLost, SoftTimeLimitExceeded, RenderAbandoned, *TRANSIENT):
        breaker.release()
        raise
    except Exception:
        breaker.failure()
        raise
    except BaseException:
        breaker.release()
        raise
    breaker.success()
    return rendered


def _render_with_fallback(
    spec: GenerationSpec, *, celery: VidqCelery, lease: Lease, tier: Precision, job_id: uuid.UUID
) -> tuple[VideoPipeline, RenderResult]:
    """One render; a CUDA out-of-memory error retries it once in low_vram (and keeps the model there), and one in
    low_vram is ``RenderOutOfMemory``."""
    import torch

    from shared.render.pipeline import RenderOutOfMemory
    from shared.render.registry import fall_back_to_low_vram, pipeline_for

    settings = celery.settings
    pipeline = pipeline_for(spec.model, settings, tier=tier)
    try:
        return pipeline, _generate(pipeline, spec, celery=celery, lease=lease)
    except torch.OutOfMemoryError as exc:
        # The worker survives it (generate released the render's memory). Once in low_vram, for this model from now.
        if pipeline.memory_mode == "low_vram":
            raise RenderOutOfMemory(f"CUDA out of memory in low_vram mode: {exc}"[:500]) from exc
        log.warning("CUDA out of memory; retrying once in low_vram", extra={"job_id": str(job_id), "model": spec.model})
    pipeline = fall_back_to_low_vram(spec.model, settings, tier=tier)
    try:
        return pipeline, _generate(pipeline, spec, celery=celery, lease=lease)
    except torch.OutOfMemoryError as again:
        raise RenderOutOfMemory(f"CUDA out of memory, in low_vram too: {again}"[:500]) from again


_oom_faults: list[int] = []  # test knob (VIDQ_WORKER_FAULT_OOM_RENDERS): renders of this process left to fail


def _generate(pipeline: VideoPipeline, spec: GenerationSpec, *, celery: VidqCelery, lease: Lease) -> RenderResult:
    """One render with the embedding cache's text rows; the test knob's out-of-memory errors are raised here."""
    import torch

    from services.worker.embeddings import text_rows
    from services.worker.gpu_thread import RenderAbandoned, gpu_thread

    if not _oom_faults:
        _oom_faults.append(celery.settings.worker_fault_oom_renders)
    if _oom_faults[0] > 0:
        _oom_faults[0] -= 1
        raise torch.OutOfMemoryError("CUDA out of memory (VIDQ_WORKER_FAULT_OOM_RENDERS test knob)")
    attributes = {
        **_job_attributes(lease),
        "vidq.model": spec.model,
        "vidq.shape": f"{spec.num_frames}x{spec.height}x{spec.width}",
        "vidq.steps": spec.steps,
        "vidq.device": str(pipeline.device),
        "vidq.memory_mode": pipeline.memory_mode,
    }
    hold = celery.settings.worker_fault_hold_file
    on_step = partial(_held_step, lease, Path(hold)) if hold else lease.on_step
    rows = text_rows(celery, pipeline)

    def render(abandoned: threading.Event) -> RenderResult:
        def step(done: int, total: int) -> None:
            if abandoned.is_set():  # the task stopped waiting (soft time limit): end at this step
                raise RenderAbandoned("the task stopped waiting for this render")
            on_step(done, total)

        return pipeline.generate(
            spec, on_step=step, text_rows=rows, stage_scope=lambda stage: stage_span(stage, attributes)
        )

    # On the GPU thread that loaded and warmed up the model (services/worker/gpu_thread.py).
    return gpu_thread().run(render)


def _held_step(lease: Lease, hold: Path, step: int, total: int) -> None:
    """The test knob VIDQ_WORKER_FAULT_HOLD_FILE: a step as usual, then wait while the file exists. A cancel or a
    lost lease (seen by the heartbeat) ends the wait as it would end the render."""
    lease.on_step(step, total)
    while hold.exists():
        lease.check()
        time.sleep(0.05)


def _job_attributes(lease: Lease) -> dict[str, str | int]:
    return {"vidq.job_id": str(lease.job_id), "vidq.attempt": lease.token}
