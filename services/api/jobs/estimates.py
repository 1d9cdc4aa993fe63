"""ETA quotes: when a waiting or running job is expected to start and finish, and the GPU seconds it will take.

Each API process keeps a view of the fleet, refreshed every ``eta_refresh_s`` in the background: the render costs
the workers measured (shared/scheduling/costs.py), every queued job with its cost, the work still running, and the
number of live workers (the admission watermark's last step). A quote is then arithmetic on that view, with no I/O:
it costs a submit or a read nothing but a little CPU.

The work ahead of a queued job follows how jobs are taken:

- every job of a higher class (classes are served in strict order);
- in its own class, its tenant's older jobs, and of every other tenant as many jobs as fair share starts before it
  (the tenants take turns in proportion to their weights: shared/jobs/fairness.py);
- what is still running.

The view ages between refreshes: the work it saw shrinks by what the live workers have done since, and the jobs
this process admitted since count whole.

The job starts when the live workers have worked that off together (``work_ahead_s / workers``) and finishes its own
cost later. A running job is quoted from its progress. There is no quote for a finished job, for a model no worker
has measured yet, or while no worker is alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from services.api.store import JobStore
from shared.infra.config import Settings
from shared.infra.redis_clients import broker_client
from shared.jobs.schemas import EstimateOut
from shared.jobs.status import JobStatus
from shared.models import Job
from shared.queues import PriorityClass
from shared.scheduling import costs
from shared.spec import GenerationSpec

log = logging.getLogger("vidq.api.estimates")

_ORDER = list(PriorityClass)  # strict priority: high, medium, low


@dataclass(frozen=True, slots=True)
class Waiting:
    created_at: datetime
    cost_s: float
    since_refresh: bool = False  # admitted by this process after the view was read (``Estimator.admitted``)


@dataclass
class View:
    """The fleet as one refresh saw it."""

    costs: costs.CostModel
    workers: int
    taken_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    running_s: float = 0.0  # GPU seconds left of the running jobs
    typical_s: float = 0.0  # what a queued job of an unmeasured model counts as: the median queued job
    # class → tenant → its queued jobs, oldest first
    queues: dict[str, dict[uuid.UUID, list[Waiting]]] = field(default_factory=dict)
    weights: dict[uuid.UUID, float] = field(default_factory=dict)

    def work_ahead_s(
        self, klass: str, tenant: uuid.UUID, created_at: datetime, *, now: datetime | None = None
    ) -> float:
        """GPU seconds of work that starts before a job of ``tenant`` in ``klass`` created at ``created_at``.

        The workers did not stand still since the view was read: the work it saw then shrinks by what the live
        workers have done since (``now`` − ``taken_at``, each worker a second of work a second); what this process
        admitted since counts whole."""
        ahead: list[Waiting] = []
        for higher in _ORDER[: _ORDER.index(PriorityClass(klass))]:
            ahead += [w for waiting in self.queues.get(higher.value, {}).values() for w in waiting]
        same = self.queues.get(klass, {})
        mine = [w for w in same.get(tenant, []) if w.created_at < created_at]
        ahead += mine
        turns = len(mine) + 1  # this job is its tenant's turn number len(mine) + 1
        own_weight = self.weights.get(tenant, 1.0)
        for other, waiting in same.items():
            if other != tenant:
                ahead += waiting[: min(len(waiting), round(turns * self.weights.get(other, 1.0) / own_weight))]
        seen = self.running_s + sum(w.cost_s for w in ahead if not w.since_refresh)
        elapsed = 0.0 if now is None else max(0.0, (now - self.taken_at).total_seconds())
        return max(0.0, seen - elapsed * self.workers) + sum(w.cost_s for w in ahead if w.since_refresh)


class Estimator:
    def __init__(self, settings: Settings, store: JobStore, *, workers: Callable[[], int | None]) -> None:
        """``workers``: the live workers the admission watermark last counted (None before its first step)."""
        self.settings = settings
        self._store = store
        self._workers = workers
        self._client = broker_client(settings, timeout_s=settings.scheduling_redis_timeout_s, retries=0)
        self._view: View | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._refresh_forever(), name="vidq-eta-refresh")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._client.close()

    def quote(self, job: Job) -> EstimateOut | None:
        view = self._view
        status = JobStatus(job.status)
        if view is None or view.workers <= 0 or status.is_terminal():
            return None
        spec = GenerationSpec.from_dict(job.spec)
        own = view.costs.cost_s(spec)
        if own is None:
            return None
        now = datetime.now(UTC)
        if status is JobStatus.RUNNING:
            left = own * max(0.0, 1.0 - job.progress_step / max(1, spec.steps))
            return EstimateOut(
                start_at=job.started_at or now,
                finish_at=now + timedelta(seconds=left),
                gpu_seconds=round(own, 3),
                work_ahead_s=0.0,
                workers=view.workers,
            )
        ahead = view.work_ahead_s(job.priority_class, job.tenant_id, job.created_at, now=now)
        start = now + timedelta(seconds=ahead / view.workers)
        return EstimateOut(
            start_at=start,
            finish_at=start + timedelta(seconds=own),
            gpu_seconds=round(own, 3),
            work_ahead_s=round(ahead, 3),
            workers=view.workers,
        )

    def admitted(self, job: Job) -> None:
        """A job this process just committed to a queue joins the view at once (the next refresh reads it from
        Postgres anyway): the quotes of the submits right after it count it ahead of them."""
        view = self._view
        if view is None or JobStatus(job.status) is not JobStatus.QUEUED:
            return
        cost = view.costs.cost_s(GenerationSpec.from_dict(job.spec))
        waiting = view.queues.setdefault(job.priority_class, {}).setdefault(job.tenant_id, [])
        waiting.append(Waiting(job.created_at, view.typical_s if cost is None else cost, since_refresh=True))
        waiting.sort(key=lambda w: w.created_at)

    async def refresh(self) -> None:
        """Read the fleet again: the measured costs (Redis), the queued and running work (Postgres)."""
        taken_at = datetime.now(UTC)
        model = await asyncio.to_thread(costs.load, self._client, self.settings)
        async with self._store.transaction() as conn:
            queued = await self._store.queued_work(conn)
            running = await self._store.running_work(conn)
        view = View(costs=model, workers=self._workers() or 0, taken_at=taken_at)
        known: list[float] = []
        pending: list[tuple[str, uuid.UUID, datetime, float | None]] = []
        for klass, tenant, name, created_at, spec in queued:
            cost = model.cost_s(GenerationSpec.from_dict(spec))
            if cost is not None:
                known.append(cost)
            pending.append((klass, tenant, created_at, cost))
            view.weights[tenant] = self.settings.fair_share_weights.get(name, 1.0)
        typical = statistics.median(known) if known else 0.0  # a job of an unmeasured model counts as a typical one
        view.typical_s = typical
        for klass, tenant, created_at, cost in pending:
            waiting = view.queues.setdefault(klass, {}).setdefault(tenant, [])
            waiting.append(Waiting(created_at, typical if cost is None else cost))
        for spec, step, _started in running:
            parsed = GenerationSpec.from_dict(spec)
            cost = model.cost_s(parsed)
            view.running_s += (typical if cost is None else cost) * max(0.0, 1.0 - step / max(1, parsed.steps))
        self._view = view

    async def _refresh_forever(self) -> None:
        warned = False
        while True:
            try:
                await self.refresh()
                warned = False
            except Exception as exc:  # a dependency down: the quotes go stale, nothing fails
                if not warned:
                    log.warning("ETA view not refreshed", extra={"error": repr(exc)[:200]})
                warned = True
            await asyncio.sleep(self.settings.eta_refresh_s)
