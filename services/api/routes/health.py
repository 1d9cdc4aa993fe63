"""Liveness, readiness (every dependency answers, each within a timeout) and Prometheus metrics."""

from __future__ import annotations

import concurrent.futures as cf
import os
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from sqlalchemy import text

router = APIRouter(tags=["health"])
_pool = cf.ThreadPoolExecutor(max_workers=3, thread_name_prefix="readyz")


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "a dependency did not answer in time"}})
def readyz(request: Request) -> JSONResponse:
    state = request.app.state

    def db() -> None:
        with state.engine.connect() as conn:
            conn.execute(text("SELECT 1"))

    def redis() -> None:
        with state.celery.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=2)
            conn.default_channel.client.ping()

    def s3() -> None:
        if not state.storage.ping():
            raise RuntimeError(f"bucket {state.storage.bucket} missing")

    checks: dict[str, Callable[[], None]] = {"postgres": db, "redis": redis, "s3": s3}
    futures = {name: _pool.submit(fn) for name, fn in checks.items()}
    results: dict[str, Any] = {}
    for name, fut in futures.items():
        try:
            fut.result(timeout=state.settings.readyz_timeout_s)
            results[name] = "ok"
        except Exception as exc:
            results[name] = f"error: {type(exc).__name__}: {exc}"[:300]
    ok = all(v == "ok" for v in results.values())
    return JSONResponse({"status": "ready" if ok else "not ready", "checks": results}, status_code=200 if ok else 503)


@router.get("/metrics")
def metrics() -> Response:
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:  # prometheus_client's own switch: several API processes
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
