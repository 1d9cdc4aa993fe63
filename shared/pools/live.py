"""Which pools have a live worker. Each video worker announces its pool with every utilisation sample it publishes
(shared/scheduling/watermark.py ``publish_utilization``, one Redis call for both), stamped with Redis's clock: the
hash ``vidq:pools:live`` maps a worker id to ``"<pool> <unix time>"``. A pool whose workers were all silent for
``pool_worker_stale_s`` has none. A worker announces itself only once its models are built: a pool whose workers
are still loading is not live yet.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio as aioredis

from shared.infra.config import Settings


def live_key(prefix: str) -> str:
    return f"{prefix}vidq:pools:live"


# Live workers per pool, by Redis's clock; entries silent for ten times the stale age are deleted (a worker that
# stopped leaves no trace for long).
_LIVE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local stale = tonumber(ARGV[1])
local out = {}
local entries = redis.call('HGETALL', KEYS[1])
for i = 1, #entries, 2 do
  local pool, at = string.match(entries[i + 1], '^(%S+) (%S+)$')
  if pool == nil or now - tonumber(at) > 10 * stale then
    redis.call('HDEL', KEYS[1], entries[i])
  elseif now - tonumber(at) <= stale then
    out[#out + 1] = pool
  end
end
return out
"""


def _counts(raw: list[Any]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for pool in raw:
        name = pool.decode() if isinstance(pool, bytes) else str(pool)
        counts[name] = counts.get(name, 0) + 1
    return counts


def live_workers(client: redis.Redis, settings: Settings) -> dict[str, int]:
    """Live workers per pool (pools without one are absent). Raises redis errors."""
    raw: list[Any] = client.eval(_LIVE_LUA, 1, live_key(settings.broker_key_prefix), settings.pool_worker_stale_s)
    return _counts(raw)


def live_workers_or_none(client: redis.Redis, settings: Settings) -> dict[str, int] | None:
    """``live_workers``, or None when the broker's Redis does not answer (the caller then acts on nobody's
    liveness)."""
    try:
        return live_workers(client, settings)
    except (redis.RedisError, OSError):
        return None


async def live_workers_async(client: aioredis.Redis, settings: Settings) -> dict[str, int]:
    raw: list[Any] = await client.eval(_LIVE_LUA, 1, live_key(settings.broker_key_prefix), settings.pool_worker_stale_s)
    return _counts(raw)
