"""Retries of single external calls: one backoff and two policies, so every caller waits the same way.

- **Backoff**: exponential from ``retry_base_s`` (100 ms), ×2 each time, at most ``retry_max_s`` (1 s), with full
  jitter (each wait is random between 0 and that bound), so callers failed by one blip do not come back in one wave.
- **Idempotent work** (an S3 read, a HEAD, a listing; doing it twice changes nothing): at most
  ``retry_idempotent_max`` (3) retries.
- **Non-idempotent work** (a webhook POST: the receiver may act on each copy it gets): at most
  ``retry_non_idempotent_max`` (2) retries, and the caller retries only failures where the request cannot have
  reached the other side (shared/webhooks/transport.py).

These are for one call that may fail for a moment. The long waits through an outage (the worker's claim and
finalize while Postgres is down, its upload while S3 is) keep their own deadlines in services/worker/runner.py and
build their waits from the same ``backoff``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tenacity import RetryCallState, Retrying, stop_after_attempt, stop_after_delay, wait_random_exponential
from tenacity.retry import retry_base
from tenacity.stop import stop_base

from shared.infra.config import Settings


def backoff(base_s: float, max_s: float) -> wait_random_exponential:
    """Exponential from ``base_s``, ×2, capped at ``max_s``, full jitter."""
    return wait_random_exponential(multiplier=base_s, exp_base=2, max=max_s)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """At most ``retries`` retries after the first try, waiting ``backoff(base_s, max_s)`` between tries."""

    retries: int
    base_s: float
    max_s: float

    def retrying(
        self,
        *,
        retry: retry_base,
        within_s: float | None = None,
        before_sleep: Callable[[RetryCallState], Any] | None = None,
        sleep: Callable[[float], None] | None = None,
    ) -> Retrying:
        """A tenacity ``Retrying`` that retries what ``retry`` says is worth it; ``within_s`` also stops once that
        much time has passed since the first try. The last outcome is the caller's (an error is re-raised, a
        result returned)."""
        stop: stop_base = stop_after_attempt(self.retries + 1)
        if within_s is not None:
            stop = stop | stop_after_delay(within_s)
        options: dict[str, Any] = {}
        if sleep is not None:
            options["sleep"] = sleep
        return Retrying(
            retry=retry,
            stop=stop,
            wait=backoff(self.base_s, self.max_s),
            before_sleep=before_sleep,
            reraise=True,
            retry_error_callback=lambda state: state.outcome.result() if state.outcome else None,
            **options,
        )


def idempotent(settings: Settings) -> RetryPolicy:
    """Work that may be repeated safely: ``retry_idempotent_max`` retries."""
    return RetryPolicy(settings.retry_idempotent_max, settings.retry_base_s, settings.retry_max_s)


def non_idempotent(settings: Settings) -> RetryPolicy:
    """Work the other side may act on twice: ``retry_non_idempotent_max`` retries."""
    return RetryPolicy(settings.retry_non_idempotent_max, settings.retry_base_s, settings.retry_max_s)
