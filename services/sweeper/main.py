"""Starting the sweeper on its own (it also runs inside the API when ``sweeper_in_api``). ``vidq sweep`` parses its
options and calls ``run``."""

from __future__ import annotations

import signal
import threading

from services.sweeper.sweeper import Sweeper, SweepReport
from shared.infra.config import Settings
from shared.infra.db import session_factory
from shared.infra.logs import configure_logging
from shared.infra.tracing import setup_tracing
from shared.messaging.celery_app import make_celery


def run(settings: Settings, *, once: bool) -> SweepReport | None:
    """One tick (``once``: its report), or ticks until SIGTERM or SIGINT, which end it after the current one."""
    configure_logging(level=settings.log_level, json_logs=settings.log_json)
    setup_tracing("vidq-sweeper", settings)  # its re-sends join their jobs' traces (nothing when tracing is off)
    sweeper = Sweeper(settings, celery=make_celery(settings), sessions=session_factory(settings))
    if once:
        return sweeper.sweep_once()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    sweeper.run_forever(stop)
    return None
