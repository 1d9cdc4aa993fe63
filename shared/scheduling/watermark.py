"""The admission watermark: how many jobs a class may hold waiting, moved by how busy the GPUs are.

Three parties share it through the broker's Redis (under the broker key prefix), each with one short call:

- **Workers** sample their GPU's utilisation (NVML; on a CPU, whether a render is running) every
  ``scheduling_sample_s``, smooth it (EWMA, ``scheduling_util_alpha``) and publish it (``publish_utilization``), and
  count each job they finish (``count_done``). services/worker/utilization.py.
- **A stepper** (``step``; every API process calls it each cycle, and Redis runs it at most once per
  ``scheduling_cycle_s`` in all) averages the utilisation of the workers heard from lately and moves the watermark W
  of every class toward a target: ``watermark_idle`` below ``watermark_util_idle``, ``watermark_busy`` above
  ``watermark_util_busy``, else ``watermark_normal``; by at most ``watermark_max_change`` of W per cycle, within
  [``watermark_min``, ``watermark_max``]. It also measures the fleet's service rate (jobs finished per second,
  smoothed), from which a refused client is told when to come back.
- **The submit** (``admit``) counts the class's backlog — the messages waiting on its queue plus the admitted jobs
  whose message is not out yet (reservations; the publish of a message removes its job's in the same transaction,
  and one whose job never got sent lapses after ``scheduling_reserve_s``) — and, under W, reserves a place in the
  same atomic step. Concurrent submits from any number of API processes therefore never push a backlog past W.

A refused submit writes nothing: it is answered 429 with ``Retry-After`` before its job exists.
"""

from __future__ import annotations

import math
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis

from shared.infra.config import Settings
from shared.pools.live import live_key
from shared.queues import STABLE_POOL, PriorityClass, class_of_queue, video_queue

_scripts: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def _script(client: Any, source: str) -> Any:
    """``source`` registered with ``client`` once (its SHA computed once; called with EVALSHA, loaded when Redis lacks
    it), not on every submit or sample."""
    registered = _scripts.setdefault(client, {})
    if source not in registered:
        registered[source] = client.register_script(source)
    return registered[source]


@dataclass(frozen=True, slots=True)
class Keys:
    """The Redis keys of the watermark, under the broker key prefix."""

    prefix: str

    @property
    def utilization(self) -> str:  # hash: worker id → "utilisation time"
        return f"{self.prefix}vidq:sched:util"

    @property
    def state(self) -> str:  # hash: W per class, the last step, the service rate
        return f"{self.prefix}vidq:sched:state"

    @property
    def done(self) -> str:  # counter: jobs finished, fleet-wide
        return f"{self.prefix}vidq:sched:done"

    def reservations(self, klass: PriorityClass) -> str:  # sorted set: admissions by time
        return f"{self.prefix}vidq:sched:admitted:{klass.value}"

    def queue(self, klass: PriorityClass, pool: str = STABLE_POOL) -> str:  # the class's message list in a pool
        return f"{self.prefix}{video_queue(klass, pool)}"


def keys(settings: Settings) -> Keys:
    return Keys(settings.broker_key_prefix)


# --- workers ---------------------------------------------------------------------------------------------------------


def publish_utilization(
    client: redis.Redis, settings: Settings, *, worker: str, utilization: float, pool: str = STABLE_POOL
) -> None:
    """A worker's smoothed utilisation, stamped with Redis's clock (read by the stepper, which forgets a worker
    silent for ``scheduling_util_stale_s``), and in the same call its pool (shared/pools/live.py)."""
    _script(client, _PUBLISH_LUA)(
        keys=[keys(settings).utilization, live_key(settings.broker_key_prefix)],
        args=[worker, f"{utilization:.4f}", pool],
    )


def count_done(client: redis.Redis, settings: Settings) -> None:
    """One more job finished (the service rate the stepper measures)."""
    client.incr(keys(settings).done)


_PUBLISH_LUA = """
local t = redis.call('TIME')
local at = t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ' ' .. at)
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3] .. ' ' .. at)
"""


# --- the stepper -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What a step saw and set."""

    stepped: bool  # False: another caller stepped within this cycle (the values are theirs)
    utilization: float  # mean of the live workers' smoothed utilisation; 0 with none
    workers: int  # workers heard from within scheduling_util_stale_s
    watermarks: dict[PriorityClass, int]
    rate: float  # jobs finished per second, fleet-wide, smoothed; 0 until measured


def step(client: redis.Redis, settings: Settings) -> Snapshot:
    """One cycle of the stepper (a no-op when the last step is younger than ``scheduling_cycle_s``)."""
    k = keys(settings)
    raw: list[Any] = _script(client, _STEP_LUA)(
        keys=[k.utilization, k.state, k.done],
        args=[
            settings.scheduling_cycle_s,
            settings.scheduling_util_stale_s,
            settings.watermark_util_idle,
            settings.watermark_util_busy,
            settings.watermark_idle,
            settings.watermark_normal,
            settings.watermark_busy,
            settings.watermark_max_change,
            settings.watermark_min,
            settings.watermark_max,
            settings.scheduling_rate_alpha,
            *[c.value for c in PriorityClass],
        ],
    )
    stepped, utilization, workers, rate, *levels = raw
    return Snapshot(
        stepped=bool(int(stepped)),
        utilization=float(utilization),
        workers=int(workers),
        watermarks={c: int(float(w)) for c, w in zip(PriorityClass, levels, strict=True)},
        rate=float(rate),
    )


# The step, atomic: utilisation of live workers (stale ones removed), the target, each class's W moved toward it,
# the service rate from the done counter. Numbers travel as strings (Lua numbers are doubles).
_STEP_LUA = """
local cycle, stale = tonumber(ARGV[1]), tonumber(ARGV[2])
local util_idle, util_busy = tonumber(ARGV[3]), tonumber(ARGV[4])
local w_idle, w_normal, w_busy = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local max_change, w_min, w_max, alpha = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10]), tonumber(ARGV[11])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6

local function current()
  local out = {'0', redis.call('HGET', KEYS[2], 'util') or '0', redis.call('HGET', KEYS[2], 'workers') or '0',
               redis.call('HGET', KEYS[2], 'rate') or '0'}
  for i = 12, #ARGV do
    out[#out + 1] = redis.call('HGET', KEYS[2], 'w:' .. ARGV[i]) or tostring(w_normal)
  end
  return out
end

local last = tonumber(redis.call('HGET', KEYS[2], 'stepped_at') or '0')
if now - last < cycle then return current() end
redis.call('HSET', KEYS[2], 'stepped_at', tostring(now))

local sum, n = 0, 0
local entries = redis.call('HGETALL', KEYS[1])
for i = 1, #entries, 2 do
  local u, at = string.match(entries[i + 1], '^(%S+) (%S+)$')
  if u == nil or now - tonumber(at) > stale then
    redis.call('HDEL', KEYS[1], entries[i])
  else
    sum, n = sum + tonumber(u), n + 1
  end
end
local util = 0
if n > 0 then util = sum / n end
local target = w_normal
if util < util_idle then target = w_idle elseif util > util_busy then target = w_busy end
target = math.max(w_min, math.min(w_max, target))

local out = {'1', tostring(util), tostring(n)}
local levels = {}
for i = 12, #ARGV do
  local w = tonumber(redis.call('HGET', KEYS[2], 'w:' .. ARGV[i]) or tostring(w_normal))
  if w < target then w = math.min(target, w * (1 + max_change)) elseif w > target then
    w = math.max(target, w * (1 - max_change)) end
  w = math.max(w_min, math.min(w_max, w))
  redis.call('HSET', KEYS[2], 'w:' .. ARGV[i], tostring(w))
  levels[#levels + 1] = tostring(w)
end

local done = tonumber(redis.call('GET', KEYS[3]) or '0')
local last_done = redis.call('HGET', KEYS[2], 'done')
local rate = tonumber(redis.call('HGET', KEYS[2], 'rate') or '0')
if last_done and last > 0 and now > last then
  local seen = (done - tonumber(last_done)) / (now - last)
  if redis.call('HEXISTS', KEYS[2], 'rate') == 1 then rate = alpha * seen + (1 - alpha) * rate else rate = seen end
  redis.call('HSET', KEYS[2], 'rate', tostring(rate))
end
redis.call('HSET', KEYS[2], 'done', tostring(done), 'util', tostring(util), 'workers', tostring(n))
out[#out + 1] = tostring(rate)
for _, w in ipairs(levels) do out[#out + 1] = w end
return out
"""


def backlogs(
    client: redis.Redis, settings: Settings, pools: Sequence[str] = (STABLE_POOL,)
) -> dict[PriorityClass, int]:
    """Each class's backlog now, counted as a submit's admission counts it: its waiting messages in every pool of
    ``pools`` and the admissions whose message is not out yet."""
    k = keys(settings)
    raw: list[Any] = _script(client, _BACKLOGS_LUA)(
        keys=[*(k.reservations(c) for c in PriorityClass), *(k.queue(c, p) for c in PriorityClass for p in pools)],
        args=[settings.scheduling_reserve_s, len(pools)],
    )
    return {c: int(n) for c, n in zip(PriorityClass, raw, strict=True)}


# KEYS: the classes' reservations, then each class's queues (ARGV[2] pools each, the classes in the same order).
_BACKLOGS_LUA = """
local t = redis.call('TIME')
local since = '(' .. tostring(tonumber(t[1]) + tonumber(t[2]) / 1e6 - tonumber(ARGV[1]))
local per = tonumber(ARGV[2])
local n = (#KEYS) / (1 + per)
local out = {}
for i = 1, n do
  local total = redis.call('ZCOUNT', KEYS[i], since, '+inf')
  for j = 1, per do total = total + redis.call('LLEN', KEYS[n + (i - 1) * per + j]) end
  out[i] = total
end
return out
"""


# --- the submit ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Decision:
    admitted: bool
    backlog: int  # the class's backlog before this submit
    watermark: int
    rate: float  # the fleet's service rate, jobs/s (0: not measured yet)

    def retry_after_s(self, settings: Settings) -> int:
        """When a refused client should come back: the time for the fleet to take the jobs over the watermark,
        at the measured service rate; ``api_retry_after_s`` before any rate is known. At least 1 s, at most
        ``scheduling_retry_after_max_s``."""
        if self.rate <= 0:
            return settings.api_retry_after_s
        over = self.backlog - self.watermark + 1
        return max(1, min(settings.scheduling_retry_after_max_s, math.ceil(over / self.rate)))


async def admit(
    client: aioredis.Redis,
    settings: Settings,
    klass: PriorityClass,
    *,
    job_id: uuid.UUID,
    pools: Sequence[str] = (STABLE_POOL,),
) -> Decision:
    """Reserve a place for ``job_id`` in ``klass``'s backlog if it is under the watermark (atomic across API
    processes). The backlog counts the class's queues in every pool of ``pools``: a class has one watermark,
    however its jobs are split between pools. The job's message takes the reservation's place when it is published
    (``take_reservation``, in the same atomic step), so each job counts once. Raises redis errors: the caller fails
    open."""
    k = keys(settings)
    raw: list[Any] = await _script(client, _ADMIT_LUA)(
        keys=[k.reservations(klass), k.state, *(k.queue(klass, p) for p in pools)],
        args=[
            klass.value,
            job_id.hex,
            settings.scheduling_reserve_s,
            settings.watermark_normal,
            settings.watermark_min,
            settings.watermark_max,
        ],
    )
    admitted, backlog, watermark, rate = raw
    return Decision(admitted=bool(int(admitted)), backlog=int(backlog), watermark=int(watermark), rate=float(rate))


@dataclass(frozen=True, slots=True)
class FleetFull:
    """Every class at its watermark, as the latest decisions found them: (class, backlog, watermark) each, and the
    soonest Retry-After among them (a refused client may come back when any class has room)."""

    classes: tuple[tuple[PriorityClass, int, int], ...]
    retry_after_s: int


def take_reservation(pipe: redis.client.Pipeline, prefix: str, *, queue: str, job_id: uuid.UUID) -> None:
    """In the transaction that pushes ``job_id``'s message onto ``queue``: its reservation ends (nothing for a queue
    that is not a video class's, or a job that has none, such as a re-send)."""
    klass = class_of_queue(queue)
    if klass is not None:
        pipe.zrem(Keys(prefix).reservations(klass), job_id.hex)


# The backlog (waiting messages in each pool's queue of the class + admissions whose message is not out yet, the
# expired ones dropped) against W, and the reservation. KEYS: reservations, state, then the class's queues.
_ADMIT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local reserve = tonumber(ARGV[3])
local w = tonumber(redis.call('HGET', KEYS[2], 'w:' .. ARGV[1]) or ARGV[4])
w = math.floor(math.max(tonumber(ARGV[5]), math.min(tonumber(ARGV[6]), w)))
local rate = redis.call('HGET', KEYS[2], 'rate') or '0'
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - reserve)
local backlog = redis.call('ZCARD', KEYS[1])
for i = 3, #KEYS do backlog = backlog + redis.call('LLEN', KEYS[i]) end
if backlog >= w then return {0, backlog, w, rate} end
redis.call('ZADD', KEYS[1], now, ARGV[2])
redis.call('PEXPIRE', KEYS[1], math.ceil(reserve * 1000) + 1000)
return {1, backlog, w, rate}
"""
