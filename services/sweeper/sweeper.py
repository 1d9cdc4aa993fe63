"""The sweeper: the loop that makes "losing nothing" true.

Each tick runs these steps, each in a short transaction of its own under a Postgres advisory lock (so any number
of API replicas can run it, one at a time; a step that finds the lock taken ends the tick):
1. running jobs whose lease expired (dead worker) go back to ``queued`` (or ``failed`` past ``max_attempts``);
2. queued jobs never sent (crash between commit and send) or sent long ago and never claimed are re-sent;
3. aging, the anti-starvation rule: a job still queued ``aging_promote_after_s`` after its last send moves one
   class up (low → medium → high; its ``priority_class``, changed in this step's transaction) and is sent to that
   class's queue. Workers take queues in strict priority order, so without this a steady stream of high jobs could
   hold a low job forever; with it, a low job waits at most about 2 × aging_promote_after_s before it competes in
   the high queue, first come first served. The old message is dropped by whichever worker meets it later (the
   job is no longer ``queued`` then);
4. finished jobs with a webhook but no delivery attempt on record are handed to the webhook queue again (after
   ``webhook_resend_grace_s``; after a day without one the sweeper gives up on it, as it always has);
5. webhook retries that are due (``webhook_deliveries.next_attempt_at``, planned by the schedule in
   shared/webhooks/schedule.py) are handed to the webhook queue; the hand-over is a lease (``handed_over_at``): a
   lost message is handed over again after ``webhook_resend_grace_s``;
6. expired idempotency keys are deleted, a batch per transaction.
Messages are registered in the step's transaction and sent after it commits (shared/messaging/dispatch.py).

Every step reads an index that holds only what it may act on (shared/models.py) and takes at most a batch, so a
tick with nothing due costs a few index probes on a table of millions of jobs, and no transaction holds row locks
for longer than one batch. Splitting the tick lets a second replica interleave its steps with ours between two
transactions: each step stays correct on its own (rows are taken FOR UPDATE SKIP LOCKED), and the worst it
causes is a duplicate message, which the worker's claim drops.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from shared.infra.config import Settings
from shared.infra.redis_clients import broker_client
from shared.jobs import repository
from shared.jobs.states import recover_expired
from shared.jobs.status import JobStatus
from shared.messaging.celery_app import VidqCelery
from shared.messaging.dispatch import flush_send_records, send_job_after_commit, send_webhook_after_commit
from shared.pools.breaker import evaluate
from shared.pools.live import live_workers_or_none
from shared.pools.rules import PoolState
from shared.pools.store import reroute_queued, waiting_pools
from shared.webhooks import deliveries

log = logging.getLogger("vidq.sweeper")

_LOCK_KEY = 0x76696471  # "vidq"
_BATCH = 100  # jobs per step and tick
_KEY_BATCH = 1000  # idempotency keys per DELETE: one short transaction each
_KEY_BATCHES_PER_TICK = 10  # 10,000 keys a tick outpaces any submit rate this control plane sustains
# A webhook the sweeper could not hand over for this long is given up (logged): its mark leaves the index.
_WEBHOOK_GIVE_UP = timedelta(days=1)


@dataclass
class SweepReport:
    requeued: list[uuid.UUID] = field(default_factory=list)
    failed: list[uuid.UUID] = field(default_factory=list)
    resent: list[uuid.UUID] = field(default_factory=list)
    promoted: list[uuid.UUID] = field(default_factory=list)
    webhooks: list[uuid.UUID] = field(default_factory=list)
    webhook_retries: list[uuid.UUID] = field(default_factory=list)
    rerouted: list[uuid.UUID] = field(default_factory=list)  # queued jobs moved to stable from another pool
    tripped: list[str] = field(default_factory=list)  # pools their breaker took out of routing
    keys_expired: int = 0
    skipped: bool = False


Step = Callable[[Session, datetime, "SweepReport"], int]


class Sweeper:
    def __init__(self, settings: Settings, *, celery: VidqCelery, sessions: sessionmaker[Session]) -> None:
        self.settings = settings
        self.celery = celery
        self.sessions = sessions
        self._pool_seen_live: dict[str, float] = {}  # pool → monotonic time it last had a live worker (or was met)

    def sweep_once(self) -> SweepReport:
        report = SweepReport()
        self._sweep(report)
        if any(
            (
                report.requeued,
                report.failed,
                report.resent,
                report.promoted,
                report.webhooks,
                report.webhook_retries,
                report.rerouted,
            )
        ):
            log.info(
                "sweep",
                extra={
                    "requeued": len(report.requeued),
                    "failed": len(report.failed),
                    "resent": len(report.resent),
                    "promoted": len(report.promoted),
                    "webhooks": len(report.webhooks),
                    "webhook_retries": len(report.webhook_retries),
                    "rerouted": len(report.rerouted),
                    "tripped": report.tripped,
                },
            )
        return report

    def _sweep(self, report: SweepReport) -> None:
        steps: list[Step] = [
            self._leases,
            self._unsent_or_lost,
            self._aging,
            self._pools,
            self._webhooks,
            self._webhook_retries,
        ]
        for step in steps:
            if self._run(step, report) is None:
                return
        for _ in range(_KEY_BATCHES_PER_TICK):
            deleted = self._run(self._keys, report)
            if deleted is None or deleted < _KEY_BATCH:
                return

    def _run(self, step: Step, report: SweepReport) -> int | None:
        """One step in one transaction; None when another replica holds the lock (the tick ends there)."""
        with self.sessions() as session, session.begin():
            locked, now = session.execute(text("SELECT pg_try_advisory_xact_lock(:k), now()"), {"k": _LOCK_KEY}).one()
            if not locked:
                report.skipped = True
                return None
            done = step(session, now, report)
        # The step's sends are on record before the next step reads the queue, and when the tick ends.
        flush_send_records(self.celery)
        return done

    def _leases(self, session: Session, now: datetime, report: SweepReport) -> int:
        jobs = repository.expired_leases(session, now=now, limit=_BATCH)
        for job in jobs:
            after = recover_expired(session, job)
            if after is None:
                continue
            if after.status == JobStatus.QUEUED.value:
                report.requeued.append(after.id)
                send_job_after_commit(session, self.celery, after)
            else:
                report.failed.append(after.id)
                send_webhook_after_commit(session, self.celery, after)
        return len(jobs)

    def _unsent_or_lost(self, session: Session, now: datetime, report: SweepReport) -> int:
        s = self.settings
        jobs = repository.unsent_or_lost(
            session, now=now, grace_s=s.enqueue_grace_s, resend_s=s.queued_resend_s, limit=_BATCH
        )
        for job in jobs:
            # Requeued by step 1 a moment ago: its send is on its way (or failed, and the next tick retries it).
            if job.id not in report.requeued:
                report.resent.append(job.id)
                send_job_after_commit(session, self.celery, job)
        return len(jobs)

    def _aging(self, session: Session, now: datetime, report: SweepReport) -> int:
        jobs = repository.promotion_due(session, now=now, after_s=self.settings.aging_promote_after_s, limit=_BATCH)
        for job in jobs:
            repository.promote(session, job)  # its class moves up in this transaction
            report.promoted.append(job.id)
            send_job_after_commit(session, self.celery, job)  # to the new class's queue, after the commit
        return len(jobs)

    def _pools(self, session: Session, now: datetime, report: SweepReport) -> int:
        """Worker pools (shared/pools): trip the breaker of a pool whose jobs fail too often; move to stable the queued
        jobs of a pool out of routing (rolled back, tripped) or without a live worker for pool_reroute_after_s."""
        for trip in evaluate(session, self.celery, self.settings):
            report.tripped.append(trip.pool)
            report.rerouted += trip.moved
        queued = waiting_pools(session)
        live = self._live_pools()
        moved = 0
        for pool, state in queued.items():
            if state != PoolState.ROUTABLE.value:
                reason = state
            elif live is None or self._recently_live(pool, live):
                continue
            else:
                reason = "no_live_worker"
            jobs = reroute_queued(session, self.celery, pool, limit=_BATCH)
            if jobs:
                log.warning("queued jobs moved to stable", extra={"pool": pool, "reason": reason, "jobs": len(jobs)})
            report.rerouted += jobs
            moved += len(jobs)
        return moved

    def _live_pools(self) -> dict[str, int] | None:
        """Live workers per pool; None when the broker's Redis does not answer (nothing is moved for it then)."""
        client = self.celery.resource("pools-live", lambda: broker_client(self.settings, retries=0))
        return live_workers_or_none(client, self.settings)

    def _recently_live(self, pool: str, live: dict[str, int]) -> bool:
        """Whether ``pool`` had a live worker within pool_reroute_after_s (a pool first met now counts as live: its
        workers may be loading their model)."""
        now = time.monotonic()
        if live.get(pool, 0) > 0:
            self._pool_seen_live[pool] = now
            return True
        return now - self._pool_seen_live.setdefault(pool, now) < self.settings.pool_reroute_after_s

    def _keys(self, session: Session, now: datetime, report: SweepReport) -> int:
        deleted = repository.expire_keys(session, now=now, limit=_KEY_BATCH)
        report.keys_expired += deleted
        return deleted

    def _webhooks(self, session: Session, now: datetime, report: SweepReport) -> int:
        jobs = repository.webhooks_due(
            session, now=now, grace_s=self.settings.webhook_resend_grace_s, limit=_BATCH
        )  # marks older than _WEBHOOK_GIVE_UP come back too, to be cleared here
        # A mark moves on with each hand-over (below) and each deferral: the day is counted from the earlier of it
        # and the finish.
        finished = {job.id: min(t for t in (job.finished_at, job.webhook_pending_since, now) if t) for job in jobs}
        stale = [job_id for job_id, at in finished.items() if at < now - _WEBHOOK_GIVE_UP]
        if stale:
            repository.clear_webhook_pending(session, stale)
            log.warning("webhooks never handed over; giving up", extra={"jobs": [str(j) for j in stale]})
        for job in jobs:
            if job.id not in stale:
                report.webhooks.append(job.id)
                # Handed over now: the next hand-over is a grace period away, not the next tick (a webhook worker
                # down for an hour must not find a message per job per tick on its queue when it comes back).
                job.webhook_pending_since = now
                send_webhook_after_commit(session, self.celery, job)
        return len(jobs)

    def _webhook_retries(self, session: Session, now: datetime, report: SweepReport) -> int:
        due = deliveries.retries_due(session, now=now, grace_s=self.settings.webhook_resend_grace_s, limit=_BATCH)
        for delivery, job in due:
            delivery.handed_over_at = now
            report.webhook_retries.append(job.id)
            send_webhook_after_commit(session, self.celery, job)
        return len(due)

    def run_forever(self, stop: threading.Event) -> None:
        from pathlib import Path

        from shared.infra.liveness import touch

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
