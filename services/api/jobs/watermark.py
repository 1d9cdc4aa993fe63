"""The API process's side of the admission watermark (shared/scheduling/watermark.py): the check each submit makes,
and the stepper this process runs in the background.

The check is one Redis call within ``scheduling_redis_timeout_s``. When it fails (the scheduling Redis is down or
slow), the submit is admitted without a check and so is every submit of the next ``scheduling_redis_backoff_s``:
during an outage admission stays open, at the cost of one short try per back-off period, never one per submit.

What the check finds is remembered for one scheduling cycle (the period in which the watermark may change), and so
is what the stepper sees of every class's backlog each half cycle: while each class is at its watermark,
``fleet_full`` says so and the API's door (services/api/admission.py) refuses new submits before reading them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Sequence

import redis
from prometheus_client import Counter, Gauge

from shared.errors import QueueFull
from shared.infra.config import Settings
from shared.infra.redis_clients import async_broker_client, broker_client
from shared.queues import STABLE_POOL, PriorityClass
from shared.scheduling.watermark import Decision, FleetFull, Snapshot, admit, backlogs, step

log = logging.getLogger("vidq.api.watermark")

# Every API process exports what the last step it saw set (the same fleet-wide values): the latest one is shown.
WATERMARK = Gauge(
    "vidq_api_watermark",
    "Jobs a class may hold waiting (admission watermark)",
    ["priority_class"],
    multiprocess_mode="livemostrecent",
)
FLEET_UTILIZATION = Gauge(
    "vidq_api_fleet_utilization_ratio",
    "Mean smoothed GPU utilisation of live workers",
    multiprocess_mode="livemostrecent",
)
SERVICE_RATE = Gauge(
    "vidq_api_service_rate_jobs_per_second",
    "Jobs finished per second, fleet-wide, smoothed",
    multiprocess_mode="livemostrecent",
)
REFUSED = Counter("vidq_api_watermark_refusals_total", "Submits refused by the watermark", ["priority_class"])
FAILED_OPEN = Counter("vidq_api_watermark_unavailable_total", "Watermark checks that failed; admission stayed open")


class Watermark:
    def __init__(
        self,
        settings: Settings,
        *,
        clock: Callable[[], float] = time.monotonic,
        pools: Callable[[], Sequence[str]] = lambda: (STABLE_POOL,),
    ) -> None:
        """``pools``: the worker pools whose queues a class's backlog counts (services/api/pools.py knows them)."""
        self.settings = settings
        self._clock = clock
        self._pools = pools
        timeout = settings.scheduling_redis_timeout_s
        self._client = async_broker_client(settings, retries=0, timeout_s=timeout)
        self._stepper_client = broker_client(settings, timeout_s=timeout, retries=0)
        self._open_until = 0.0  # monotonic: no check before this (the last one failed)
        self._task: asyncio.Task[None] | None = None
        self.last: Snapshot | None = None  # what the last step (this process's or another's) set
        # Each class's last refusal, while it is recent: (monotonic time it ages out, its decision).
        self._refusals: dict[PriorityClass, tuple[float, Decision]] = {}
        self._fleet_full: FleetFull | None = None  # built from _refusals when every class has one
        self._fleet_full_until = 0.0  # when the oldest of them ages out

    async def check(self, klass: PriorityClass, job_id: uuid.UUID) -> None:
        """Admit the new job ``job_id`` of ``klass`` or raise ``QueueFull`` (429 + Retry-After)."""
        settings = self.settings
        if not settings.watermark_enabled or self._clock() < self._open_until:
            return
        try:
            decision = await asyncio.wait_for(
                admit(self._client, settings, klass, job_id=job_id, pools=self._pools()),
                settings.scheduling_redis_timeout_s,
            )
        except (redis.RedisError, OSError, TimeoutError) as exc:
            self._open_until = self._clock() + settings.scheduling_redis_backoff_s
            FAILED_OPEN.inc()
            log.warning(
                "watermark unavailable; admitting without it",
                extra={"error": repr(exc)[:200], "for_s": settings.scheduling_redis_backoff_s},
            )
            return
        self._remember(klass, decision)
        if not decision.admitted:
            REFUSED.labels(klass.value).inc()
            raise QueueFull(
                f"the {klass.value} class holds {decision.backlog} waiting jobs, its limit now "
                f"({decision.watermark}); submit again later",
                retry_after_s=decision.retry_after_s(settings),
                details={"priority_class": klass.value, "backlog": decision.backlog, "watermark": decision.watermark},
            )

    def fleet_full(self) -> FleetFull | None:
        """Every class's last decision, within the last scheduling cycle, a refusal: what they found; else None."""
        full = self._fleet_full
        if full is None:
            return None
        if self._fleet_full_until <= self._clock():
            self._fleet_full = None  # a class's refusal aged out: the next submit of it decides again
            return None
        return full

    def _remember(self, klass: PriorityClass, decision: Decision) -> None:
        if decision.admitted:
            self._refusals.pop(klass, None)
            self._fleet_full = None
            return
        until = self._clock() + max(0.1, self.settings.scheduling_cycle_s)
        self._refusals[klass] = (until, decision)
        if len(self._refusals) == len(PriorityClass):
            decisions = [(k, self._refusals[k][1]) for k in PriorityClass]
            self._fleet_full = FleetFull(
                classes=tuple((k, d.backlog, d.watermark) for k, d in decisions),
                retry_after_s=min(d.retry_after_s(self.settings) for _, d in decisions),
            )
            self._fleet_full_until = min(until for until, _ in self._refusals.values())

    def start(self) -> None:
        """Step in the background (also with the check off: the live workers and the service rate it measures are
        the ETA quotes' too)."""
        self._task = asyncio.get_running_loop().create_task(self._step_forever(), name="vidq-watermark-stepper")

    def live_workers(self) -> int | None:
        return None if self.last is None else self.last.workers

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._client.aclose()
        self._stepper_client.close()

    async def refresh(self) -> None:
        """One turn of the stepper: step (Redis steps once a cycle, whoever asks) and, with the check on, see each
        class's backlog against its new W. Raises redis errors."""
        snapshot, seen = await asyncio.to_thread(self._observe)
        self.last = snapshot
        _export(snapshot)
        for klass, backlog in seen.items():
            level = snapshot.watermarks[klass]
            self._remember(
                klass, Decision(admitted=backlog < level, backlog=backlog, watermark=level, rate=snapshot.rate)
            )

    def _observe(self) -> tuple[Snapshot, dict[PriorityClass, int]]:
        snapshot = step(self._stepper_client, self.settings)
        seen = backlogs(self._stepper_client, self.settings, self._pools()) if self.settings.watermark_enabled else {}
        return snapshot, seen

    async def _step_forever(self) -> None:
        period = max(0.1, self.settings.scheduling_cycle_s / 2)  # twice a cycle: what the door knows stays fresh
        warned = False
        while True:
            await asyncio.sleep(period)
            try:
                await self.refresh()
            except (redis.RedisError, OSError) as exc:
                if not warned:  # once per outage
                    log.warning("watermark stepper: Redis unavailable", extra={"error": repr(exc)[:200]})
                warned = True
                continue
            warned = False


def _export(snapshot: Snapshot) -> None:
    for klass, level in snapshot.watermarks.items():
        WATERMARK.labels(klass.value).set(level)
    FLEET_UTILIZATION.set(snapshot.utilization)
    SERVICE_RATE.set(snapshot.rate)
