"""Operator endpoints of worker pools (``/v1/admin/pools``, ``/v1/admin/tenants/{tenant}/pool``): the routing rules,
changed in one transaction each through shared/pools/store.py (what ``vidq pools`` does too), and the pools' figures
side by side. Every API process routes by a change within ``VIDQ_POOL_RULES_REFRESH_S``.

Unlike the other operator endpoints these read and write Postgres (a few small statements, on the synchronous
session in a worker thread, with the database's statement timeout); like them they pass the door uncounted."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Annotated, Any, TypeVar

import anyio.to_thread
from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, Field
from sqlalchemy.orm import Session

from services.api.admin.routes import ADMIN_RESPONSES, require_admin
from shared.infra.redis_clients import broker_client
from shared.messaging.celery_app import VidqCelery
from shared.pools import store
from shared.pools.live import live_workers_or_none

router = APIRouter(
    prefix="/v1/admin", tags=["admin: pools"], dependencies=[Depends(require_admin)], responses=ADMIN_RESPONSES
)
T = TypeVar("T")


class PoolOut(BaseModel):
    name: str
    split_percent: float = Field(description="share of the jobs no header or tenant rule routes (stable: the rest)")
    state: str = Field(description="routable, rolled_back (by an operator) or tripped (by its failure-rate breaker)")
    state_reason: str
    state_changed_at: str | None
    live_workers: int | None = Field(description="workers heard from lately; null when the broker did not answer")
    queued: int
    running: int
    tenants_assigned: list[str]
    tenants_choosing: list[str] = Field(description="(stable's entry) tenants allowed to choose with X-Vidq-Pool")


class PoolsOut(BaseModel):
    pools: list[PoolOut]
    moved_to_stable: int | None = Field(default=None, description="queued jobs a roll back moved to stable")


class SplitIn(BaseModel):
    split_percent: float = Field(ge=0, le=100)


class TenantPoolIn(BaseModel):
    pool: str | None = Field(default=None, description="the pool to assign the tenant to; null or '': none")
    may_choose: bool | None = Field(default=None, description="whether the tenant may choose with X-Vidq-Pool")


async def _in_session(request: Request, work: Callable[[Session], T]) -> T:
    """``work`` in one committed transaction, in a worker thread."""
    sessions = request.app.state.sessions

    def run() -> T:
        with sessions() as session, session.begin():
            return work(session)

    return await anyio.to_thread.run_sync(run)


def _live(celery: VidqCelery) -> dict[str, int] | None:
    settings = celery.settings
    client = celery.resource(
        "admin-pools-redis", lambda: broker_client(settings, retries=0, timeout_s=settings.scheduling_redis_timeout_s)
    )
    return live_workers_or_none(client, settings)


async def _pools(request: Request, *, moved: int | None = None) -> PoolsOut:
    live = await anyio.to_thread.run_sync(partial(_live, request.app.state.celery))
    views = await _in_session(request, lambda s: store.overview(s, live=live))
    return PoolsOut(pools=[PoolOut(**v.to_dict()) for v in views], moved_to_stable=moved)


@router.get("/pools", response_model=PoolsOut)
async def list_pools(request: Request) -> PoolsOut:
    """Every pool: its split, state (and why), live workers, queued and running jobs, and the tenants' rules. What
    ``vidq pools show`` prints."""
    return await _pools(request)


@router.put("/pools/{name}", response_model=PoolsOut)
async def set_split(request: Request, name: str, body: SplitIn) -> PoolsOut:
    """Set the pool's share of the split (creating the pool's rule if new) and put it back in routing."""
    await _in_session(request, lambda s: store.set_split(s, name, body.split_percent))
    return await _pools(request)


@router.post("/pools/{name}/promote", response_model=PoolsOut)
async def promote(request: Request, name: str) -> PoolsOut:
    """The pool takes every job no header or tenant rule routes elsewhere (100% of the split)."""
    await _in_session(request, lambda s: store.promote(s, name))
    return await _pools(request)


@router.post("/pools/{name}/rollback", response_model=PoolsOut)
async def rollback(request: Request, name: str) -> PoolsOut:
    """Take the pool out of routing and move its queued jobs to stable (none lost, none rendered twice)."""
    celery = request.app.state.celery
    moved = await _in_session(request, lambda s: store.rollback(s, celery, name))
    return await _pools(request, moved=len(moved))


@router.put("/tenants/{tenant}/pool", response_model=PoolsOut)
async def set_tenant_pool(request: Request, tenant: str, body: TenantPoolIn) -> PoolsOut:
    """Assign a tenant (by name or id) to a pool, or clear its assignment (``pool``: null or ''), and/or allow it to
    choose a pool with the ``X-Vidq-Pool`` header."""
    pool = (body.pool or "") if "pool" in body.model_fields_set else None
    await _in_session(request, lambda s: store.set_tenant(s, tenant, pool=pool, may_choose=body.may_choose))
    return await _pools(request)


@router.get("/pools/routing")
async def routing(request: Request) -> dict[str, Any]:
    """What this API process routes by right now: its copy of the rules and the pools it sees live, and when it read
    each (every process re-reads them each VIDQ_POOL_RULES_REFRESH_S)."""
    snapshot: dict[str, Any] = request.app.state.pools.snapshot()
    return snapshot


@router.get("/pools/compare")
async def compare(
    request: Request,
    window_s: Annotated[float, Query(gt=0, le=30 * 86400, description="the last this many seconds")] = 3600,
) -> dict[str, Any]:
    """Each pool's figures over the window: jobs finished, success rate, queue wait p50/p90, errors by code, denoising
    seconds per step per model and shape. What ``vidq pools compare`` prints."""
    return await _in_session(request, lambda s: store.compare(s, window_s=window_s))
