"""Every error the API can answer, from any layer, in the one envelope ``{"error": {"code", "message",
"details"}}`` with a stable code: vidq's own errors, request validation, routing (404/405), unparsable bodies,
dependencies that are down (503 + Retry-After: the client should come back, nothing was lost) and anything
unexpected (500, logged with its traceback).

Under ``/v1/videos`` (OpenAI's videos API) the same errors take OpenAI's shape instead, ``{"error": {"message",
"type", "param", "code"}}`` (shared/jobs/openai_videos.py ``OpenAIErrorBody``), with vidq's stable code as ``code``; an
invalid request is a 400 there (OpenAI's status for it), not a 422. ``error_body`` chooses, by the request's path."""

from __future__ import annotations

import logging
from typing import Any

import psycopg
import psycopg_pool
import redis
import urllib3
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from kombu.exceptions import OperationalError as BrokerError
from minio.error import MinioException
from pydantic import BaseModel
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException

from services.api.metrics import ERRORS
from shared.errors import VidqError
from shared.jobs.openai_videos import OpenAIError, OpenAIErrorBody

log = logging.getLogger("vidq.api")

# Stable codes for the statuses Starlette and FastAPI raise themselves.
_HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    415: "unsupported_media_type",
}
# A dependency that is down or saturated: the request may succeed if retried. psycopg's own errors come from the
# async store (services/api/store.py), SQLAlchemy's from sessions, minio's and urllib3's from S3 (a video streamed
# by GET /v1/videos/{id}/content).
UNAVAILABLE = (
    OperationalError,
    PoolTimeout,
    psycopg.OperationalError,
    psycopg_pool.PoolTimeout,
    redis.ConnectionError,
    redis.TimeoutError,
    BrokerError,
    MinioException,
    urllib3.exceptions.HTTPError,
)

OPENAI_PREFIX = "/v1/videos"
# OpenAI's error types by status (the SDK picks its exception class from the status, and shows the type).
_OPENAI_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}


class ErrorDetail(BaseModel):
    code: str
    message: str
    details: Any = None


class ErrorBody(BaseModel):
    """Every error response: a stable code, a message for people, and details where they help."""

    error: ErrorDetail


# The error statuses of the /v1/jobs routes, for the OpenAPI schema (all share ErrorBody).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": text}
    for status, text in [
        (401, "missing or invalid API key"),
        (404, "no such job for this tenant"),
        (409, "the job's state does not allow this"),
        (422, "invalid request"),
    ]
}

# A submit refused by the admission watermark (shared/scheduling/watermark.py): documented on both submit routes.
POOL_NOT_ALLOWED_DESCRIPTION = (
    "the request chose a worker pool (X-Vidq-Pool) but this tenant may not; nothing was written (pool_not_allowed)"
)
QUEUE_FULL_DESCRIPTION = (
    "queue_full: the job's priority class already holds as many waiting jobs as the admission watermark allows "
    "(it follows how busy the GPUs are); or, while every class is full, any new submit without an Idempotency-Key "
    "(then `details.classes` gives each class's backlog and watermark). Nothing was written; submit again after "
    "Retry-After seconds."
)
RETRY_AFTER_HEADER = {
    "description": "Seconds until the backlog is expected to be under the watermark, at the measured service rate",
    "schema": {"type": "integer"},
}


def is_openai_path(path: str) -> bool:
    return path == OPENAI_PREFIX or path.startswith(OPENAI_PREFIX + "/")


def error_body(path: str, status: int, code: str, message: str, details: Any = None) -> tuple[int, dict[str, Any]]:
    """(status, body) of an error answered at ``path``: vidq's envelope, or OpenAI's shape under /v1/videos."""
    if not is_openai_path(path):
        return status, {"error": {"code": code, "message": message, "details": details}}
    status = 400 if status == 422 else status
    kind = _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    error = OpenAIError(message=message, type=kind, param=_param(details), code=code)
    return status, OpenAIErrorBody(error=error).model_dump()


def _param(details: Any) -> str | None:
    """The request parameter an error is about: ``details["param"]`` (shared/errors.py errors raised for
    /v1/videos), or the field of the first validation error (FastAPI's ``loc``, e.g. ``["query", "limit"]``)."""
    if isinstance(details, dict) and isinstance(details.get("param"), str):
        return str(details["param"])
    if isinstance(details, list) and details and isinstance(details[0], dict):
        loc = [str(part) for part in details[0].get("loc", ()) if part not in ("body", "query", "path", "header")]
        return ".".join(loc) or None
    return None


def envelope(
    status: int,
    code: str,
    message: str,
    details: Any = None,
    *,
    headers: dict[str, str] | None = None,
    path: str = "",
) -> JSONResponse:
    status, body = error_body(path, status, code, message, details)
    ERRORS.labels(code, str(status)).inc()
    return JSONResponse(body, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI, *, retry_after_s: int) -> None:
    @app.exception_handler(VidqError)
    async def vidq_error(request: Request, exc: VidqError) -> JSONResponse:
        headers = None if exc.retry_after_s is None else {"Retry-After": str(exc.retry_after_s)}
        return envelope(exc.status_code, exc.code, exc.message, exc.details, headers=headers, path=request.url.path)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        details = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")} for e in exc.errors()
        ]
        message = "; ".join(d["msg"].removeprefix("Value error, ") for d in details) or "invalid request"
        return envelope(422, "invalid_request", message, details, path=request.url.path)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, f"http_{exc.status_code}")
        return envelope(exc.status_code, code, str(exc.detail), headers=dict(exc.headers or {}), path=request.url.path)

    async def unavailable(request: Request, exc: Exception) -> JSONResponse:
        log.warning(
            "dependency unavailable", extra={"path": request.url.path, "error": f"{type(exc).__name__}: {exc}"[:300]}
        )
        return envelope(
            503,
            "unavailable",
            "a backing service (database, broker or S3) is unavailable; retry after the given seconds",
            {"dependency": type(exc).__name__},
            headers={"Retry-After": str(retry_after_s)},
            path=request.url.path,
        )

    for exc_type in UNAVAILABLE:
        app.add_exception_handler(exc_type, unavailable)

    @app.exception_handler(DBAPIError)
    async def database_error(request: Request, exc: DBAPIError) -> JSONResponse:
        if exc.connection_invalidated:  # the connection died under the request: the database went away
            return await unavailable(request, exc)
        return await internal_error(request, exc)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error", extra={"path": request.url.path}, exc_info=exc)
        return envelope(500, "internal_error", "an unexpected error; it has been logged", path=request.url.path)
