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
import bisect
import contextlib
import functools
import logging
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from itertools import accumulate, pairwise
from typing import Any

from services.api.store import JobStore
from shared.infra.config import Settings
from shared.infra.redis_clients import broker_client
from shared.jobs.schemas import EstimateOut
from shared.jobs.status import JobStatus
from shared.models import Job
from shared.queues import PriorityClass
from shared.scheduling import costs

log = logging.getLogger("vidq.api.estimates")

_ORDER = list(PriorityClass)  # strict priority: high, medium, low


class Backlog:
    """One tenant's queued jobs of one class, oldest first, with the running sum of their costs: the cost of the
    first ``n`` is one lookup, and the jobs older than a time one bisection."""

    __slots__ = ("created", "prefix")

    def __init__(self) -> None:
        self.created: list[datetime] = []
        self.prefix: list[float] = [0.0]  # prefix[n]: the cost of the first n

    def add(self, created_at: datetime, cost_s: float) -> None:
        """Append a job (jobs come oldest first; one out of order is placed by its time)."""
        if self.created and created_at < self.created[-1]:
            at = bisect.bisect_right(self.created, created_at)
            costs_ = [b - a for a, b in pairwise(self.prefix)]
            self.created.insert(at, created_at)
            costs_.insert(at, cost_s)
            self.prefix = [0.0, *accumulate(costs_)]
            return
        self.created.append(created_at)
        self.prefix.append(self.prefix[-1] + cost_s)

    def __len__(self) -> int:
        return len(self.created)

    def older_than(self, created_at: datetime) -> int:
        return bisect.bisect_left(self.created, created_at)

    def cost_of_first(self, n: int) -> float:
        return self.prefix[max(0, min(n, len(self.created)))]

    @property
    def total_s(self) -> float:
        return self.prefix[-1]


@dataclass
class View:
    """The fleet as one refresh saw it, plus what this process admitted since."""

    costs: costs.CostModel
    workers: int
    taken_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    running_s: float = 0.0  # GPU seconds left of the running jobs
    typical_s: float = 0.0  # what a queued job of an unmeasured model counts as: the median queued job
    # class → tenant → its queued jobs: as read (``seen``) and admitted here since (``added``)
    seen: dict[str, dict[uuid.UUID, Backlog]] = field(default_factory=dict)
    added: dict[str, dict[uuid.UUID, Backlog]] = field(default_factory=dict)
    weights: dict[uuid.UUID, float] = field(default_factory=dict)
    # Per class, the queued jobs past the refresh's limit (eta_max_jobs, the newest), costed as typical jobs.
    unread_s: dict[str, float] = field(default_factory=dict)

    def add(self, klass: str, tenant: uuid.UUID, created_at: datetime, cost_s: float, *, seen: bool) -> None:
        queues = self.seen if seen else self.added
        queues.setdefault(klass, {}).setdefault(tenant, Backlog()).add(created_at, cost_s)

    def work_ahead_s(
        self, klass: str, tenant: uuid.UUID, created_at: datetime, *, now: datetime | None = None
    ) -> float:
        """GPU seconds of work that starts before a job of ``tenant`` in ``klass`` created at ``created_at``; cost
        O(tenants in the class), whatever the queues hold.

        The workers did not stand still since the view was read: the work it saw then shrinks by what the live
        workers have done since (``now`` − ``taken_at``, each worker a second of work a second); what this process
        admitted since counts whole."""
        seen, added = self.running_s + self.unread_s.get(klass, 0.0), 0.0
        for higher in _ORDER[: _ORDER.index(PriorityClass(klass))]:
            seen += self.unread_s.get(higher.value, 0.0)
            seen += sum(b.total_s for b in self.seen.get(higher.value, {}).values())
            added += sum(b.total_s for b in self.added.get(higher.value, {}).values())
        seen_here, added_here = self.seen.get(klass, {}), self.added.get(klass, {})
        empty = Backlog()
        mine_seen = seen_here.get(tenant, empty).older_than(created_at)
        mine_added = added_here.get(tenant, empty).older_than(created_at)
        seen += seen_here.get(tenant, empty).cost_of_first(mine_seen)
        added += added_here.get(tenant, empty).cost_of_first(mine_added)
        turns = mine_seen + mine_added + 1  # this job is its tenant's turn number turns
        own_weight = self.weights.get(tenant, 1.0)
        for other in (seen_here.keys() | added_here.keys()) - {tenant}:
            before = round(turns * self.weights.get(other, 1.0) / own_weight)
            older, newer = seen_here.get(other, empty), added_here.get(other, empty)  # read ones are the older
            seen += older.cost_of_first(before)
            added += newer.cost_of_first(before - len(older))
        elapsed = 0.0 if now is None else max(0.0, (now - self.taken_at).total_seconds())
        return max(0.0, seen - elapsed * self.workers) + added


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
        own = view.costs.cost_of_stored(job.spec)
        if own is None:
            return None
        now = datetime.now(UTC)
        if status is JobStatus.RUNNING:
            left = own * max(0.0, 1.0 - job.progress_step / max(1, int(job.spec["steps"])))
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
        cost = view.costs.cost_of_stored(job.spec)
        view.add(
            job.priority_class, job.tenant_id, job.created_at, view.typical_s if cost is None else cost, seen=False
        )

    async def refresh(self) -> None:
        """Read the fleet again: the measured costs (Redis), the queued and running work (Postgres; each job's
        shape read out of its spec by Postgres, a cost looked up once per shape)."""
        taken_at = datetime.now(UTC)
        model = await asyncio.to_thread(costs.load, self._client, self.settings)
        async with self._store.transaction() as conn:
            queued = await self._store.queued_work(conn, limit=self.settings.eta_max_jobs)
            counts = await self._store.queued_counts(conn) if len(queued) >= self.settings.eta_max_jobs else {}
            running = await self._store.running_work(conn)
        # Thousands of rows are seconds of Python: built in a thread, so requests go on being served meanwhile.
        self._view = await asyncio.to_thread(
            self._build, model, queued, counts, running, workers=self._workers() or 0, taken_at=taken_at
        )

    def _build(
        self,
        model: costs.CostModel,
        queued: list[Any],
        counts: dict[str, int],
        running: list[Any],
        *,
        workers: int,
        taken_at: datetime,
    ) -> View:
        view = View(costs=model, workers=workers, taken_at=taken_at)
        cost_of = functools.lru_cache(maxsize=None)(model.cost_of)
        known = [c for c in (cost_of(*row[4:]) for row in queued) if c is not None]
        view.typical_s = statistics.median(known) if known else 0.0  # an unmeasured model counts as a typical job
        for klass, tenant, name, created_at, *shape in queued:
            cost = cost_of(*shape)
            view.add(klass, tenant, created_at, view.typical_s if cost is None else cost, seen=True)
            view.weights[tenant] = self.settings.fair_share_weights.get(name, 1.0)
        read = Counter(row[0] for row in queued)
        for klass, n in counts.items():  # past the rows read (the newest): each a typical job, all ahead
            view.unread_s[klass] = max(0, n - read[klass]) * view.typical_s
        for step, *shape in running:
            cost = cost_of(*shape)
            view.running_s += (view.typical_s if cost is None else cost) * max(0.0, 1.0 - step / max(1, shape[-1]))
        return view

    async def _refresh_forever(self) -> None:
        warned = False
        while True:
            started = time.monotonic()
            try:
                await self.refresh()
                warned = False
            except Exception as exc:  # a dependency down: the quotes go stale, nothing fails
                if not warned:
                    log.warning("ETA view not refreshed", extra={"error": repr(exc)[:200]})
                warned = True
            # A long queue makes a refresh dear: then it runs less often (at most a tenth of this process's time).
            await asyncio.sleep(max(self.settings.eta_refresh_s, 9 * (time.monotonic() - started)))
