"""The API process's side of worker pools (shared/pools): the routing rules and the pools' live workers, kept in
memory and refreshed in the background, so that routing a submit costs no query and no Redis call.

Every ``pool_rules_refresh_s`` the process re-reads the rules from Postgres (two small reads on its own async pool)
and the live workers from the broker's Redis: a change made through ``vidq pools`` or ``/v1/admin/pools`` reaches
every API process within that period. A refresh that fails keeps the last rules (Postgres down: jobs cannot be
written either); until a first read of the live workers, no pool but stable counts as live, so no job waits in a
pool nobody has seen.

A job whose rule chose a pool that cannot take it goes to stable: counted in ``vidq_api_pool_fallbacks_total`` by
pool and reason, and logged once each time a pool starts (and stops) falling back in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any

import redis
from prometheus_client import Counter, Gauge

from services.api.store import JobStore
from shared.infra.config import Settings
from shared.infra.redis_clients import async_broker_client
from shared.pools.live import live_workers_async
from shared.pools.rules import FallbackReason, PoolState, Route, Rules
from shared.pools.store import POOLS_SQL, TENANTS_SQL, rules_from_rows
from shared.queues import STABLE_POOL

log = logging.getLogger("vidq.api.pools")

ROUTED = Counter("vidq_api_pool_routed_total", "Jobs routed to a worker pool, by what decided it", ["pool", "by"])
FALLBACKS = Counter(
    "vidq_api_pool_fallbacks_total",
    "Jobs a rule sent to a pool that could not take them (they went to stable), by pool and reason",
    ["pool", "reason"],
)
STATE = Gauge(
    "vidq_api_pool_state",
    "A pool's routing state: 0 routable, 1 rolled back, 2 tripped by its failure-rate breaker",
    ["pool"],
    multiprocess_mode="livemostrecent",
)
LIVE = Gauge("vidq_api_pool_live_workers", "Live workers per pool", ["pool"], multiprocess_mode="livemostrecent")
_STATE_VALUE = {PoolState.ROUTABLE: 0, PoolState.ROLLED_BACK: 1, PoolState.TRIPPED: 2}


class PoolRouter:
    def __init__(self, settings: Settings, store: JobStore) -> None:
        self.settings = settings
        self._store = store
        self._redis = async_broker_client(settings, retries=0, timeout_s=settings.scheduling_redis_timeout_s)
        self.rules = Rules()
        self.live: frozenset[str] = frozenset({STABLE_POOL})
        self._falling_back: set[tuple[str, FallbackReason]] = set()
        self._task: asyncio.Task[None] | None = None
        self.rules_read_at: float | None = None  # unix time of the last read of each part (None: never)
        self.live_read_at: float | None = None

    def route(self, tenant_id: uuid.UUID, job_id: uuid.UUID, *, requested: str | None) -> Route:
        """The pool of a new job (shared/pools/rules.py). Raises PoolNotAllowed / InvalidRequest for a header the
        tenant may not send or that names no pool."""
        return self.rules.route(tenant_id, job_id, requested=requested, live=self.live)

    def routed(self, route: Route) -> None:
        """Count a job created with ``route`` (and log a pool that starts falling back)."""
        ROUTED.labels(route.pool, route.routed_by.value).inc()
        if route.fallback_from is not None and route.fallback_reason is not None:
            FALLBACKS.labels(route.fallback_from, route.fallback_reason.value).inc()
            key = (route.fallback_from, route.fallback_reason)
            if key not in self._falling_back:
                self._falling_back.add(key)
                log.warning(
                    "pool cannot take jobs; its share goes to stable",
                    extra={"pool": route.fallback_from, "reason": route.fallback_reason.value},
                )

    def snapshot(self) -> dict[str, Any]:
        """What this process routes by now (``GET /v1/admin/pools/routing``)."""
        return {
            "rules_read_at": self.rules_read_at,
            "live_read_at": self.live_read_at,
            "live_pools": sorted(self.live),
            "pools": {
                name: {"split_percent": rule.split_percent, "state": rule.state.value}
                for name, rule in sorted(self.rules.pools.items())
            },
            "tenants": {
                str(tenant): {"pool": rule.pool, "may_choose": rule.may_choose}
                for tenant, rule in self.rules.tenants.items()
            },
        }

    def known_pools(self) -> list[str]:
        """Stable and every pool with a rule: the queues a class's backlog counts."""
        return [STABLE_POOL, *(name for name in self.rules.pools if name != STABLE_POOL)]

    async def refresh(self) -> None:
        """Re-read the rules and the live workers; each part that fails keeps its last value."""
        try:
            # Both tables from one snapshot: a change committed between the two reads (a roll back and its tenants'
            # rules) is seen whole or not at all.
            async with self._store.transaction() as conn:
                await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                pools = await (await conn.execute(POOLS_SQL)).fetchall()
                tenants = await (await conn.execute(TENANTS_SQL)).fetchall()
            self.rules = rules_from_rows(pools, tenants)
            self.rules_read_at = time.time()
        except Exception as exc:  # Postgres down or slow: the last rules stand
            log.debug("pool rules not refreshed", extra={"error": repr(exc)[:200]})
        try:
            live = await asyncio.wait_for(
                live_workers_async(self._redis, self.settings), self.settings.scheduling_redis_timeout_s
            )
            self.live = frozenset({STABLE_POOL, *live})
            self.live_read_at = time.time()
            for pool in {*self.rules.pools, *live}:
                LIVE.labels(pool).set(live.get(pool, 0))
        except (redis.RedisError, OSError, TimeoutError) as exc:
            log.debug("live pools not refreshed", extra={"error": repr(exc)[:200]})
        for name, rule in self.rules.pools.items():
            STATE.labels(name).set(_STATE_VALUE[rule.state])
        self._note_recoveries()

    def _note_recoveries(self) -> None:
        for pool, reason in list(self._falling_back):
            rule = self.rules.pools.get(pool)
            still = {
                FallbackReason.NO_LIVE_WORKER: pool not in self.live,
                FallbackReason.ROLLED_BACK: rule is not None and rule.state is PoolState.ROLLED_BACK,
                FallbackReason.TRIPPED: rule is not None and rule.state is PoolState.TRIPPED,
            }[reason]
            if not still:
                self._falling_back.discard((pool, reason))
                log.info("pool can take jobs again", extra={"pool": pool, "was": reason.value})

    async def start(self) -> None:
        """A first refresh (bounded), then one every pool_rules_refresh_s in the background."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.refresh(), max(1.0, self.settings.pool_rules_refresh_s))
        self._task = asyncio.get_running_loop().create_task(self._refresh_forever(), name="vidq-pool-rules")

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.pool_rules_refresh_s)
            await self.refresh()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._redis.aclose()
