"""Starting the API: uvicorn serving ``create_app``, in one process or several sharing the port. ``vidq api`` parses
its options and calls ``run``."""

from __future__ import annotations

import os
import tempfile
from typing import Any

from shared.infra.config import Settings


def run(settings: Settings, *, host: str, port: int, workers: int, migrate: bool) -> None:
    """Serve until stopped. ``migrate``: bring the database to the newest schema first. With several ``workers``,
    each process builds its app from the environment (uvicorn starts them from an import string), which is the one
    ``settings`` came from; with one, the app is built from ``settings`` itself."""
    import uvicorn

    from services.api.app import create_app

    if migrate:
        from shared.infra.migrate import upgrade

        upgrade(settings)
    served: dict[str, Any] = {
        "host": host,
        "port": port,
        "log_config": None,
        "access_log": settings.api_access_log,
        "timeout_graceful_shutdown": 10,
    }
    if workers == 1:
        uvicorn.run(create_app(settings), **served)
        return
    # Each process writes its metrics to files here; /metrics of any one of them serves the sum. prometheus_client
    # takes its multiprocess mode from this variable, read when it is first imported (in each process).
    os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="vidq-api-metrics-"))
    uvicorn.run("services.api.app:create_app", factory=True, workers=workers, **served)
