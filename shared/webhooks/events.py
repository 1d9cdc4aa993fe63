"""A finished job's webhook event, type and body: the one place that branches on the API that created the job
(``jobs.api_flavour``).

- ``vidq`` (``POST /v1/jobs``): ``job.succeeded`` | ``job.failed`` | ``job.cancelled``, the body
  ``{"type", "timestamp", "data": <the job as GET /v1/jobs/{id} returns it>}``.
- ``openai`` (``POST /v1/videos``): ``video.completed`` | ``video.failed`` (a cancelled job is a failed video, as
  on ``GET /v1/videos/{id}``), the body of OpenAI's webhook events ``{"id", "object": "event", "type",
  "created_at", "data": {"id": <video id>}}``. The event id and ``created_at`` (when the job finished) are the same
  on every attempt, like the ``webhook-id``.

Both are signed the same way (Standard Webhooks, shared/webhooks/signing.py), which is also what the ``openai``
SDK's ``client.webhooks.unwrap`` / ``verify_signature`` check with the tenant's ``whsec_…`` secret.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from shared.infra.config import Settings
from shared.infra.storage import Storage
from shared.jobs.openai_videos import video_id
from shared.jobs.presenters import present_job
from shared.jobs.status import JobStatus
from shared.models import ApiFlavour, Job
from shared.webhooks.signing import build_event

OPENAI_EVENT_TYPES = ("video.completed", "video.failed")


def event_type(job: Job) -> str:
    """The event a finished job sends (and its deliveries are logged under)."""
    if job.api_flavour == ApiFlavour.OPENAI.value:
        return OPENAI_EVENT_TYPES[0] if job.status == JobStatus.SUCCEEDED.value else OPENAI_EVENT_TYPES[1]
    return f"job.{job.status}"


def event_body(job: Job, *, settings: Settings, storage: Storage | None) -> dict[str, Any]:
    kind = event_type(job)
    if job.api_flavour == ApiFlavour.OPENAI.value:
        finished = job.finished_at or datetime.now(UTC)
        return {
            "id": f"evt_{job.id.hex}",
            "object": "event",
            "type": kind,
            "created_at": int(finished.timestamp()),
            "data": {"id": video_id(job.id)},
        }
    return build_event(
        event_type=kind, job=present_job(job, settings=settings, storage=storage).model_dump(mode="json")
    )
