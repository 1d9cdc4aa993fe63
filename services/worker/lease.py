"""Keeps a running job's lease alive and carries progress and cancel requests between the DB and the render."""

from __future__ import annotations

import logging
import threading
import time
import uuid

from shared.errors import JobCancelled, LeaseLost
from shared.infra.config import Settings
from shared.infra.db import session_scope
from shared.jobs.states import renew_lease
from shared.jobs.status import JobStatus
from shared.messaging.progress import ProgressPublisher

log = logging.getLogger("vidq.worker.lease")


class Lease:
    """A background thread renews the lease every ``heartbeat_s``; ``on_step`` (called from the denoising loop)
    publishes every step to the progress streams, records progress in Postgres at most every
    ``progress_min_interval_s`` and raises when the job was cancelled or another attempt took it over."""

    def __init__(self, settings: Settings, *, job_id: uuid.UUID, token: int, progress: ProgressPublisher) -> None:
        self.settings = settings
        self.job_id = job_id
        self.token = token
        self.progress = progress
        self.cancel_requested = False
        self.owned = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{job_id}", daemon=True)
        self._last_progress = 0.0

    def __enter__(self) -> Lease:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=self.settings.heartbeat_s + 5)

    def _renew(self, progress: tuple[int, int] | None = None) -> None:
        with session_scope(self.settings) as session:
            state = renew_lease(
                session, self.job_id, token=self.token, lease_s=self.settings.lease_s, progress=progress
            )
        self.owned = state.owned
        self.cancel_requested = self.cancel_requested or state.cancel_requested

    def _run(self) -> None:
        while not self._stop.wait(self.settings.heartbeat_s):
            try:
                self._renew()
            except Exception:  # a DB blip: keep trying; the lease is several heartbeats long
                log.warning("lease renewal failed", extra={"job_id": str(self.job_id)}, exc_info=True)

    def refresh(self) -> None:
        """Renew now and raise as ``check`` does: a job that waited for the finisher sees a cancel or another
        attempt's claim before its encode and upload, not a heartbeat later. A database error leaves it to the
        heartbeat."""
        try:
            self._renew()
        except Exception:
            log.warning("lease renewal failed", extra={"job_id": str(self.job_id)}, exc_info=True)
        self.check()

    def check(self) -> None:
        if not self.owned:
            raise LeaseLost("another attempt owns this job now")
        if self.cancel_requested:
            raise JobCancelled("job cancelled")

    def on_step(self, step: int, total: int) -> None:
        # Every step goes to the streams (one PUBLISH, never raises); the row is written throttled, as it costs a
        # transaction.
        self.progress.progress(self.job_id, status=JobStatus.RUNNING.value, step=step, total=total, attempt=self.token)
        now = time.monotonic()
        if step == total or now - self._last_progress >= self.settings.progress_min_interval_s:
            self._last_progress = now
            self._renew(progress=(step, total))
        self.check()
