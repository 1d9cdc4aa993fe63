"""Operator endpoints (``/v1/admin/…``), for whoever runs vidq rather than for tenants.

They take ``Authorization: Bearer <VIDQ_ADMIN_TOKEN>``, not a tenant's API key. While no token is configured
(the default) they do not exist: every request gets the API's ordinary 404, the same as for an unknown path. A
missing or wrong token is a 401. They pass the load shedding at the door (services/api/admission.py) uncounted: the
cache statistics here touch no Postgres; the worker pools' (services/api/admin/pools.py) use a few small statements.
"""

from __future__ import annotations

import hmac
from functools import partial
from typing import Annotated, Any

import anyio.to_thread
import redis
from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field

from services.api.error_handlers import ErrorBody
from shared.errors import Unauthorized
from shared.infra.config import Settings
from shared.textcache.stats import stats_for

admin_bearer = HTTPBearer(
    auto_error=False, scheme_name="AdminToken", description="the operator token, VIDQ_ADMIN_TOKEN (not an API key)"
)


async def require_admin(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(admin_bearer)]
) -> None:
    """404 while VIDQ_ADMIN_TOKEN is empty (as if these routes were absent), 401 unless the bearer token is it."""
    settings: Settings = request.app.state.settings
    token = settings.admin_token.strip()  # a token of blanks is no token
    if not token:
        raise HTTPException(status_code=404)  # the body of any unknown path
    given = credentials.credentials.strip() if credentials is not None else ""
    # Constant time in the token's content: the comparison leaks nothing about how much of it a guess got right.
    if not hmac.compare_digest(given.encode(), token.encode()):
        raise Unauthorized("send the operator token as 'Authorization: Bearer <VIDQ_ADMIN_TOKEN>'")


ADMIN_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": text}
    for status, text in [
        (401, "missing or wrong operator token"),
        (404, "the operator endpoints are off (VIDQ_ADMIN_TOKEN is empty)"),
        (422, "invalid request"),
        (503, "the broker's Redis, which holds the hit counts, is unavailable; retry after Retry-After seconds"),
    ]
}

router = APIRouter(prefix="/v1/admin", tags=["admin"], dependencies=[Depends(require_admin)], responses=ADMIN_RESPONSES)


class TierStats(BaseModel):
    # No bounds on purpose: these are whatever the processes counted, and a response must never fail on them.
    hits: int
    misses: int
    hit_rate: float | None = Field(description="hits / (hits + misses), rounded to 4 decimals; null without lookups")


class TierSet(BaseModel):
    """Per tier: a lookup that misses L1 goes on to L2, then L3. ``overall``: lookups any tier answered (hits of
    every tier) against all lookups (those of L1, where every lookup starts); its misses were encoded."""

    l1: TierStats
    l2: TierStats
    l3: TierStats
    overall: TierStats


class WindowStats(TierSet):
    start: float = Field(description="unix seconds; the window covers [start, start + window_s)")


class CacheStats(BaseModel):
    window_s: float = Field(description="length of a window, seconds (VIDQ_CACHE_WINDOW_S)")
    mode: str = Field(
        description="the prewarmer's mode: normal, compensating (cold-start compensation), or unknown when no "
        "prewarmer has published one recently"
    )
    totals: TierSet = Field(description="the sums over the windows below")
    windows: list[WindowStats] = Field(description="the last complete windows, oldest first (the current one is not)")


@router.get("/cache/stats", response_model=CacheStats)
async def cache_stats(
    request: Request,
    windows: Annotated[int, Query(ge=1, le=360, description="how many complete windows, newest last")] = 6,
) -> CacheStats:
    """Cluster-wide hit counts and rates of the text-embedding cache per tier, in the last complete windows (as
    counted by every worker, in the broker's Redis), and the prewarmer's mode. What ``vidq cache stats`` shows."""
    settings: Settings = request.app.state.settings
    try:
        # Synchronous Redis: in a worker thread, never on the event loop.
        data = await anyio.to_thread.run_sync(partial(stats_for, settings, windows=windows))
    except (redis.ConnectionError, redis.TimeoutError):
        raise  # the API's 503 `unavailable` (services/api/error_handlers.py)
    except redis.RedisError as exc:
        # Anything else Redis answers instead of the counts (out of memory, READONLY, NOPERM …) is the same for the
        # caller: the broker cannot serve this now. Raised as what the error handlers map to 503.
        raise redis.ConnectionError(f"{type(exc).__name__}: {exc}") from exc
    return CacheStats.model_validate(data)
