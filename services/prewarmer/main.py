"""Starting the prewarmer. ``vidq prewarmer`` parses its options and calls ``run``."""

from __future__ import annotations

import logging
import signal
import threading

from services.prewarmer.service import CycleReport, Prewarmer, load_encoders
from shared.infra.config import Settings
from shared.infra.logs import configure_logging
from shared.infra.tracing import setup_tracing

log = logging.getLogger("vidq.prewarmer")


def run(settings: Settings, *, once: bool) -> CycleReport | None:
    """Load the text encoders, then one cycle (``once``: its report), or cycles until SIGTERM or SIGINT, which end
    it after the current one, with its metrics served on ``prewarmer_metrics_port``."""
    from prometheus_client import start_http_server

    configure_logging(level=settings.log_level, json_logs=settings.log_json)
    setup_tracing("vidq-prewarmer", settings)  # nothing when tracing is off
    service = Prewarmer(settings, encoders=load_encoders(settings))
    if once:
        return service.cycle()
    if settings.prewarmer_metrics_port:
        try:
            start_http_server(settings.prewarmer_metrics_port)
        except OSError as exc:  # a second prewarmer on this host: keep working, say why there are no metrics
            log.warning("metrics port unavailable", extra={"port": settings.prewarmer_metrics_port, "error": str(exc)})
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    service.run_forever(stop)
    return None
