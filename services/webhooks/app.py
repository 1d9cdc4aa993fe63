"""The webhook worker's Celery app (``vidq worker --role webhooks``): CPU only, never imports torch."""

from __future__ import annotations

from typing import Any

from celery.signals import setup_logging, worker_process_init, worker_process_shutdown

from shared.celery_app import make_celery
from shared.config import get_settings
from shared.db import dispose_engines
from shared.logs import configure_logging
from shared.tracing import active as active_tracing
from shared.tracing import setup_tracing

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
    setup_tracing("vidq-webhooks", settings, celery=True)  # nothing when tracing is off


@worker_process_shutdown.connect
def _shutdown_child(**_: Any) -> None:
    dispose_engines()
    if (tracing := active_tracing()) is not None:  # a pool process ends without atexit hooks
        tracing.shutdown()
