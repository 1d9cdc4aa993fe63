"""Which jobs render together: after a worker claims its job, compatible jobs waiting in the same class ride along
in one batch (one denoising loop for all), where the batch table says batching pays for the shape
(services/worker/batch_table.py).

Compatible means the same model, precision tier, shape, steps and guidance (``GenerationSpec.batch_key``). How long
the worker waits for riders depends on the class: a high job never waits (it takes only riders already queued), a
medium one waits from ``batch_window_medium_min_s`` up to ``batch_window_medium_max_s`` as its queue grows (more
waiting, more likely company), a low one until the batch is full or ``batch_window_low_s``. Riders are claimed
oldest first, each charged to its tenant's fair share (shared/jobs/fairness.py) and each with its own fencing token:
from its claim on, a rider is a job like any other — its own lease, progress, cancel and finalize.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field

import redis

from services.worker.batch_table import load
from shared.infra.config import Settings
from shared.infra.db import db_unreachable, session_scope
from shared.jobs.fairness import claim_riders
from shared.messaging.celery_app import VidqCelery
from shared.models import Job
from shared.queues import PriorityClass, video_queue
from shared.spec import GenerationSpec

log = logging.getLogger("vidq.worker.batching")


@dataclass(frozen=True, slots=True)
class Claimed:
    """A job this worker claimed, at ``token``, its attempt (the fencing token)."""

    job_id: uuid.UUID
    token: int
    tenant_id: str
    spec: GenerationSpec
    traceparent: str | None
    claimed_at: float = field(default_factory=time.monotonic)  # when: a job's cost runs from its claim to its end

    @classmethod
    def of(cls, job: Job) -> Claimed:
        """The job as its claim just returned it (its attempt is the new token)."""
        return cls(job.id, job.attempt, str(job.tenant_id), GenerationSpec.from_dict(job.spec), job.traceparent)


def window_s(settings: Settings, klass: PriorityClass, *, backlog: int, limit: int) -> float:
    """How long a worker waits for riders of ``klass`` with ``backlog`` messages on its queue."""
    if klass is PriorityClass.HIGH:
        return 0.0
    if klass is PriorityClass.LOW:
        return settings.batch_window_low_s
    low, high = settings.batch_window_medium_min_s, settings.batch_window_medium_max_s
    return low + (high - low) * min(1.0, backlog / max(1, 4 * limit))


def gather_riders(
    claimed: Claimed, *, klass: PriorityClass, pool: str, celery: VidqCelery, worker: str
) -> list[Claimed]:
    """Claim the jobs of ``klass`` in ``pool`` that render with ``claimed`` (none where the batch table says it renders
    alone)."""
    settings = celery.settings
    limit = load(settings.worker_batch_table, settings.device).max_batch(claimed.spec) - 1
    if limit <= 0:
        return []
    deadline = time.monotonic() + window_s(settings, klass, backlog=_backlog(celery, klass, pool), limit=limit + 1)
    riders: list[Claimed] = []
    while True:
        try:
            riders += _claim_riders(
                claimed, klass=klass, pool=pool, settings=settings, worker=worker, limit=limit - len(riders)
            )
        except Exception as exc:
            if not db_unreachable(exc):
                raise
            # Postgres went away: the batch is what was claimed so far (those riders are committed and run).
            log.warning("batch formation cut short: Postgres unreachable", extra={"error": repr(exc)[:200]})
            break
        if len(riders) >= limit or time.monotonic() >= deadline:
            break
        time.sleep(settings.batch_poll_s)
    if riders:
        log.info("batch formed", extra={"job_id": str(claimed.job_id), "riders": [str(r.job_id) for r in riders]})
    return riders


def _claim_riders(
    claimed: Claimed, *, klass: PriorityClass, pool: str, settings: Settings, worker: str, limit: int
) -> list[Claimed]:
    with session_scope(settings) as session:
        jobs = claim_riders(
            session,
            klass,
            key=claimed.spec.batch_key(),
            limit=limit,
            worker_id=worker,
            lease_s=settings.lease_s,
            weights=settings.fair_share_weights,
            pool=pool,
        )
        return [Claimed.of(job) for job in jobs]


def _backlog(celery: VidqCelery, klass: PriorityClass, pool: str) -> int:
    """Messages waiting on the class's queue in ``pool``; 0 when the broker does not say (the window is then its
    shortest)."""
    from services.worker.scheduling import scheduling_client

    try:
        return int(scheduling_client(celery).llen(f"{celery.settings.broker_key_prefix}{video_queue(klass, pool)}"))
    except (redis.RedisError, OSError):
        return 0
