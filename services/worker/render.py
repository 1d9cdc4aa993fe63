"""Rendering claimed jobs and storing their videos: one job alone, or compatible jobs in one batch (the pipeline's
``generate_batch``), each on the GPU thread that loaded the model; then, per job, its MP4 and poster encoded and
uploaded under deterministic keys. services/worker/runner.py calls these and owns each job's state."""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeVar

from celery.exceptions import SoftTimeLimitExceeded
from minio.error import InvalidResponseError, S3Error, ServerError
from sqlalchemy.exc import OperationalError
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_delay, wait_random_exponential
from urllib3.exceptions import HTTPError as Urllib3Error

from services.worker.batching import Claimed
from services.worker.breakers import model_breaker, s3_breaker
from services.worker.lease import Lease
from services.worker.metrics import RENDER_STEP_SECONDS, STAGE_SECONDS
from shared.errors import EmbeddingsUnavailable, JobCancelled, LeaseLost, ModelUnavailable
from shared.infra import retries
from shared.infra.breakers import CircuitBreaker, CircuitOpen
from shared.infra.config import Settings
from shared.infra.storage import Storage, StoredObject, poster_key, s3_unreachable, video_key
from shared.infra.tracing import stage_span
from shared.messaging.celery_app import VidqCelery
from shared.spec import GenerationSpec, Precision

if TYPE_CHECKING:  # the render code (torch) is imported where a job renders, not when the task module loads
    from shared.render.degrade import Degradation
    from shared.render.pipeline import RenderResult, VideoPipeline

T = TypeVar("T")

log = logging.getLogger("vidq.worker.render")


def backoff(settings: Settings) -> wait_random_exponential:
    """Exponential from ``worker_db_retry_base_s``, ×2, capped at ``worker_db_retry_max_s``, full jitter
    (shared/infra/retries.py): a dependency that comes back is seen within about the cap."""
    return retries.backoff(settings.worker_db_retry_base_s, settings.worker_db_retry_max_s)


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


@dataclass(frozen=True, slots=True)
class Rendered:
    """A job's frames, with what rendered them: the pipeline's memory mode and why its tier is not the one asked."""

    result: RenderResult
    memory_mode: str
    tier_note: str | None
    degradation: Degradation | None = None  # rendered at the next lower tier (allow_degraded): what and why


def render_members(members: list[Claimed], leases: list[Lease], *, celery: VidqCelery) -> list[Rendered | Exception]:
    """Each member's frames, or the error that ended its render (its caller decides what that error means for the
    job). A batch that runs out of memory is rendered again one job at a time (each with the low_vram fallback)."""
    if len(members) == 1:
        return [_render_alone(members[0].spec, leases[0], celery=celery)]
    import torch

    from shared.render.registry import pipeline_for
    from shared.render.tiers import resolve_tier

    spec = members[0].spec
    breaker = model_breaker(celery.settings, spec)
    if not breaker.allow():  # each member alone: unavailable, or degraded where it allows it
        return [_render_alone(m.spec, lease, celery=celery) for m, lease in zip(members, leases, strict=True)]
    tier, tier_note = resolve_tier(spec.precision, celery.settings.worker_precision)
    pipeline = pipeline_for(spec.model, celery.settings, tier=tier)
    try:
        specs = [m.spec for m in members]
        results = _guarded(breaker, lambda: _generate_batch(pipeline, specs, celery=celery, leases=leases))
    except torch.OutOfMemoryError:
        log.warning("out of memory in a batch; rendering its jobs one at a time", extra={"batch": len(members)})
        return [_render_alone(m.spec, lease, celery=celery) for m, lease in zip(members, leases, strict=True)]
    except Exception as exc:  # the batch's render failed: every member's render failed
        return [exc for _ in members]
    return [r if isinstance(r, Exception) else Rendered(r, pipeline.memory_mode, tier_note) for r in results]


def _render_alone(spec: GenerationSpec, lease: Lease, *, celery: VidqCelery) -> Rendered | Exception:
    try:
        return render_one(spec, lease, celery=celery)
    except Exception as exc:
        return exc


def render_one(spec: GenerationSpec, lease: Lease, *, celery: VidqCelery) -> Rendered:
    """One job's render (the pipeline is loaded once per process and kept warm); the prompt embeddings come from
    the embedding cache (services/worker/embeddings.py); the lease's on_step reports progress and stops the
    denoising loop at the next step when the job is cancelled. For a job that allows it, the next lower tier when
    its model and shape are unavailable (breaker open) or out of memory even in low_vram (shared/render/degrade.py);
    the lower tier is tried once: its own failure fails the job with its code."""
    from shared.render.degrade import Degradation, lower_tier
    from shared.render.pipeline import RenderOutOfMemory
    from shared.render.tiers import resolve_tier

    settings, job_id = celery.settings, lease.job_id
    tier, tier_note = resolve_tier(spec.precision, settings.worker_precision)
    try:
        pipeline, result = _render_guarded(spec, celery=celery, lease=lease, tier=tier)
        return Rendered(result, pipeline.memory_mode, tier_note)
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
        pipeline, result = _render_guarded(lower, celery=celery, lease=lease, tier=tier)
    except (ModelUnavailable, RenderOutOfMemory) as again:
        raise type(again)(f"{again} (at the lower tier too, allow_degraded)"[:500]) from again
    return Rendered(result, pipeline.memory_mode, tier_note, Degradation(reason, spec, lower))


def _render_guarded(
    spec: GenerationSpec, *, celery: VidqCelery, lease: Lease, tier: Precision
) -> tuple[VideoPipeline, RenderResult]:
    """One render of ``spec`` through its model+shape breaker: refused at once (``ModelUnavailable``) while the
    breaker is open. A render that fails (out of memory even in low_vram, an error of the model or the pipeline)
    counts against it; a cancel, a lost lease, the time limit and transient infrastructure errors count neither
    way."""
    breaker = model_breaker(celery.settings, spec)
    if not breaker.allow():
        shape = f"{spec.height}x{spec.width}x{spec.num_frames}"
        raise ModelUnavailable(
            f"{spec.model} at {shape} keeps failing on this worker; it is tried again in "
            f"{breaker.retry_after_s():.0f} s"
        )
    return _guarded(breaker, lambda: _render_with_fallback(spec, celery=celery, lease=lease, tier=tier))


def _guarded(breaker: CircuitBreaker, render: Callable[[], T]) -> T:
    """``render()`` with its outcome recorded on the model's breaker."""
    from services.worker.gpu_thread import RenderAbandoned

    try:
        rendered = render()
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
    spec: GenerationSpec, *, celery: VidqCelery, lease: Lease, tier: Precision
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
        log.warning(
            "CUDA out of memory; retrying once in low_vram", extra={"job_id": str(lease.job_id), "model": spec.model}
        )
    pipeline = fall_back_to_low_vram(spec.model, settings, tier=tier)
    try:
        return pipeline, _generate(pipeline, spec, celery=celery, lease=lease)
    except torch.OutOfMemoryError as again:
        raise RenderOutOfMemory(f"CUDA out of memory, in low_vram too: {again}"[:500]) from again


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
        wait=backoff(settings),
        before_sleep=log_wait,
        reraise=True,
    )
    return retrying(once)


def store(
    spec: GenerationSpec,
    rendered: Rendered,
    *,
    celery: VidqCelery,
    storage: Storage,
    lease: Lease,
    tenant_id: str,
) -> dict[str, object]:
    """The job's MP4 (H.264 yuv420p) and JPEG poster, uploaded; returns the job's output columns."""
    from shared.render.video import encode_mp4, write_poster

    settings, result, job_id = celery.settings, rendered.result, lease.job_id
    lease.refresh()
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
        if settings.worker_fault_hold_upload_file:  # test knob: hold here while its file exists
            _hold(lease, Path(settings.worker_fault_hold_upload_file))
        t0 = time.perf_counter()
        lease.check()
        upload = partial(_upload, storage, settings=settings, lease=lease, ctx={"job_id": str(job_id)})
        with stage_span("upload", {**_job_attributes(lease), "vidq.bucket": settings.s3_bucket}) as span:
            video = upload(video_key(tenant_id, str(job_id)), mp4, content_type="video/mp4")
            poster = upload(poster_key(tenant_id, str(job_id)), jpg, content_type="image/jpeg")
            span.set_attribute("vidq.output_bytes", video.size)
        timings["upload"] = round(time.perf_counter() - t0, 4)
    for stage, seconds in timings.items():
        if stage not in ("batch", "decode_tiled"):  # a count and a flag, not seconds
            STAGE_SECONDS.labels(stage).observe(seconds)
    # Stored with the job: stage seconds plus where the render ran.
    record: dict[str, object] = {
        **timings,
        "device": result.device,
        "dtype": result.dtype,
        "memory_mode": rendered.memory_mode,
        # The tier that rendered it, its levers and module table, the attention kernel; why, if not the one asked.
        "precision": result.precision.with_request(spec.precision, rendered.tier_note).to_dict(),
    }
    if result.peak_vram_bytes is not None:
        record["peak_vram_bytes"] = result.peak_vram_bytes
    steps = spec.steps
    output: dict[str, object] = {}
    if rendered.degradation is not None:
        # What was asked and what rendered (shared/render/degrade.py); the job's result key is cleared, so the result
        # cache never serves this lower-tier video to a later request.
        record["degraded"] = rendered.degradation.record()
        steps = rendered.degradation.rendered.steps
        output["result_key"] = None
    if "denoise" in timings and steps:  # a pool's render speed, comparable across pools per shape
        shape = f"{spec.width}x{spec.height}x{spec.num_frames}"
        RENDER_STEP_SECONDS.labels(settings.worker_pool, spec.model, shape).observe(timings["denoise"] / steps)
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
    return gpu_thread().run(_timed([lease], render))


def _generate_batch(
    pipeline: VideoPipeline, specs: list[GenerationSpec], *, celery: VidqCelery, leases: list[Lease]
) -> list[RenderResult | Exception]:
    """A batch's render on the GPU thread; each member's steps go to its own lease (progress, cancel, a lost
    lease: that member is dropped, the others go on)."""
    from services.worker.embeddings import text_rows
    from services.worker.gpu_thread import RenderAbandoned, gpu_thread

    attributes: dict[str, str | int] = {
        "vidq.job_ids": ",".join(str(lease.job_id) for lease in leases),
        "vidq.batch": len(specs),
        "vidq.model": specs[0].model,
        "vidq.shape": f"{specs[0].num_frames}x{specs[0].height}x{specs[0].width}",
        "vidq.steps": specs[0].steps,
        "vidq.device": str(pipeline.device),
    }
    hold = celery.settings.worker_fault_hold_file
    rows = text_rows(celery, pipeline)

    def render(abandoned: threading.Event) -> list[RenderResult | Exception]:
        def member_step(lease: Lease):  # type: ignore[no-untyped-def]
            on_step = partial(_held_step, lease, Path(hold)) if hold else lease.on_step

            def step(done: int, total: int) -> None:
                if abandoned.is_set():
                    raise RenderAbandoned("the task stopped waiting for this render")
                on_step(done, total)

            return step

        return pipeline.generate_batch(
            specs,
            on_steps=[member_step(lease) for lease in leases],
            text_rows=rows,
            stage_scope=lambda stage: stage_span(stage, attributes),
        )

    return gpu_thread().run(_timed(leases, render))


def _held_step(lease: Lease, hold: Path, step: int, total: int) -> None:
    """The test knob VIDQ_WORKER_FAULT_HOLD_FILE: a step as usual, then wait while the file exists."""
    lease.on_step(step, total)
    _hold(lease, hold)


def _hold(lease: Lease, hold: Path) -> None:
    """Wait while ``hold`` exists (test knobs). A cancel or a lost lease (seen by the heartbeat) ends the wait as it
    would end the stage."""
    while hold.exists():
        lease.check()
        time.sleep(0.05)


def _timeline(leases: list[Lease], started: float, outcome: str) -> None:
    """One line per render (a video or a batch): when its work on the device began and ended, in unix seconds, so
    the GPU's idle gaps between jobs can be read from the log (benchmarks/gpu_stack.py does)."""
    log.info(
        "render timeline",
        extra={
            "job_ids": [str(lease.job_id) for lease in leases],
            "started_unix": round(started, 4),
            "ended_unix": round(time.time(), 4),
            "outcome": outcome,
        },
    )


def _timed(leases: list[Lease], render: Callable[[threading.Event], T]) -> Callable[[threading.Event], T]:
    """``render``, its start and end logged as the render's timeline."""

    def timed(abandoned: threading.Event) -> T:
        started, outcome = time.time(), "failed"
        try:
            result = render(abandoned)
            outcome = "rendered"
            return result
        finally:
            _timeline(leases, started, outcome)

    return timed


def _job_attributes(lease: Lease) -> dict[str, str | int]:
    return {"vidq.job_id": str(lease.job_id), "vidq.attempt": lease.token}
