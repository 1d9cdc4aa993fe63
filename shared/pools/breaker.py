"""A pool's failure-rate breaker: a pool whose jobs fail too often is taken out of routing by itself, before an
operator notices.

Run by the sweeper each tick (one replica at a time): for every routable pool other than ``stable``, the jobs that
finished in the last ``pool_breaker_window_s`` — and since the pool's last change of state, so a pool put back into
routing starts with a clean window — are counted; once at least ``pool_breaker_min_jobs`` of them finished and at
least ``pool_breaker_failure_ratio`` of those that succeeded or failed failed, the pool trips: state ``tripped``,
its share 0, its queued jobs moved to stable, the reason kept on the pool (``vidq pools show``) and logged. Cancelled
jobs and jobs served from the result cache count for nothing. Unlike the in-process breakers
(shared/infra/breakers.py) it does not close again on its own: a release that failed waits for an operator
(``vidq pools set-split``), who decides when it is fixed.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from shared.infra.config import Settings
from shared.messaging.celery_app import VidqCelery
from shared.models import Pool
from shared.pools.rules import PoolState
from shared.pools.store import take_out
from shared.queues import STABLE_POOL

FAILURE_WINDOW = text(
    """
    SELECT count(*) FILTER (WHERE status = 'failed') AS failed,
           count(*) FILTER (WHERE status IN ('succeeded', 'failed')) AS decided
    FROM jobs
    WHERE pool = :pool AND result_of IS NULL
      AND finished_at >= greatest(now() - make_interval(secs => :window), :since)
    """
)


@dataclass(frozen=True, slots=True)
class Trip:
    pool: str
    failed: int
    decided: int
    moved: list[uuid.UUID]


def evaluate(session: Session, celery: VidqCelery, settings: Settings) -> list[Trip]:
    """Trip every routable pool past its threshold, in the caller's transaction."""
    trips = []
    pools = session.scalars(
        select(Pool).where(Pool.name != STABLE_POOL, Pool.state == PoolState.ROUTABLE.value).with_for_update()
    ).all()
    for pool in pools:
        failed, decided = session.execute(
            FAILURE_WINDOW,
            {"pool": pool.name, "window": settings.pool_breaker_window_s, "since": pool.state_changed_at},
        ).one()
        if decided < settings.pool_breaker_min_jobs or failed < settings.pool_breaker_failure_ratio * decided:
            continue
        reason = (
            f"breaker: {failed} of {decided} jobs failed in the last {settings.pool_breaker_window_s:g} s "
            f"(threshold {settings.pool_breaker_failure_ratio:.0%} of at least {settings.pool_breaker_min_jobs})"
        )
        moved = take_out(session, celery, pool.name, state=PoolState.TRIPPED, reason=reason)
        trips.append(Trip(pool.name, int(failed), int(decided), moved))
    return trips
