"""The sweeper: the loop that makes "losing nothing" true.

Each tick, under a Postgres advisory lock (so any number of API replicas can run it, one at a time):
1. running jobs whose lease expired (dead worker) go back to ``queued`` (or ``failed`` past ``max_attempts``);
2. queued jobs never sent (crash between commit and send) or sent long ago and never claimed are re-sent;
3. aging, the anti-starvation rule: a job still queued ``aging_promote_after_s`` after its last send is re-sent
   one class up (low → medium → high). Workers take queues in strict priority order, so without this a steady
   stream of high jobs could hold a low job forever; with it, a low job waits at most about
   2 × aging_promote_after_s before it competes in the high queue, first come first served. The old message is
   dropped by whichever worker meets it later (the job is no longer ``queued`` then);
4. expired idempotency keys are deleted;
5. finished jobs with a webhook but no delivery attempt on record are handed to the webhook queue again.
Messages are registered in the tick's transaction and sent after it commits (shared/dispatch.py).
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import delete, exists, func, select, text
from sqlalchemy.orm import Session, sessionmaker

from shared.celery_app import VidqCelery
from shared.config import Settings
from shared.dispatch import send_job_after_commit, send_webhook_after_commit
from shared.models import IdempotencyKey, Job, WebhookDelivery
from shared.queues import PriorityClass, Queue
from shared.states import TERMINAL, JobStatus, expired_leases, recover_expired, unsent_or_lost

log = logging.getLogger("vidq.sweeper")

_LOCK_KEY = 0x76696471  # "vidq"


@dataclass
class SweepReport:
    requeued: list[uuid.UUID] = field(default_factory=list)
    failed: list[uuid.UUID] = field(default_factory=list)
    resent: list[uuid.UUID] = field(default_factory=list)
    promoted: list[uuid.UUID] = field(default_factory=list)
    webhooks: list[uuid.UUID] = field(default_factory=list)
    keys_expired: int = 0
    skipped: bool = False


def _promote_due(session: Session, *, now: datetime, after_s: float) -> list[Job]:
    return list(
        session.execute(
            select(Job)
            .where(
                Job.status == JobStatus.QUEUED.value,
                Job.queue != Queue.HIGH.value,
                Job.enqueued_at < now - timedelta(seconds=after_s),
            )
            .order_by(Job.created_at)
            .limit(100)
            .with_for_update(skip_locked=True)
        ).scalars()
    )


def _webhooks_due(session: Session, *, now: datetime, grace_s: float) -> list[Job]:
    return list(
        session.execute(
            select(Job)
            .where(
                Job.status.in_([s.value for s in TERMINAL]),
                Job.webhook_url.is_not(None),
                Job.finished_at < now - timedelta(seconds=grace_s),
                Job.finished_at > now - timedelta(days=1),
                ~exists().where(WebhookDelivery.job_id == Job.id),
            )
            .limit(100)
        ).scalars()
    )


class Sweeper:
    def __init__(self, settings: Settings, *, celery: VidqCelery, sessions: sessionmaker[Session]) -> None:
        self.settings = settings
        self.celery = celery
        self.sessions = sessions

    def sweep_once(self) -> SweepReport:
        s = self.settings
        report = SweepReport()
        with self.sessions() as session, session.begin():
            if not session.execute(text("SELECT pg_try_advisory_xact_lock(:k)"), {"k": _LOCK_KEY}).scalar():
                report.skipped = True
                return report
            now = session.execute(select(func.now())).scalar_one()
            for job in expired_leases(session, now=now):
                after = recover_expired(session, job)
                if after is None:
                    continue
                if after.status == JobStatus.QUEUED.value:
                    report.requeued.append(after.id)
                    send_job_after_commit(session, self.celery, after)
                else:
                    report.failed.append(after.id)
                    send_webhook_after_commit(session, self.celery, after)
            for job in unsent_or_lost(session, now=now, grace_s=s.enqueue_grace_s, resend_s=s.queued_resend_s):
                if job.id not in report.requeued:
                    report.resent.append(job.id)
                    send_job_after_commit(session, self.celery, job)
            for job in _promote_due(session, now=now, after_s=s.aging_promote_after_s):
                current = PriorityClass(job.queue.removeprefix("video."))
                report.promoted.append(job.id)
                send_job_after_commit(session, self.celery, job, queue=current.promoted().queue.value)
            expired = session.execute(delete(IdempotencyKey).where(IdempotencyKey.expires_at < now))
            report.keys_expired = int(getattr(expired, "rowcount", 0) or 0)
            for job in _webhooks_due(session, now=now, grace_s=s.webhook_resend_grace_s):
                report.webhooks.append(job.id)
                send_webhook_after_commit(session, self.celery, job)
        if any((report.requeued, report.failed, report.resent, report.promoted, report.webhooks)):
            log.info(
                "sweep",
                extra={
                    "requeued": len(report.requeued),
                    "failed": len(report.failed),
                    "resent": len(report.resent),
                    "promoted": len(report.promoted),
                    "webhooks": len(report.webhooks),
                },
            )
        return report

    def run_forever(self, stop: threading.Event) -> None:
        from pathlib import Path

        from shared.liveness import touch

        alive = Path(self.settings.sweeper_liveness_file)
        while not stop.is_set():
            try:
                self.sweep_once()
            except Exception:
                log.exception("sweep failed; will retry next tick")
            # After every attempt, failed ones too: `vidq sweep-alive` catches a stuck loop, not a database outage.
            try:
                touch(alive)
            except OSError as exc:  # the probe's file never stops the sweeping (the probe then fails, and says so)
                log.warning("liveness file not writable", extra={"path": str(alive), "error": str(exc)})
            stop.wait(self.settings.sweep_interval_s)
        alive.unlink(missing_ok=True)  # a clean stop: the probe fails at once
