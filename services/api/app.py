"""The API process: ``create_app()`` builds everything in ``lifespan`` (nothing at import time)."""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from services.api import health
from services.api.admin import pools as admin_pools
from services.api.admin import routes as admin
from services.api.admission import Door, door_kwargs
from services.api.console import routes as console
from services.api.deps import KeyCache
from services.api.error_handlers import install_error_handlers
from services.api.jobs import events
from services.api.jobs import routes as jobs
from services.api.jobs.estimates import Estimator
from services.api.jobs.progress_hub import ProgressHub
from services.api.jobs.watermark import Watermark
from services.api.metrics import RequestTiming
from services.api.pools import PoolRouter
from services.api.store import JobStore
from services.api.videos import routes as videos
from services.api.webhooks import routes as webhooks
from services.sweeper.sweeper import Sweeper
from shared.infra.config import Settings, get_settings
from shared.infra.db import get_engine, session_factory
from shared.infra.logs import configure_logging
from shared.infra.storage import Storage
from shared.infra.tracing import setup_tracing
from shared.messaging.celery_app import make_celery

log = logging.getLogger("vidq.api")


class _App(FastAPI):
    """FastAPI behind the door (services/api/admission.py): a refusal is answered before anything of FastAPI runs
    (its telemetry hooks, middleware, routing, dependencies, body parsing)."""

    def __init__(self, settings: Settings, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._door = Door(super().__call__, state=self.state, **door_kwargs(settings))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._door(scope, receive, send)


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
        app.state.key_cache = KeyCache(ttl_s=settings.api_key_cache_s)
        app.state.store = JobStore(settings)
        await app.state.store.open()
        # One Redis pub/sub connection feeds every progress stream of this process (jobs/events.py).
        app.state.progress_hub = ProgressHub(settings)
        await app.state.progress_hub.start()
        # Worker pools: the routing rules and live pools, in memory (services/api/pools.py).
        app.state.pools = PoolRouter(settings, app.state.store)
        await app.state.pools.start()
        # The admission watermark: the check each submit makes, and this process's share of stepping it.
        app.state.watermark = Watermark(settings, pools=app.state.pools.known_pools)
        app.state.watermark.start()
        app.state.estimator = Estimator(settings, app.state.store, workers=app.state.watermark.live_workers)
        app.state.estimator.start()
        stop = threading.Event()
        sweeper_thread = None
        if settings.sweeper_in_api:
            sweeper = Sweeper(settings, celery=app.state.celery, sessions=app.state.sessions)
            sweeper_thread = threading.Thread(target=sweeper.run_forever, args=(stop,), daemon=True)
            sweeper_thread.start()
        log.info("api started", extra={"sweeper": settings.sweeper_in_api, "tracing": tracing is not None})
        yield
        stop.set()
        if sweeper_thread is not None:
            sweeper_thread.join(timeout=10)
        await app.state.estimator.close()
        await app.state.watermark.close()
        await app.state.pools.close()
        await app.state.progress_hub.close()
        await app.state.store.close()
        app.state.engine.dispose()
        if tracing is not None:
            tracing.shutdown()

    app = _App(
        settings,
        title="vidq",
        version="0.1.0",
        description="Asynchronous text-to-video: submit a prompt, get an MP4 in S3 and a signed webhook.",
        lifespan=lifespan,
    )
    app.include_router(health.router)
    app.include_router(jobs.router)
    app.include_router(events.router)
    app.include_router(webhooks.router)
    app.include_router(admin.router)
    app.include_router(admin_pools.router)
    app.include_router(console.router)
    app.include_router(videos.router)  # OpenAI's videos API over the same jobs

    install_error_handlers(app, retry_after_s=settings.api_retry_after_s)
    app.add_middleware(RequestTiming)  # inside the door: from the moment a request has its slot
    # Before the app serves (its middleware stack is built then); None and nothing installed while tracing is off.
    tracing = setup_tracing("vidq-api", settings, app=app)

    return app
