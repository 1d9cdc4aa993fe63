"""The API process: ``create_app()`` builds everything in ``lifespan`` (nothing at import time)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from services.api.metrics import ERRORS, REQUEST_SECONDS
from services.api.routes import events, health, jobs
from services.sweeper.sweeper import Sweeper
from shared.celery_app import make_celery
from shared.config import Settings, get_settings
from shared.db import get_engine, session_factory
from shared.errors import VidqError
from shared.logs import configure_logging
from shared.progress import ProgressHub
from shared.storage import Storage

log = logging.getLogger("vidq.api")


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        configure_logging(level=settings.log_level, json_logs=settings.log_json)
        app.state.settings = settings
        app.state.engine = get_engine(settings)
        app.state.sessions = session_factory(settings)
        app.state.celery = make_celery(settings)
        app.state.storage = Storage(settings)
        # One Redis pub/sub connection feeds every progress stream of this process (routes/events.py).
        app.state.progress_hub = ProgressHub(settings)
        await app.state.progress_hub.start()
        stop = threading.Event()
        sweeper_thread = None
        if settings.sweeper_in_api:
            sweeper = Sweeper(settings, celery=app.state.celery, sessions=app.state.sessions)
            sweeper_thread = threading.Thread(target=sweeper.run_forever, args=(stop,), daemon=True)
            sweeper_thread.start()
        log.info("api started", extra={"sweeper": settings.sweeper_in_api})
        yield
        stop.set()
        if sweeper_thread is not None:
            sweeper_thread.join(timeout=10)
        await app.state.progress_hub.close()
        app.state.engine.dispose()

    app = FastAPI(
        title="vidq",
        version="0.1.0",
        description="Asynchronous text-to-video: submit a prompt, get an MP4 in S3 and a signed webhook.",
        lifespan=lifespan,
    )
    app.include_router(health.router)
    app.include_router(jobs.router)
    app.include_router(events.router)

    @app.exception_handler(VidqError)
    async def vidq_error(_: Request, exc: VidqError) -> JSONResponse:
        ERRORS.labels(exc.code, str(exc.status_code)).inc()
        return JSONResponse(exc.to_body(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        details = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")} for e in exc.errors()
        ]
        message = "; ".join(d["msg"].removeprefix("Value error, ") for d in details) or "invalid request"
        ERRORS.labels("invalid_request", "422").inc()
        return JSONResponse(
            {"error": {"code": "invalid_request", "message": message, "details": details}}, status_code=422
        )

    @app.middleware("http")
    async def timing(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        start = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        REQUEST_SECONDS.labels(request.method, getattr(route, "path", "unmatched"), str(response.status_code)).observe(
            time.perf_counter() - start
        )
        return response

    return app
