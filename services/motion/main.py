"""``vidq motion-refit``: fit a new motion prototype set from every described video, once or every ``every_s``
seconds. One refit at a time across the cluster (a Postgres advisory lock; a second one skips). SIGTERM or SIGINT
ends the loop after the current refit."""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass

from sqlalchemy import text

from shared.context.repository import refit
from shared.infra.config import Settings
from shared.infra.db import session_scope
from shared.infra.logs import configure_logging

log = logging.getLogger("vidq.motion")

# pg_try_advisory_xact_lock's key: "vidq motion-refit" as a 63-bit number.
_LOCK_KEY = 0x7669_6471_6D6F_7431


@dataclass(frozen=True)
class RefitReport:
    version: int | None  # the new set; None when nothing was fitted
    reason: str  # "refitted", "no videos described yet", "another refit is running"


def refit_once(settings: Settings, *, seed: int = 0) -> RefitReport:
    with session_scope(settings) as session:
        if not session.scalar(text("SELECT pg_try_advisory_xact_lock(:key)"), {"key": _LOCK_KEY}):
            return RefitReport(None, "another refit is running")
        version = refit(session, seed=seed, keep_sets=settings.motion_sets_kept)
    return RefitReport(version, "refitted" if version is not None else "no videos described yet")


def run(settings: Settings, *, every_s: float | None, seed: int = 0) -> RefitReport | None:
    """One refit (``every_s`` None: its report), or one every ``every_s`` seconds until SIGTERM or SIGINT."""
    configure_logging(level=settings.log_level, json_logs=settings.log_json)
    if every_s is None:
        return refit_once(settings, seed=seed)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.is_set():
        try:
            report = refit_once(settings, seed=seed)
            log.info("motion refit", extra={"version": str(report.version), "reason": report.reason})
        except Exception as exc:  # Postgres away: the next round tries again
            log.warning("motion refit failed; next round in %.0f s", every_s, extra={"error": repr(exc)})
        stop.wait(every_s)
    return None
