"""Every error the API can answer, from any layer, in the one envelope ``{"error": {"code", "message",
"details"}}`` with a stable code: vidq's own errors, request validation, routing (404/405), unparsable bodies,
dependencies that are down (503 + Retry-After: the client should come back, nothing was lost) and anything
unexpected (500, logged with its traceback)."""

from __future__ import annotations

import logging
from typing import Any

import psycopg
import psycopg_pool
import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from kombu.exceptions import OperationalError as BrokerError
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException

from services.api.metrics import ERRORS
from shared.errors import VidqError

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
# async store (services/api/store.py), SQLAlchemy's from sessions.
UNAVAILABLE = (
    OperationalError,
    PoolTimeout,
    psycopg.OperationalError,
    psycopg_pool.PoolTimeout,
    redis.ConnectionError,
    redis.TimeoutError,
    BrokerError,
)


def envelope(
    status: int, code: str, message: str, details: Any = None, *, headers: dict[str, str] | None = None
) -> JSONResponse:
    ERRORS.labels(code, str(status)).inc()
    body = {"error": {"code": code, "message": message, "details": details}}
    return JSONResponse(body, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI, *, retry_after_s: int) -> None:
    @app.exception_handler(VidqError)
    async def vidq_error(_: Request, exc: VidqError) -> JSONResponse:
        return envelope(exc.status_code, exc.code, exc.message, exc.details)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        details = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")} for e in exc.errors()
        ]
        message = "; ".join(d["msg"].removeprefix("Value error, ") for d in details) or "invalid request"
        return envelope(422, "invalid_request", message, details)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, f"http_{exc.status_code}")
        return envelope(exc.status_code, code, str(exc.detail), headers=dict(exc.headers or {}))

    async def unavailable(request: Request, exc: Exception) -> JSONResponse:
        log.warning(
            "dependency unavailable", extra={"path": request.url.path, "error": f"{type(exc).__name__}: {exc}"[:300]}
        )
        return envelope(
            503,
            "unavailable",
            "a backing service (database or broker) is unavailable; retry after the given seconds",
            {"dependency": type(exc).__name__},
            headers={"Retry-After": str(retry_after_s)},
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
        return envelope(500, "internal_error", "an unexpected error; it has been logged")
