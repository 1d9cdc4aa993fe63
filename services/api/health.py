"""Liveness, readiness (every dependency answers, each within a timeout) and Prometheus metrics."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import os
from collections.abc import Awaitable
from typing import Any

import psycopg
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

router = APIRouter(tags=["health"])
_pool = cf.ThreadPoolExecutor(max_workers=3, thread_name_prefix="readyz")


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "a dependency did not answer in time"}})
async def readyz(request: Request) -> JSONResponse:
    """Each check names its dependency, so an outage says which one is down. "postgres" covers both ways the API
    reaches it: the SQLAlchemy engine (sessions, the sweeper) and the psycopg async pool of the hot paths
    (services/api/store.py), which can fail on its own (exhausted, or holding only dead connections)."""
    state = request.app.state
    timeout_s = state.settings.readyz_timeout_s

    # A connection that died while Postgres was away is discarded by the failed SELECT; the pool then opens a new
    # one. One retry tells "a stale pooled connection" (ready) from "Postgres down" (not ready), so the probe does
    # not report an outage that is over.
    def db() -> None:
        for attempt in (1, 2):
            try:
                with state.engine.connect() as conn:
                    conn.execute(text("SELECT 1"))
                return
            except DBAPIError as exc:
                if attempt == 2 or not exc.connection_invalidated:
                    raise

    def redis() -> None:
        with state.celery.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=2)
            conn.default_channel.client.ping()

    def s3() -> None:
        if not state.storage.ping():
            raise RuntimeError(f"bucket {state.storage.bucket} missing")

    loop = asyncio.get_running_loop()

    async def db_pool() -> None:
        # One SELECT on a pooled connection; the pool's own wait is bounded too, so a full pool answers in time.
        for attempt in (1, 2):
            try:
                async with state.store.pool.connection(timeout=timeout_s) as conn:
                    await conn.execute("SELECT 1")
                return
            except psycopg.OperationalError:  # the pool drops a broken connection when it comes back
                if attempt == 2:
                    raise

    async def postgres() -> None:
        outcomes = await asyncio.gather(loop.run_in_executor(_pool, db), db_pool(), return_exceptions=True)
        errors = [
            f"{path}: {type(out).__name__}: {out}"
            for path, out in zip(("engine", "async pool"), outcomes, strict=True)
            if isinstance(out, BaseException)
        ]
        if errors:
            raise RuntimeError("; ".join(errors))

    # The blocking clients run on their own small thread pool, all checks at once.
    running: dict[str, Awaitable[None]] = {
        "postgres": postgres(),
        "redis": loop.run_in_executor(_pool, redis),
        "s3": loop.run_in_executor(_pool, s3),
    }
    results: dict[str, Any] = {}

    async def check(name: str, work: Awaitable[None]) -> None:
        try:
            await asyncio.wait_for(work, timeout=timeout_s)
            results[name] = "ok"
        except Exception as exc:  # TimeoutError included: the dependency did not answer in time
            results[name] = f"error: {type(exc).__name__}: {exc}"[:300]

    await asyncio.gather(*(check(name, work) for name, work in running.items()))
    results = {name: results[name] for name in running}  # a stable order, whatever finished first
    ok = all(v == "ok" for v in results.values())
    return JSONResponse({"status": "ready" if ok else "not ready", "checks": results}, status_code=200 if ok else 503)


@router.get("/metrics")
def metrics() -> Response:
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:  # prometheus_client's own switch: several API processes
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
