"""Job rows → API bodies (the presigned URL is made here, per read, with its expiry)."""

from __future__ import annotations

from typing import Any

from shared.infra.config import Settings
from shared.infra.storage import Storage
from shared.jobs.schemas import (
    ContextOut,
    DegradedFromOut,
    ErrorOut,
    EstimateOut,
    JobOut,
    OutputOut,
    ProgressOut,
    ScoreOut,
)
from shared.models import Job
from shared.pools.rules import RoutedBy
from shared.queues import STABLE_POOL
from shared.spec import GenerationSpec


def job_links(settings: Settings, job: Job) -> dict[str, str]:
    base = f"{settings.public_base_url.rstrip('/')}/v1/jobs/{job.id}"
    return {"self": base, "cancel": f"{base}/cancel", "webhooks": f"{base}/webhooks"}


def degraded_from(timings: dict[str, Any]) -> tuple[DegradedFromOut | None, dict[str, int]]:
    """A degraded job's ``timings.degraded`` (shared/render/degrade.py): what it asked for and why, and the
    steps, width and height it rendered at. (None, {}) for a job rendered as asked."""
    record = timings.get("degraded")
    if not isinstance(record, dict):
        return None, {}
    asked = record.get("from") or {}
    return DegradedFromOut(reason=str(record.get("reason", "")), **asked), dict(record.get("to") or {})


def present_job(
    job: Job,
    *,
    settings: Settings,
    storage: Storage | None,
    estimate: EstimateOut | None = None,
    context: ContextOut | None = None,
) -> JobOut:
    spec = GenerationSpec.from_dict(job.spec)
    timings = job.timings or {}
    degraded, rendered = degraded_from(timings)
    total = job.progress_total or spec.steps
    step = total if job.status == "succeeded" else job.progress_step
    output = None
    if job.status == "succeeded" and job.output_key and storage is not None:
        expiry = settings.presign_expiry_s
        video = storage.presign(job.output_key, expiry_s=expiry)
        poster = storage.presign(job.poster_key, expiry_s=expiry) if job.poster_key else None
        output = OutputOut(
            url=video.url,
            # The URL's own deadline (at least presign_expiry_s from now; storage signs per time bucket), and no
            # later than the poster's, so a client that trusts it never holds a dead link.
            expires_at=min(video.expires_at, poster.expires_at) if poster else video.expires_at,
            poster_url=poster.url if poster else None,
            bytes=job.output_bytes or 0,
            sha256=job.output_sha256 or "",
            frames=job.output_frames or spec.num_frames,
            fps=spec.fps,
            width=rendered.get("width", spec.width),  # a degraded job's output has the size it rendered at
            height=rendered.get("height", spec.height),
            context=context,
        )
    return JobOut(
        **spec.model_dump(),
        id=job.id,
        status=job.status,
        duration_s=job.duration_s,
        score=ScoreOut(
            value=job.score,
            complexity=job.score_complexity,
            resolution=job.score_resolution,
            duration=job.score_duration,
        ),
        priority_class=job.priority_class,
        queue=job.queue,
        pool=job.pool or STABLE_POOL,  # a Job built in memory has its defaults only once inserted
        routed_by=job.routed_by or RoutedBy.DEFAULT.value,
        attempt=job.attempt,
        cancel_requested=job.cancel_requested,
        progress=ProgressOut(step=step, total=total, percent=round(100.0 * step / total, 1) if total else 0.0),
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        timings=timings,
        error=ErrorOut(code=job.error_code, message=job.error_message or "") if job.error_code else None,
        output=output,
        webhook_url=job.webhook_url,
        metadata=job.metadata_ or {},
        result_of=job.result_of,
        degraded=degraded is not None,
        degraded_from=degraded,
        estimate=estimate,
        links=job_links(settings, job),
    )
