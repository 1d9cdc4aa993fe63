"""/v1/videos: OpenAI's videos API (what the official ``openai`` SDK's ``client.videos`` calls), over vidq's jobs.
Thin, like /v1/jobs: the mapping is in services/api/videos/service.py, the Video object in shared/jobs/openai_videos.py.
Same keys (``Authorization: Bearer``), same tenants (another tenant's id is a 404); errors in OpenAI's shape
(services/api/error_handlers.py)."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import StreamingResponse
from starlette.datastructures import UploadFile

from services.api import pagination
from services.api.deps import Caller, PoolHeader, SessionDep, SettingsDep, TenantDep
from services.api.error_handlers import POOL_NOT_ALLOWED_DESCRIPTION, QUEUE_FULL_DESCRIPTION, RETRY_AFTER_HEADER
from services.api.jobs import service as jobs_service
from services.api.jobs import submission
from services.api.videos import service as videos_service
from shared.errors import InvalidRequest, NotFound, UnsupportedMediaType
from shared.jobs.openai_videos import OpenAIErrorBody, Video, VideoDeleted, VideoPage, job_id_of, present_video
from shared.jobs.openai_videos import video_id as id_of_job
from shared.jobs.schemas import JobCreate
from shared.models import ApiFlavour, Job


def _errors(*statuses: tuple[int | str, str]) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": OpenAIErrorBody, "description": text} for status, text in statuses}


# "4XX" also keeps FastAPI from documenting its 422: an invalid request is a 400 here (OpenAI's status for it).
router = APIRouter(
    prefix="/v1/videos",
    tags=["videos (OpenAI-compatible)"],
    responses=_errors(
        (400, "invalid request"),
        (401, "missing or invalid API key"),
        (404, "no such video for this tenant"),
        ("4XX", "another client error (405 for a method the route has not)"),
        (503, "a backing service is unavailable or the API is at capacity; retry after Retry-After"),
    ),
)

_JOB_FIELDS = JobCreate.model_json_schema()["properties"]
_CREATE_SCHEMA = {
    "type": "object",
    "required": ["prompt"],
    "additionalProperties": False,  # any other parameter is a 400
    "properties": {
        "prompt": {"type": "string", "minLength": 1},
        "model": {"type": "string", "description": "sora-2 or sora-2-pro (vidq's default model), or a vidq model"},
        "seconds": {"type": "string", "description": "duration in seconds (default 4)"},
        "size": {"type": "string", "pattern": r"^\d{1,5}x\d{1,5}$", "description": "WxH (default 720x1280)"},
        **{name: _JOB_FIELDS[name] for name in sorted(videos_service.PASS_THROUGH)},
    },
}
_MAX_FORM_FIELDS = 64


async def _params(request: Request) -> dict[str, Any]:
    """The create's parameters from a multipart form (the SDK's encoding; ``metadata[key]`` fields make the
    metadata object), a urlencoded form, or a JSON object."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media in ("multipart/form-data", "application/x-www-form-urlencoded"):
        params: dict[str, Any] = {}
        async with request.form(max_files=1, max_fields=_MAX_FORM_FIELDS) as form:
            for name, value in form.multi_items():
                if isinstance(value, UploadFile):
                    params[name] = None  # a file: only input_reference would be one, and it is refused
                    continue
                if name.startswith("metadata[") and name.endswith("]"):
                    metadata = params.setdefault("metadata", {})
                    if not isinstance(metadata, dict):
                        raise InvalidRequest("send metadata as metadata[key] fields", details={"param": "metadata"})
                    metadata[name[len("metadata[") : -1]] = value
                elif name in params:
                    raise InvalidRequest(f"parameter {name!r} is given twice", details={"param": name})
                else:
                    params[name] = value
        return params
    if media == "application/json" or media.endswith("+json"):
        try:
            params = json.loads(await request.body())
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
            raise InvalidRequest("the body is not valid JSON", details={"param": None}) from None
        if not isinstance(params, dict):
            raise InvalidRequest("the body must be a JSON object", details={"param": None})
        return params
    raise UnsupportedMediaType("send multipart/form-data or application/json", details={"param": None})


@router.post(
    "",
    response_model=Video,
    responses={
        **_errors((415, "the body is neither JSON nor a form"), (403, POOL_NOT_ALLOWED_DESCRIPTION)),
        429: {
            "model": OpenAIErrorBody,
            "description": QUEUE_FULL_DESCRIPTION,
            "headers": {"Retry-After": RETRY_AFTER_HEADER},
        },
    },
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "multipart/form-data": {"schema": _CREATE_SCHEMA},
                "application/json": {"schema": _CREATE_SCHEMA},
            },
        }
    },
)
async def create_video(
    request: Request,
    response: Response,
    settings: SettingsDep,
    tenant: TenantDep,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
    pool: PoolHeader = None,
) -> Video:
    """``client.videos.create``: a job, as ``POST /v1/jobs`` makes it. vidq's own parameters (steps, seed,
    guidance_scale, negative_prompt, fps, precision, allow_degraded, step_cache, webhook_url, metadata, cache) come as
    extra fields (``extra_body``)."""
    body = videos_service.job_request(await _params(request))
    try:
        job = await submission.submit(
            request,
            response,
            settings,
            tenant=tenant,
            body=body,
            idempotency_key=idempotency_key,
            location=lambda job: f"/v1/videos/{id_of_job(job.id)}",
            flavour=ApiFlavour.OPENAI,
            pool=pool,
        )
    except InvalidRequest as exc:  # an operator's cap: name the parameter it is about
        raise videos_service.param_of_cap(exc) from None
    return present_video(job)


@router.get("", response_model=VideoPage)
async def list_videos(
    request: Request,
    settings: SettingsDep,
    tenant: TenantDep,
    after: Annotated[str | None, Query(description="the last video id of the previous page")] = None,
    limit: Annotated[int, Query(ge=1, le=1000, description="at most VIDQ_PAGE_SIZE_MAX are returned")] = 20,
    order: Literal["asc", "desc"] = "desc",
) -> VideoPage:
    """``client.videos.list``: every video (job) of the tenant, newest first (``order=desc``) or oldest first."""
    return await videos_service.list_videos(
        request.app.state.store,
        tenant_id=tenant.id,
        after=after,
        limit=pagination.page_size(limit, settings),
        order=order,
    )


def _job_id(video: str) -> uuid.UUID:
    job_id = job_id_of(video)
    if job_id is None:
        raise NotFound("video not found")
    return job_id


async def _read(request: Request, tenant: Caller, video: str) -> Job:
    try:
        return await jobs_service.read(request.app.state.store, tenant_id=tenant.id, job_id=_job_id(video))
    except NotFound:  # jobs_service says "job"; this API speaks of videos
        raise NotFound("video not found") from None


@router.get("/{video_id}", response_model=Video)
async def retrieve_video(video_id: str, request: Request, tenant: TenantDep) -> Video:
    """``client.videos.retrieve`` (and ``poll``): the video's status and progress."""
    return present_video(await _read(request, tenant, video_id))


@router.delete("/{video_id}", response_model=VideoDeleted)
def delete_video(video_id: str, request: Request, session: SessionDep, tenant: TenantDep) -> VideoDeleted:
    """``client.videos.delete``: a queued or running job is cancelled; the video then answers 404 everywhere. Its
    stored files stay in S3."""
    job_id = _job_id(video_id)
    videos_service.delete(session, request.app.state.celery, tenant_id=tenant.id, job_id=job_id)
    session.commit()
    return VideoDeleted(id=id_of_job(job_id))


@router.get(
    "/{video_id}/content",
    response_class=StreamingResponse,
    responses={
        **_errors((409, "the video is not completed yet")),
        200: {
            "description": "the MP4 (variant=video) or its JPEG poster (variant=thumbnail)",
            "content": {
                "video/mp4": {"schema": {"type": "string", "format": "binary"}},
                "image/jpeg": {"schema": {"type": "string", "format": "binary"}},
            },
        },
    },
)
async def download_content(
    video_id: str,
    request: Request,
    tenant: TenantDep,
    variant: Literal["video", "thumbnail", "spritesheet"] = "video",
) -> StreamingResponse:
    """``client.videos.download_content``: the stored bytes, streamed from S3. ``spritesheet`` is a 400."""
    job = await _read(request, tenant, video_id)
    key, media_type = videos_service.stored_file(job, variant)
    body = await asyncio.to_thread(videos_service.open_stored, request.app.state.storage, key)
    name = f"{id_of_job(job.id)}.{'jpg' if variant == 'thumbnail' else 'mp4'}"
    headers = {"Content-Disposition": f'inline; filename="{name}"'}
    if length := body.headers.get("content-length"):
        headers["Content-Length"] = length
    return StreamingResponse(videos_service.chunks(body), media_type=media_type, headers=headers)
