"""The worker's Celery app: tasks registered on the shared app, per-process resources built in the pool child.

``celery -A services.worker.app worker`` (or ``vidq worker``). CUDA is only touched in ``worker_process_init``,
i.e. in the forked child, never in the parent.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.signals import setup_logging, worker_init, worker_process_init, worker_process_shutdown

from shared.celery_app import make_celery
from shared.config import get_settings
from shared.db import dispose_engines
from shared.logs import configure_logging

log = logging.getLogger("vidq.worker")

settings = get_settings()
celery = make_celery(settings)
# The webhook task is included too, so one worker can serve every queue (``vidq worker --role all``: demo, tests).
celery.conf.include = ["services.worker.tasks", "services.webhooks.tasks"]
app = celery


def _register_steps() -> None:
    from services.worker.metrics import LivenessFile

    celery.steps["consumer"].add(LivenessFile)


_register_steps()


@setup_logging.connect
def _logging(**_: Any) -> None:
    # Connecting here stops Celery from installing its own handlers: the worker logs JSON like every service.
    configure_logging(level=settings.log_level, json_logs=settings.log_json)


@worker_init.connect
def _init_main(**_: Any) -> None:
    from services.worker.metrics import serve_metrics

    serve_metrics(settings)


@worker_process_init.connect
def _init_child(**_: Any) -> None:
    dispose_engines()  # never share a parent's sockets across fork
    for model in settings.worker_preload_models:
        from shared.render.registry import pipeline_for

        pipeline_for(model, settings)
        log.info("pipeline loaded", extra={"model": model})


@worker_process_shutdown.connect
def _shutdown_child(**_: Any) -> None:
    dispose_engines()
