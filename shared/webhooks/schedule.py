"""When a failed webhook delivery is tried again: the Standard Webhooks / Svix schedule (immediately, 5 s, 5 min,
30 min, 2 h, 5 h, 10 h, 10 h), a setting, with a little jitter.

The schedule outlives real outages (a receiver down for a day still gets its events) because the next attempt's
time is kept in Postgres (``webhook_deliveries.next_attempt_at``) and the sweeper hands due attempts to the
webhook queue: nothing sleeps in a broker countdown that a restart, or Redis' visibility timeout, would lose.
The jitter keeps the deliveries that one receiver's outage failed together from coming back in one wave.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable, Sequence


def next_delay_s(
    attempt: int,
    *,
    schedule: Sequence[float],
    jitter: float = 0.1,
    uniform: Callable[[float, float], float] = random.uniform,
) -> float | None:
    """Seconds from failed attempt ``attempt`` (1-based) to the next one, or None when it was the last:
    ``schedule[attempt - 1]`` scaled by a factor in [1 - jitter, 1 + jitter]."""
    if attempt < 1 or attempt > len(schedule):
        return None
    return max(0.0, schedule[attempt - 1] * uniform(1.0 - jitter, 1.0 + jitter))


def deferral_s(
    attempt: int,
    *,
    schedule: Sequence[float],
    jitter: float = 0.1,
    uniform: Callable[[float, float], float] = random.uniform,
) -> float | None:
    """How long attempt ``attempt`` waits when its receiver's host is refused by its circuit breaker: the delay the
    schedule puts after that attempt (its last delay for an attempt past its end), as if it had been made and had
    failed, but without spending it. None for an empty schedule."""
    if not schedule:
        return None
    return next_delay_s(min(max(attempt, 1), len(schedule)), schedule=schedule, jitter=jitter, uniform=uniform)


def message_id(job_id: uuid.UUID, event_type: str) -> str:
    """The ``webhook-id`` of a job's event: the same on every attempt of the schedule and on a redelivery, so a
    receiver drops the duplicates that at-least-once delivery sends."""
    return f"msg_{job_id.hex}_{event_type.removeprefix('job.')}"
