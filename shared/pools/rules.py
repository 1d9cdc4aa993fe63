"""Which pool a new job goes to: one pure decision over a snapshot of the rules, so every API process decides the
same way and a submit costs no query (services/api/pools.py keeps the snapshot fresh).

In order:

1. the request's ``X-Vidq-Pool`` header, for a tenant allowed to choose (any other tenant's header is refused: 403,
   nothing written);
2. the tenant's assignment;
3. the split: a job whose id falls in a pool's share goes there. The share is decided by a hash of the job id into
   10,000 buckets, the pools' shares laid end to end in name order, so a job's pool depends only on its id and the
   split, and raising a pool's share only adds jobs to it;
4. otherwise ``stable``.

A pool chosen by 1–3 that is out of routing (rolled back, tripped by its breaker) or has no live worker gets
nothing: the job goes to ``stable`` and the route says why (``fallback_from``, ``fallback_reason``).
"""

from __future__ import annotations

import enum
import hashlib
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from shared.errors import InvalidRequest, PoolNotAllowed
from shared.queues import POOL_NAME, STABLE_POOL

BUCKETS = 10_000
HEADER = "X-Vidq-Pool"


class PoolState(enum.StrEnum):
    ROUTABLE = "routable"
    ROLLED_BACK = "rolled_back"  # by an operator: no new job, its queued jobs moved to stable
    TRIPPED = "tripped"  # by its failure-rate breaker (shared/pools/breaker.py)


class RoutedBy(enum.StrEnum):
    DEFAULT = "default"  # no rule sent the job elsewhere: stable
    HEADER = "header"
    TENANT = "tenant"
    SPLIT = "split"
    FALLBACK = "fallback"  # a rule chose a pool that could not take it: stable
    REROUTED = "rerouted"  # moved to stable while queued (roll back, breaker, no live worker)


class FallbackReason(enum.StrEnum):
    NO_LIVE_WORKER = "no_live_worker"
    ROLLED_BACK = "rolled_back"
    TRIPPED = "tripped"


@dataclass(frozen=True, slots=True)
class PoolRule:
    name: str
    split_percent: float = 0.0
    state: PoolState = PoolState.ROUTABLE
    state_reason: str = ""


@dataclass(frozen=True, slots=True)
class TenantRule:
    pool: str | None = None  # assigned pool; None: the split decides
    may_choose: bool = False  # may pick a pool with the header


@dataclass(frozen=True, slots=True)
class Route:
    pool: str
    routed_by: RoutedBy
    fallback_from: str | None = None  # the pool a rule chose, when the job went to stable instead
    fallback_reason: FallbackReason | None = None


DEFAULT_ROUTE = Route(STABLE_POOL, RoutedBy.DEFAULT)


@dataclass(frozen=True)
class Rules:
    """A snapshot of the routing rules (``store.load_rules``)."""

    pools: Mapping[str, PoolRule] = field(default_factory=dict)
    tenants: Mapping[uuid.UUID, TenantRule] = field(default_factory=dict)
    _bounds: tuple[tuple[int, str], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # The split as bucket bounds: (upper bound, pool), pools in name order, each share rounded to a bucket.
        bounds: list[tuple[int, str]] = []
        upper = 0
        for name in sorted(self.pools):
            rule = self.pools[name]
            if name != STABLE_POOL and rule.split_percent > 0:
                upper = min(BUCKETS, upper + round(rule.split_percent * BUCKETS / 100))
                bounds.append((upper, name))
        object.__setattr__(self, "_bounds", tuple(bounds))

    def split_pool(self, job_id: uuid.UUID) -> str | None:
        """The pool whose share of the split ``job_id`` falls in; None: stable's share."""
        b = bucket(job_id)
        for upper, name in self._bounds:
            if b < upper:
                return name
        return None

    def route(self, tenant_id: uuid.UUID, job_id: uuid.UUID, *, requested: str | None, live: frozenset[str]) -> Route:
        """The pool of a new job ``job_id`` of ``tenant_id``; ``requested``: the header's value (None: none);
        ``live``: the pools with a live worker now. Raises ``PoolNotAllowed`` for a tenant that may not choose and
        ``InvalidRequest`` for a name that is no pool."""
        tenant = self.tenants.get(tenant_id)
        if requested is not None:
            if tenant is None or not tenant.may_choose:
                raise PoolNotAllowed(
                    f"this tenant may not choose a worker pool ({HEADER}); ask an operator to allow it",
                    details={"header": HEADER},
                )
            chosen = self.pool_named(requested)
            return self._deliverable(chosen, RoutedBy.HEADER, live)
        if tenant is not None and tenant.pool is not None:
            return self._deliverable(tenant.pool, RoutedBy.TENANT, live)
        split = self.split_pool(job_id)
        if split is not None:
            return self._deliverable(split, RoutedBy.SPLIT, live)
        return DEFAULT_ROUTE

    def pool_named(self, name: str) -> str:
        """``name`` if it is a pool (stable, or one with rules); else ``InvalidRequest``."""
        if name == STABLE_POOL or name in self.pools:
            return name
        if not POOL_NAME.match(name):
            raise InvalidRequest(f"{HEADER} must name a worker pool (a-z, 0-9, '-', at most 32)", fields=[HEADER])
        raise InvalidRequest(
            f"there is no worker pool named {name!r}", details={"pools": sorted({STABLE_POOL, *self.pools})}
        )

    def _deliverable(self, pool: str, by: RoutedBy, live: frozenset[str]) -> Route:
        if pool == STABLE_POOL:
            return Route(STABLE_POOL, by)
        rule = self.pools.get(pool, PoolRule(pool))
        if rule.state is PoolState.ROLLED_BACK:
            return Route(STABLE_POOL, RoutedBy.FALLBACK, pool, FallbackReason.ROLLED_BACK)
        if rule.state is PoolState.TRIPPED:
            return Route(STABLE_POOL, RoutedBy.FALLBACK, pool, FallbackReason.TRIPPED)
        if pool not in live:
            return Route(STABLE_POOL, RoutedBy.FALLBACK, pool, FallbackReason.NO_LIVE_WORKER)
        return Route(pool, by)


def bucket(job_id: uuid.UUID) -> int:
    """``job_id``'s place in [0, BUCKETS): the same for the same id in every process and release."""
    return int.from_bytes(hashlib.blake2b(job_id.bytes, digest_size=8).digest(), "big") % BUCKETS
