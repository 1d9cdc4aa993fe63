"""The webhook worker's Celery app (``vidq worker --role webhooks``): CPU only, never imports torch.

``build(settings)`` makes the app; services/worker/main.py runs it. The signal handlers below read the settings of
the app that ``build`` made: one app per worker process."""

from __future__ import annotations

from typing import Any

from celery.signals import setup_logging, worker_init, worker_process_init, worker_process_shutdown

from shared.infra.config import Settings
from shared.infra.db import dispose_engines
from shared.infra.logs import configure_logging
from shared.infra.tracing import active as active_tracing
from shared.infra.tracing import setup_tracing
from shared.messaging.celery_app import VidqCelery, WorkerApp

_worker = WorkerApp(include=["services.webhooks.tasks"])


def build(settings: Settings) -> VidqCelery:
    """The webhook worker's Celery app for ``settings``."""
    return _worker.build(settings)


@setup_logging.connect
def _logging(**_: Any) -> None:
    settings = _worker.settings
    configure_logging(level=settings.log_level, json_logs=settings.log_json)


@worker_init.connect
def _init_main(**_: Any) -> None:
    from services.worker.metrics import serve_metrics

    # Its pool processes' metrics (deliveries, each receiver host's breaker), served by the main process.
    serve_metrics(_worker.settings, gpus=False)


@worker_process_init.connect
def _init_child(**_: Any) -> None:
    dispose_engines()  # never share a parent's sockets across fork
    setup_tracing("vidq-webhooks", _worker.settings, celery=True)  # nothing when tracing is off


@worker_process_shutdown.connect
def _shutdown_child(**_: Any) -> None:
    dispose_engines()
    if (tracing := active_tracing()) is not None:  # a pool process ends without atexit hooks
        tracing.shutdown()
