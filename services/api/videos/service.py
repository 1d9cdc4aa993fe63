"""OpenAI's videos API over vidq's jobs: create, list, delete and the stored files, with no pipeline of its own.

A create is a ``POST /v1/jobs`` in other words: its parameters become a ``JobCreate`` (shared/jobs/schemas.py, the one
definition of a job's parameters and their rules) and go through ``jobs_service.submit`` (idempotency, result
cache, scoring, the queues), marked as created through this API (``jobs.api_flavour``, the shape of its webhook).

- ``size`` "WxH" → width, height (vidq's rules: multiples of 16, the operator's caps); ``seconds`` → ``duration_s``,
  frames being the smallest 4k+1 covering it at the job's fps (16 unless given). Defaults: OpenAI's, 720x1280 and
  4 seconds.
- ``model``: OpenAI's names (sora-2, sora-2-pro and their dated snapshots) render with vidq's default model; a vidq
  model name is used as it is; anything else is a 400.
- vidq's own parameters come as extra fields (the SDK's ``extra_body``): ``negative_prompt``, ``fps``, ``steps``,
  ``guidance_scale``, ``seed``, ``precision``, ``allow_degraded``, ``step_cache``, ``webhook_url``, ``metadata``,
  ``cache``. Any other field is a 400.
- An invalid request raises ``InvalidRequest`` with ``details={"param": <the OpenAI parameter>}``; the error
  handlers answer it as OpenAI's 400 (services/api/error_handlers.py).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import ValidationError
from sqlalchemy.orm import Session
from urllib3 import BaseHTTPResponse

from services.api import pagination
from services.api.store import JobStore
from shared.errors import Conflict, InvalidRequest, InvalidTransition, NotFound
from shared.infra.storage import Storage
from shared.jobs import repository
from shared.jobs.openai_videos import VideoPage, job_id_of, present_video
from shared.jobs.schemas import JobCreate
from shared.jobs.states import request_cancel
from shared.jobs.status import JobStatus
from shared.messaging.celery_app import VidqCelery
from shared.messaging.dispatch import after_transition_commit
from shared.models import Job

DEFAULT_SIZE = "720x1280"  # OpenAI's defaults (openai.types.VideoCreateParams)
DEFAULT_SECONDS = "4"
# vidq's parameters a create may carry besides OpenAI's (the SDK's extra_body); JobCreate validates them.
PASS_THROUGH = frozenset(
    {
        "negative_prompt",
        "fps",
        "steps",
        "guidance_scale",
        "seed",
        "precision",
        "allow_degraded",
        "step_cache",
        "webhook_url",
        "metadata",
        "cache",
    }
)
OPENAI_PARAMS = frozenset({"prompt", "model", "seconds", "size"})
_OPENAI_MODEL = re.compile(r"sora-2(-pro)?(-\d{4}-\d{2}-\d{2})?")
_SIZE = re.compile(r"(\d{1,5})x(\d{1,5})")
# JobCreate's field → the OpenAI parameter a client sent it as.
_PARAM_OF = {"width": "size", "height": "size", "duration_s": "seconds"}
CHUNK_BYTES = 256 * 1024

Variant = Literal["video", "thumbnail", "spritesheet"]


def _invalid(message: str, param: str | None) -> InvalidRequest:
    return InvalidRequest(message, details={"param": param})


def job_request(params: dict[str, Any]) -> JobCreate:
    """OpenAI's create parameters (plus vidq's, passed through) → the job request. Raises InvalidRequest (400)."""
    if "input_reference" in params:
        raise _invalid("input_reference is not supported: vidq renders from text only", "input_reference")
    unknown = sorted(set(params) - OPENAI_PARAMS - PASS_THROUGH)
    if unknown:
        allowed = ", ".join(sorted(OPENAI_PARAMS | PASS_THROUGH))
        raise _invalid(f"unknown parameter {unknown[0]!r}; accepted: {allowed}", unknown[0])
    width, height = _size(params.get("size", DEFAULT_SIZE))
    model = params.get("model")
    if isinstance(model, str) and _OPENAI_MODEL.fullmatch(model.strip()):
        model = None  # an OpenAI model name: vidq's default model renders it
    fields = {
        "prompt": params.get("prompt"),
        "duration_s": _seconds(params.get("seconds", DEFAULT_SECONDS)),
        "width": width,
        "height": height,
        "model": model,
        **{name: params[name] for name in PASS_THROUGH if name in params},
    }
    try:
        return JobCreate.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else None
        param = _PARAM_OF.get(field or "", field)
        message = str(first["msg"]).removeprefix("Value error, ")
        raise _invalid(f"{param}: {message}" if param else message, param) from None


def _size(value: Any) -> tuple[int, int]:
    match = _SIZE.fullmatch(value.strip()) if isinstance(value, str) else None
    if match is None:
        raise _invalid("size must be WIDTHxHEIGHT in pixels, e.g. 1280x720", "size")
    return int(match[1]), int(match[2])


def _seconds(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise _invalid('seconds must be a number of seconds, e.g. "4"', "seconds")
    try:
        return float(value)  # JobCreate checks the range (> 0, finite, the operator's cap)
    except ValueError:
        raise _invalid('seconds must be a number of seconds, e.g. "4"', "seconds") from None


def param_of_cap(error: InvalidRequest) -> InvalidRequest:
    """A refused create with the OpenAI parameter it is about: for a cap violation (``JobCreate.to_spec``), the
    field of its first problem; for anything else, none."""
    field = error.fields[0] if error.fields else None
    return _invalid(error.message, None if field is None else _PARAM_OF.get(field, field))


async def list_videos(
    store: JobStore, *, tenant_id: uuid.UUID, after: str | None, limit: int, order: Literal["asc", "desc"]
) -> VideoPage:
    """One page of the tenant's videos (every job, whichever API created it; deleted ones left out), newest first
    or oldest first, after the video ``after`` (keyset: stable while jobs are added)."""
    async with store.transaction() as conn:
        position = None
        if after is not None:
            job_id = job_id_of(after)
            position = None if job_id is None else await store.position(conn, tenant_id=tenant_id, job_id=job_id)
            if position is None:
                raise _invalid("after must be the id of one of your videos", "after")
        rows = await store.page(
            conn,
            tenant_id=tenant_id,
            status=None,
            limit=pagination.read_size(limit),
            after=position,
            ascending=order == "asc",
        )
    page, more = pagination.split(rows, limit)
    data = [present_video(job) for job in page]
    return VideoPage(
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
        has_more=more,
    )


def delete(session: Session, celery: VidqCelery, *, tenant_id: uuid.UUID, job_id: uuid.UUID) -> None:
    """Delete a video (the caller commits): a queued job is cancelled at once, a running one stops at its next step
    (the state machine's cancel, as ``POST /v1/jobs/{id}/cancel``); then the job answers 404 and leaves both APIs'
    lists. Its S3 objects stay: jobs served from the result cache may share them (``jobs.result_of``)."""
    try:
        job = repository.get(session, tenant_id=tenant_id, job_id=job_id)
    except NotFound:  # another tenant's, or deleted already
        raise NotFound("video not found") from None
    if not JobStatus(job.status).is_terminal():
        try:
            job = request_cancel(session, job_id, tenant_id=tenant_id)
        except InvalidTransition:
            pass  # it finished in the meantime: nothing to stop
        else:
            if JobStatus(job.status).is_terminal():  # cancelled while queued
                after_transition_commit(session, celery, job)
    if not repository.soft_delete(session, tenant_id=tenant_id, job_id=job_id):  # deleted by a concurrent request
        raise NotFound("video not found")


def stored_file(job: Job, variant: Variant) -> tuple[str, str]:
    """(S3 key, media type) of a completed video's file: the MP4 or its JPEG poster."""
    if variant == "spritesheet":
        raise _invalid("variant 'spritesheet' is not available: vidq stores the video and a thumbnail", "variant")
    if job.status != JobStatus.SUCCEEDED.value or not job.output_key:
        raise Conflict(
            "the video is not completed: its content can be downloaded once it is",
            details={"status": present_video(job).status},
        )
    if variant == "thumbnail":
        if not job.poster_key:
            raise NotFound("this video has no thumbnail")
        return job.poster_key, "image/jpeg"
    return job.output_key, "video/mp4"


def open_stored(storage: Storage, key: str) -> BaseHTTPResponse:
    """The stored object, ready to stream (blocking: the route runs it in a thread)."""
    body = storage.open(key)
    if body is None:  # gone from S3 (a bucket reset, a lifecycle rule)
        raise NotFound("the video's file is no longer stored")
    return body


def chunks(body: BaseHTTPResponse) -> Iterator[bytes]:
    """The object's bytes as S3 sends them; the connection goes back to the pool at the end, or when the client
    goes away."""
    try:
        yield from body.stream(CHUNK_BYTES)
    finally:
        body.close()
        body.release_conn()
