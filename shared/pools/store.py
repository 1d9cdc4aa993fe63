"""The routing rules in Postgres and what operators do with them (``vidq pools``, ``/v1/admin/pools``), the re-routing
of a pool's queued jobs to ``stable``, and the figures that put pools side by side.

Every change is one transaction: a roll back (and a trip of the breaker) takes the pool out of routing and moves its
queued jobs to ``stable`` together; each moved job is sent to its stable queue once that commits. Its old message,
still on the pool's queue, is a turn of that pool's class with nothing of the pool to claim (shared/jobs/fairness.py),
so a moved job renders once, on stable. A job moved has ``enqueued_at`` cleared: if the send after the commit is
lost, the sweeper's never-sent query sends it again. Jobs already running in the pool finish there.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from shared.errors import InvalidRequest, NotFound
from shared.jobs.status import JobStatus
from shared.messaging.celery_app import VidqCelery
from shared.messaging.dispatch import send_job_after_commit
from shared.models import Job, Pool, Tenant, TenantPool
from shared.pools.rules import PoolRule, PoolState, RoutedBy, Rules, TenantRule
from shared.queues import POOL_NAME, STABLE_POOL

log = logging.getLogger("vidq.pools")

# What an API process reads each refresh (services/api/pools.py), on its own driver: both tables whole (pools are a
# handful; tenant_pools holds only tenants with a rule).
POOLS_SQL = "SELECT name, split_percent, state, state_reason FROM pools"
TENANTS_SQL = "SELECT tenant_id, pool, may_choose FROM tenant_pools"
REROUTE_BATCH = 500


def rules_from_rows(pools: list[Any], tenants: list[Any]) -> Rules:
    return Rules(
        pools={
            str(name): PoolRule(str(name), float(split), PoolState(state), str(reason or ""))
            for name, split, state, reason in pools
        },
        tenants={tenant_id: TenantRule(pool, bool(may_choose)) for tenant_id, pool, may_choose in tenants},
    )


def load_rules(session: Session) -> Rules:
    return rules_from_rows(list(session.execute(text(POOLS_SQL))), list(session.execute(text(TENANTS_SQL))))


# --- operators -------------------------------------------------------------------------------------------------------


def _checked(name: str) -> str:
    if not POOL_NAME.match(name):
        raise InvalidRequest(f"a pool name is 1-32 of a-z, 0-9 and '-', starting with a letter: {name!r}")
    return name


def _pool_row(session: Session, name: str, *, lock: bool = True) -> Pool:
    """The pool's row (created with no share and routable if it has none), locked for this transaction."""
    session.execute(pg_insert(Pool).values(name=name).on_conflict_do_nothing(index_elements=[Pool.name]))
    query = select(Pool).where(Pool.name == name)
    row = session.scalars(query.with_for_update() if lock else query).one()
    return row


def _set_state(pool: Pool, state: PoolState, reason: str) -> None:
    if pool.state != state.value or pool.state_reason != reason:
        pool.state, pool.state_reason, pool.state_changed_at = state.value, reason, func.now()
    pool.updated_at = func.now()


def set_split(session: Session, name: str, percent: float) -> None:
    """``name`` takes ``percent`` of the jobs no header or tenant rule routes (by the hash of their ids), and is back
    in routing if it was rolled back or tripped. The shares of all pools add up to at most 100; stable takes the
    rest."""
    _checked(name)
    if name == STABLE_POOL:
        raise InvalidRequest("stable takes whatever share the other pools leave; set theirs instead")
    if not 0 <= percent <= 100:
        raise InvalidRequest(f"a split is a percentage from 0 to 100, not {percent:g}")
    session.execute(text("SELECT pg_advisory_xact_lock(hashtext('vidq.pools.split'))"))  # one split change at a time
    pool = _pool_row(session, name)
    others = session.scalar(
        select(func.coalesce(func.sum(Pool.split_percent), 0.0)).where(Pool.name.not_in([name, STABLE_POOL]))
    )
    if float(others or 0.0) + percent > 100 + 1e-9:
        raise InvalidRequest(
            f"the pools' shares would add up to {float(others or 0.0) + percent:g}%; lower another pool's first",
            details={"others_percent": float(others or 0.0)},
        )
    pool.split_percent = percent
    _set_state(pool, PoolState.ROUTABLE, f"split set to {percent:g}%")
    session.flush()
    log.info("pool split set", extra={"pool": name, "split_percent": percent})


def promote(session: Session, name: str) -> None:
    """``name`` takes every job no header or tenant rule routes elsewhere (a 100% split; other pools' shares go to
    0). Pools are worker groups: once the stable workers run what ``name`` runs, set its split back to 0."""
    _checked(name)
    if name == STABLE_POOL:
        raise InvalidRequest("stable is the default already")
    session.execute(text("SELECT pg_advisory_xact_lock(hashtext('vidq.pools.split'))"))
    pool = _pool_row(session, name)
    session.execute(update(Pool).where(Pool.name != name).values(split_percent=0.0, updated_at=func.now()))
    pool.split_percent = 100.0
    _set_state(pool, PoolState.ROUTABLE, "promoted: 100% of the split")
    session.flush()
    log.warning("pool promoted", extra={"pool": name})


def take_out(session: Session, celery: VidqCelery, name: str, *, state: PoolState, reason: str) -> list[uuid.UUID]:
    """Take ``name`` out of routing (``state``: rolled back or tripped; its share goes to 0) and move up to
    ``REROUTE_BATCH`` of its queued jobs to stable (the sweeper moves the rest). Returns the ids moved."""
    _checked(name)
    if name == STABLE_POOL:
        raise InvalidRequest("stable is the fallback of every other pool: it cannot be taken out of routing")
    pool = _pool_row(session, name)
    pool.split_percent = 0.0
    _set_state(pool, state, reason)
    session.flush()
    moved = reroute_queued(session, celery, name, limit=REROUTE_BATCH)
    log.warning(
        "pool taken out of routing", extra={"pool": name, "state": state.value, "reason": reason, "moved": len(moved)}
    )
    return moved


def rollback(session: Session, celery: VidqCelery, name: str) -> list[uuid.UUID]:
    """An operator's roll back: ``name`` gets no new job, its queued jobs go to stable (none lost, none rendered
    twice), its running jobs finish where they are."""
    return take_out(session, celery, name, state=PoolState.ROLLED_BACK, reason="rolled back by an operator")


def reroute_queued(session: Session, celery: VidqCelery, name: str, *, limit: int) -> list[uuid.UUID]:
    """Move up to ``limit`` of ``name``'s queued jobs (oldest first, ix_jobs_queued_pooled) to stable, each sent to
    its stable queue after the commit. Rows a worker is claiming right now are skipped (it claims them)."""
    jobs = session.scalars(
        select(Job)
        .where(Job.status == JobStatus.QUEUED.value, Job.pool == name, Job.pool != STABLE_POOL)
        .order_by(Job.created_at, Job.id)
        .limit(limit)
        .with_for_update(skip_locked=True)
    ).all()
    for job in jobs:
        job.pool, job.routed_by, job.enqueued_at = STABLE_POOL, RoutedBy.REROUTED.value, None
        send_job_after_commit(session, celery, job)
    session.flush()
    return [job.id for job in jobs]


def _tenant(session: Session, tenant: str) -> Tenant:
    query = select(Tenant).where(Tenant.name == tenant)
    row = session.scalars(query).one_or_none()
    if row is None:
        try:
            row = session.get(Tenant, uuid.UUID(tenant))
        except ValueError:
            row = None
    if row is None:
        raise NotFound(f"no tenant named {tenant!r}")
    return row


def set_tenant(session: Session, tenant: str, *, pool: str | None = None, may_choose: bool | None = None) -> None:
    """Assign ``tenant`` (a name or id) to ``pool`` (``""``: no assignment, the split decides; None: unchanged) and/or
    allow it to choose a pool with the request header (None: unchanged)."""
    row = _tenant(session, tenant)
    values: dict[str, Any] = {}
    if pool is not None:
        if pool:
            _pool_row(session, _checked(pool), lock=False)
        values["pool"] = pool or None
    if may_choose is not None:
        values["may_choose"] = may_choose
    if not values:
        return
    session.execute(
        pg_insert(TenantPool)
        .values(tenant_id=row.id, **values)
        .on_conflict_do_update(index_elements=[TenantPool.tenant_id], set_=values)
    )
    log.info("tenant routing set", extra={"tenant": row.name, **{k: v for k, v in values.items()}})


# --- what there is -----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PoolView:
    name: str
    split_percent: float
    state: str
    state_reason: str
    state_changed_at: datetime | None
    live_workers: int | None  # None: the broker did not say
    queued: int
    running: int
    tenants_assigned: list[str]
    tenants_choosing: list[str]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["state_changed_at"] = None if self.state_changed_at is None else self.state_changed_at.isoformat()
        return out


def overview(session: Session, *, live: Mapping[str, int] | None) -> list[PoolView]:
    """Every pool (stable first): its rule, state, live workers, queued and running jobs, and tenant rules."""
    rows = {p.name: p for p in session.scalars(select(Pool))}
    counts: dict[tuple[str, str], int] = {
        (pool, status): n
        for pool, status, n in session.execute(
            select(Job.pool, Job.status, func.count())
            .where(Job.status.in_([JobStatus.QUEUED.value, JobStatus.RUNNING.value]))
            .group_by(Job.pool, Job.status)
        )
    }
    assigned: dict[str, list[str]] = {}
    choosing: list[str] = []
    for name, pool, may_choose in session.execute(
        select(Tenant.name, TenantPool.pool, TenantPool.may_choose).join(Tenant, Tenant.id == TenantPool.tenant_id)
    ):
        if pool:
            assigned.setdefault(pool, []).append(name)
        if may_choose:
            choosing.append(name)
    names = sorted({STABLE_POOL, *rows, *(live or {}), *(p for p, _ in counts)}, key=lambda n: (n != STABLE_POOL, n))
    others = sum(r.split_percent for n, r in rows.items() if n != STABLE_POOL)
    views = []
    for name in names:
        row = rows.get(name)
        views.append(
            PoolView(
                name=name,
                split_percent=max(0.0, 100.0 - others) if name == STABLE_POOL else (row.split_percent if row else 0.0),
                state=row.state if row else PoolState.ROUTABLE.value,
                state_reason=row.state_reason if row else "",
                state_changed_at=row.state_changed_at if row else None,
                live_workers=None if live is None else live.get(name, 0),
                queued=counts.get((name, JobStatus.QUEUED.value), 0),
                running=counts.get((name, JobStatus.RUNNING.value), 0),
                tenants_assigned=sorted(assigned.get(name, [])),
                tenants_choosing=sorted(choosing) if name == STABLE_POOL else [],
            )
        )
    return views


# --- side by side ------------------------------------------------------------------------------------------------

# Jobs that finished within the window, per pool (ix_jobs_pool_finished), those served from the result cache left out
# (nothing rendered). Queue wait: created → started of the jobs that started.
_OUTCOMES = text(
    """
    SELECT pool,
           count(*) FILTER (WHERE status = 'succeeded') AS succeeded,
           count(*) FILTER (WHERE status = 'failed') AS failed,
           count(*) FILTER (WHERE status = 'cancelled') AS cancelled,
           percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM started_at - created_at))
               FILTER (WHERE started_at IS NOT NULL) AS wait_p50,
           percentile_cont(0.9) WITHIN GROUP (ORDER BY extract(epoch FROM started_at - created_at))
               FILTER (WHERE started_at IS NOT NULL) AS wait_p90
    FROM jobs
    WHERE pool = ANY(:pools) AND finished_at >= now() - make_interval(secs => :window) AND result_of IS NULL
    GROUP BY pool
    """
)
_ERRORS = text(
    """
    SELECT pool, error_code, count(*) FROM jobs
    WHERE pool = ANY(:pools) AND finished_at >= now() - make_interval(secs => :window) AND status = 'failed'
    GROUP BY pool, error_code
    """
)
# Denoising seconds per step of the succeeded renders, per pool, model and shape.
_STEPS = text(
    """
    SELECT pool, spec ->> 'model' AS model,
           (spec ->> 'width') || 'x' || (spec ->> 'height') || 'x' || (spec ->> 'num_frames') AS shape,
           count(*) AS n,
           percentile_cont(0.5) WITHIN GROUP (ORDER BY (timings ->> 'denoise')::float8 / (spec ->> 'steps')::int)
               AS p50,
           percentile_cont(0.9) WITHIN GROUP (ORDER BY (timings ->> 'denoise')::float8 / (spec ->> 'steps')::int)
               AS p90
    FROM jobs
    WHERE pool = ANY(:pools) AND finished_at >= now() - make_interval(secs => :window) AND status = 'succeeded'
      AND result_of IS NULL AND timings ? 'denoise' AND (spec ->> 'steps')::int > 0
    GROUP BY 1, 2, 3
    ORDER BY 2, 3, 1
    """
)


def compare(session: Session, *, window_s: float, pools: list[str] | None = None) -> dict[str, Any]:
    """Each pool's figures over the last ``window_s`` seconds: jobs finished, success rate (succeeded of succeeded +
    failed), queue wait p50/p90, errors by code, and denoising seconds per step per model and shape. ``pools``:
    which (default: every pool with a rule, and stable)."""
    if pools is None:
        pools = sorted({STABLE_POOL, *session.scalars(select(Pool.name))})
    params = {"pools": pools, "window": float(window_s)}
    figures: dict[str, dict[str, Any]] = {
        p: {
            "succeeded": 0,
            "failed": 0,
            "cancelled": 0,
            "success_rate": None,
            "queue_wait_p50_s": None,
            "queue_wait_p90_s": None,
            "errors": {},
            "render_step_s": [],
        }
        for p in pools
    }
    for pool, succeeded, failed, cancelled, p50, p90 in session.execute(_OUTCOMES, params):
        f = figures[pool]
        f.update(succeeded=succeeded, failed=failed, cancelled=cancelled)
        f["success_rate"] = round(succeeded / (succeeded + failed), 4) if succeeded + failed else None
        f["queue_wait_p50_s"] = None if p50 is None else round(float(p50), 3)
        f["queue_wait_p90_s"] = None if p90 is None else round(float(p90), 3)
    for pool, code, n in session.execute(_ERRORS, params):
        figures[pool]["errors"][code or "unknown"] = n
    for pool, model, shape, n, p50, p90 in session.execute(_STEPS, params):
        figures[pool]["render_step_s"].append(
            {"model": model, "shape": shape, "jobs": n, "p50": round(float(p50), 4), "p90": round(float(p90), 4)}
        )
    return {"window_s": float(window_s), "pools": figures}


def waiting_pools(session: Session) -> dict[str, str]:
    """The pools other than stable that hold queued jobs (an index-only read of ix_jobs_queued_pooled), with their
    state (``routable`` for a pool without a row)."""
    names = session.scalars(
        select(Job.pool).where(Job.status == JobStatus.QUEUED.value, Job.pool != STABLE_POOL).distinct()
    ).all()
    states = dict(session.execute(select(Pool.name, Pool.state).where(Pool.name.in_(names))).tuples().all())
    return {name: states.get(name, PoolState.ROUTABLE.value) for name in names}
