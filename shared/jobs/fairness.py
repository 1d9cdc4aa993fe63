"""Fair share between tenants inside a class: which queued job a worker claims next.

Classes keep their strict order (a worker takes from the first non-empty class queue) and aging still moves a
waiting job up. Inside a class, a message is a turn for that class, not for one job: the worker that takes it claims
the job whose tenant is furthest behind in the class's fair order. One tenant's thousand queued jobs then do not make
another tenant's first job wait behind them: the newcomer's job starts within a job slot or two of its arrival, and
tenants with work in the class take turns in proportion to their weights (``VIDQ_FAIR_SHARE_WEIGHTS``).

The order is start-time fair queueing:

- each tenant has, per class, a virtual time ``pass``: when its next job would start (``fair_shares``);
- the class has a clock: the start time of the job claimed last (``fair_clocks``);
- a claim picks, among the oldest queued job of each tenant, the one whose tenant has the smallest
  ``greatest(pass, clock)``, the oldest job first among equals; it advances that tenant's pass by 1 / its weight and
  the clock to the start time it used.

A tenant that was idle rejoins at the clock (``greatest``): time it did not use is not saved up, so it cannot take
a long run of turns when it comes back. Within one tenant, jobs start oldest first.

Every queued job of a class has a message on the class's queue, and every claim takes one message and one queued
job, so the messages never run out before the jobs do; a message left over (its job was cancelled, or claimed
through another message) claims the next job in the order, or nothing. Only jobs whose message is out are
candidates (``next_turn``), so a job never loses its message to one that has none yet.

Claims of one class are serialised by a transaction-scoped advisory lock: two workers never read the same order and
pick the same job. A claim happens once per render, seconds apart, so the lock is never contended for long.

Each worker pool (shared/pools) has its own queues and so its own fair order per class: a message of a pool's queue
is a turn of that class in that pool, and claims only that pool's jobs; passes and clocks are kept per pool.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.orm import Session

from shared.jobs.states import claim
from shared.models import Job
from shared.queues import STABLE_POOL, PriorityClass
from shared.spec import GenerationSpec

# The per-class-and-pool lock key space: pg_advisory_xact_lock(hashtext('vidq.fair.<class>.<pool>')).
_LOCK = text("SELECT pg_advisory_xact_lock(hashtext('vidq.fair.' || :klass || '.' || :pool))")

# The oldest queued job of each tenant in the class and pool (ix_jobs_queued_fair), each tenant's start time, in fair
# order.
# The scan is O(queued jobs of the class), which the admission watermark bounds.
_NEXT = text(
    """
    WITH heads AS (
        SELECT DISTINCT ON (j.tenant_id) j.id, j.tenant_id, j.created_at
        FROM jobs j
        WHERE j.status = 'queued' AND j.priority_class = :klass AND j.pool = :pool
          AND NOT j.cancel_requested AND j.attempt < j.max_attempts
          AND (j.enqueued_at IS NOT NULL OR j.id = :offered)
        ORDER BY j.tenant_id, j.created_at, j.id
    ),
    clock AS (
        SELECT coalesce((SELECT vtime FROM fair_clocks WHERE priority_class = :klass AND pool = :pool), 0.0) AS v
    )
    SELECT h.id, h.tenant_id, greatest(coalesce(s.pass, 0.0), clock.v) AS start
    FROM heads h
    CROSS JOIN clock
    LEFT JOIN fair_shares s ON s.priority_class = :klass AND s.pool = :pool AND s.tenant_id = h.tenant_id
    ORDER BY start, h.created_at, h.id
    LIMIT 1
    """
)

# Charge a claim: the tenant's pass moves on from its start time (its pass, or the class's clock when that is later)
# by 1 / its weight (weights by tenant name, default 1); a turn's claim also moves the class's clock to that start
# (never back). Run under the class's lock, the start is the one ``_NEXT`` ordered the tenant by.
_CHARGE = text(
    """
    WITH weight AS (
        SELECT coalesce((CAST(:weights AS jsonb) ->> t.name)::float8, 1.0) AS w FROM tenants t WHERE t.id = :tenant
    ),
    start AS (
        SELECT greatest(
            coalesce(
                (SELECT pass FROM fair_shares WHERE priority_class = :klass AND pool = :pool AND tenant_id = :tenant),
                0.0
            ),
            coalesce((SELECT vtime FROM fair_clocks WHERE priority_class = :klass AND pool = :pool), 0.0)
        ) AS s
    ),
    share AS (
        INSERT INTO fair_shares (priority_class, pool, tenant_id, pass)
        SELECT :klass, :pool, :tenant, start.s + 1.0 / weight.w FROM weight CROSS JOIN start
        ON CONFLICT (priority_class, pool, tenant_id) DO UPDATE SET pass = excluded.pass
    )
    INSERT INTO fair_clocks (priority_class, pool, vtime) SELECT :klass, :pool, start.s FROM start WHERE :moves_clock
    ON CONFLICT (priority_class, pool) DO UPDATE SET vtime = greatest(fair_clocks.vtime, excluded.vtime)
    """
)


@dataclass(frozen=True, slots=True)
class Turn:
    """The job a message of a class should claim, and its tenant."""

    job_id: uuid.UUID
    tenant_id: uuid.UUID


def next_turn(session: Session, klass: PriorityClass, *, offered: uuid.UUID, pool: str = STABLE_POOL) -> Turn | None:
    """The job to claim for ``offered``'s message, taken from the queue of ``klass`` in ``pool``; None when the class
    has no claimable job there. Locks the class's fair order in the pool until the caller's transaction ends (call
    ``charge`` in it once the claim succeeded).

    Candidates are the jobs already sent (``enqueued_at`` recorded) and the message's own: each has a message on its
    way, so whichever is claimed, a message is left for every job still waiting. A job committed but not sent yet has
    none; it is claimed through its own message once the sender (or the sweeper) sends it."""
    session.execute(_LOCK, {"klass": klass.value, "pool": pool})
    row = session.execute(_NEXT, {"klass": klass.value, "pool": pool, "offered": offered}).first()
    if row is None:
        return None
    return Turn(job_id=row.id, tenant_id=row.tenant_id)


def charge(
    session: Session,
    klass: PriorityClass,
    tenant: uuid.UUID,
    *,
    weights: Mapping[str, float],
    moves_clock: bool,
    pool: str = STABLE_POOL,
) -> None:
    """Advance ``tenant`` past the job of ``klass`` (in ``pool``) it just claimed; ``moves_clock``: it was the class's
    turn (not a batch's rider), so the class's clock moves to its start."""
    params = {
        "klass": klass.value,
        "pool": pool,
        "tenant": tenant,
        "weights": json.dumps(dict(weights)),
        "moves_clock": moves_clock,
    }
    session.execute(_CHARGE, params)


def claim_next(
    session: Session,
    klass: PriorityClass,
    *,
    offered: uuid.UUID,
    worker_id: str,
    lease_s: float,
    weights: Mapping[str, float],
    pool: str = STABLE_POOL,
) -> Job | None:
    """Claim the class's next job in ``pool``'s fair order (queued → running, shared/jobs/states.py ``claim``) and
    charge its tenant, in the caller's transaction; None when the class has nothing to claim there."""
    turn = next_turn(session, klass, offered=offered, pool=pool)
    if turn is None:
        return None
    job = claim(session, turn.job_id, worker_id=worker_id, lease_s=lease_s)
    if job is not None:  # the row was read under the class's lock: only a cancel in between can refuse the claim
        charge(session, klass, turn.tenant_id, weights=weights, moves_clock=True, pool=pool)
    return job


# Queued jobs of the class that can share a batch with one already claimed (their spec contains the batch's key
# fields, and lacks those the key has at their stored default), oldest first; only those whose message is out, as
# for a turn.
_RIDERS = text(
    """
    SELECT j.id, j.tenant_id FROM jobs j
    WHERE j.status = 'queued' AND j.priority_class = :klass AND j.pool = :pool AND j.spec @> CAST(:key AS jsonb)
      AND NOT jsonb_exists_any(j.spec, CAST(:absent AS text[]))
      AND NOT j.cancel_requested AND j.attempt < j.max_attempts AND j.enqueued_at IS NOT NULL
    ORDER BY j.created_at, j.id
    LIMIT :n
    """
)


def claim_riders(
    session: Session,
    klass: PriorityClass,
    *,
    key: Mapping[str, object],
    limit: int,
    worker_id: str,
    lease_s: float,
    weights: Mapping[str, float],
    pool: str = STABLE_POOL,
) -> list[Job]:
    """Claim up to ``limit`` queued jobs of ``klass`` in ``pool`` whose spec matches ``key`` (the fields a batch
    shares), oldest first, under the class's lock, each charged to its tenant as a turn. Their messages stay on the
    queue and, as any message left over, claim the class's next job in turn."""
    if limit <= 0:
        return []
    session.execute(_LOCK, {"klass": klass.value, "pool": pool})
    # As jobs.spec stores it: an optional field at its default is left out (a job that names no precision, uses no
    # step cache), so the key's such fields must be absent from a rider's spec.
    absent = [name for name, value in key.items() if GenerationSpec.left_out(name, value)]
    present = {name: value for name, value in key.items() if name not in absent}
    params = {"klass": klass.value, "pool": pool, "key": json.dumps(present), "absent": absent, "n": limit}
    rows = session.execute(_RIDERS, params).all()
    claimed = []
    for row in rows:
        job = claim(session, row.id, worker_id=worker_id, lease_s=lease_s)
        if job is not None:
            charge(session, klass, row.tenant_id, weights=weights, moves_clock=False, pool=pool)  # a turn of its own
            claimed.append(job)
    return claimed
