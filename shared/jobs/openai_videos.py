"""A job as OpenAI's videos API shows it: the ``Video`` object, its id, its status, and the error body.

The fields and their types are those the official ``openai`` SDK parses (``openai.types.Video``,
``VideoDeleteResponse``, the ``ConversationCursorPage`` of ``videos.list``). Every job of a tenant has this view,
whichever API created it: the job's row is the one source (shared/models.py), as for ``/v1/jobs``.

- Id: ``video_`` + the job's UUID in hex. ``/v1/videos`` also takes the bare UUID, with or without dashes, so the
  ids of both APIs name the same job (``GET /v1/jobs/<uuid>``).
- Status: queued → ``queued``; running → ``in_progress``; succeeded → ``completed``; failed → ``failed``;
  cancelled → ``failed`` with the error ``{"code": "cancelled"}`` (OpenAI's videos have no cancelled state, and a
  client polling with ``create_and_poll`` must see a final one).
- ``expires_at`` is null: vidq keeps the stored video (``GET /v1/videos/{id}/content`` serves it for as long as the
  job is not deleted).
"""

from __future__ import annotations

import math
import uuid
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from shared.jobs.status import JobStatus
from shared.models import Job
from shared.spec import GenerationSpec

VIDEO_ID_PREFIX = "video_"

VideoStatus = Literal["queued", "in_progress", "completed", "failed"]
_STATUS: dict[JobStatus, VideoStatus] = {
    JobStatus.QUEUED: "queued",
    JobStatus.RUNNING: "in_progress",
    JobStatus.SUCCEEDED: "completed",
    JobStatus.FAILED: "failed",
    JobStatus.CANCELLED: "failed",
}


def video_id(job_id: uuid.UUID) -> str:
    return f"{VIDEO_ID_PREFIX}{job_id.hex}"


def job_id_of(video: str) -> uuid.UUID | None:
    """The job behind a video id (``video_<hex>``, or the job's UUID itself); None when it names no job."""
    raw = video.removeprefix(VIDEO_ID_PREFIX)
    if len(raw) not in (32, 36):  # hex or dashed; uuid.UUID would also take braces and a urn: prefix
        return None
    try:
        return uuid.UUID(raw)
    except ValueError:
        return None


def video_status(job: Job) -> VideoStatus:
    return _STATUS[JobStatus(job.status)]


class VideoError(BaseModel):
    code: str
    message: str


class Video(BaseModel):
    """``openai.types.Video``."""

    id: str
    object: Literal["video"] = "video"
    model: str = Field(description="the vidq model that renders the video (an OpenAI model name maps to the default)")
    status: VideoStatus
    progress: int = Field(ge=0, le=100, description="denoising steps done, in percent")
    created_at: int = Field(description="unix seconds")
    completed_at: int | None = Field(description="unix seconds; set once the job is finished (completed or failed)")
    expires_at: int | None = Field(description="always null: vidq keeps the video until it is deleted")
    size: str = Field(description="WxH")
    seconds: str = Field(description="the duration asked for, in seconds")
    prompt: str | None
    error: VideoError | None
    remixed_from_video_id: str | None = None


class VideoPage(BaseModel):
    """``GET /v1/videos``: pass ``last_id`` back as ``after`` while ``has_more``."""

    object: Literal["list"] = "list"
    data: list[Video]
    first_id: str | None
    last_id: str | None
    has_more: bool


class VideoDeleted(BaseModel):
    """``openai.types.VideoDeleteResponse``."""

    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool = True


class OpenAIError(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIErrorBody(BaseModel):
    """Every error of ``/v1/videos``, in OpenAI's shape (the SDK raises ``BadRequestError``, ``NotFoundError`` … from
    the status and reads these fields)."""

    error: OpenAIError


def _unix(moment: datetime | None) -> int | None:
    return None if moment is None else int(moment.timestamp())


def present_video(job: Job) -> Video:
    spec = GenerationSpec.from_dict(job.spec)
    status = JobStatus(job.status)
    total = job.progress_total or spec.steps
    if status is JobStatus.SUCCEEDED:
        progress = 100
    else:  # never 100 before the video is stored
        progress = min(99, math.floor(100 * job.progress_step / total)) if total else 0
    error = None
    if status is JobStatus.CANCELLED:
        error = VideoError(code="cancelled", message="the job was cancelled")
    elif job.error_code:
        error = VideoError(code=job.error_code, message=job.error_message or "")
    return Video(
        id=video_id(job.id),
        model=spec.model,
        status=_STATUS[status],
        progress=progress,
        created_at=int(job.created_at.timestamp()),
        completed_at=_unix(job.finished_at) if status.is_terminal() else None,
        expires_at=None,
        size=f"{spec.width}x{spec.height}",
        seconds=f"{job.duration_s:g}",
        prompt=spec.prompt,
        error=error,
    )
