"""The webhook worker's Celery app (``vidq worker --role webhooks``): CPU only, never imports torch."""

from __future__ import annotations

from typing import Any

from celery.signals import setup_logging, worker_process_init, worker_process_shutdown

from shared.celery_app import make_celery
from shared.config import get_settings
from shared.db import dispose_engines
from shared.logs import configure_logging

settings = get_settings()
celery = make_celery(settings)
celery.conf.include = ["services.webhooks.tasks"]
app = celery


@setup_logging.connect
def _logging(**_: Any) -> None:
    configure_logging(level=settings.log_level, json_logs=settings.log_json)


@worker_process_init.connect
def _init_child(**_: Any) -> None:
    dispose_engines()  # never share a parent's sockets across fork


@worker_process_shutdown.connect
def _shutdown_child(**_: Any) -> None:
    dispose_engines()
