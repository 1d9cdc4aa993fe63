"""Handing an unclaimable message back to its queue without losing it (docs/architecture.md, invariant 9).

When Postgres has not answered a claim for ``worker_claim_wait_s``, the video task puts a new copy of its message on
the job's queue (Celery's retry) and only then is the original acknowledged. Celery's retry, when it cannot publish
the copy (the broker down as well), rejects the original for good: with acks_late the job's only message is gone,
and nothing would send the job again before the sweeper's lost-message resend (``queued_resend_s``, 30 min).

Here the original is never given up before a copy is out:
- a publish that fails because the broker is unreachable is tried again with the workers' backoff
  (``worker_db_retry_*``), until the task's soft time limit;
- if the broker is still unreachable then (or the publish fails for any other reason), the original is rejected
  *with* requeue: it goes back to its queue; and if the broker cannot even be told that, the message stays among
  the broker's unacknowledged ones (restored after ``visibility_timeout_s``), and the sweeper's lost-message rule
  sends the job again ``queued_resend_s`` after its last send, which by then lies a soft time limit back (both
  30 min by default): a job waits out both outages, not a timer on top of them.
A copy published and the original requeued as well is a duplicate, which the claim drops.
"""

from __future__ import annotations

import logging
import time
from typing import NoReturn

import redis.exceptions
from celery import Task
from celery.exceptions import Reject, Retry
from kombu.exceptions import OperationalError as BrokerOperationalError
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_before_delay, wait_random_exponential

log = logging.getLogger("vidq.worker.handback")


class PublishFailed(Exception):
    """The copy of the message could not be published; ``cause`` says why."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(repr(cause))
        self.cause = cause


def broker_unreachable(exc: BaseException) -> bool:
    """The broker is down or unreachable (refused, reset, timed out), not a message it refused."""
    if isinstance(exc, PublishFailed):
        exc = exc.cause
    return isinstance(
        exc,
        BrokerOperationalError
        | redis.exceptions.ConnectionError
        | redis.exceptions.TimeoutError
        | ConnectionError
        | TimeoutError,
    )


def hand_back(task: Task, exc: Exception, *, until: float) -> NoReturn:
    """Put the running task's message back on its queue, and end the task: raises Celery's ``Retry`` once a new copy
    is published (the original is then acknowledged), or ``Reject(requeue=True)`` when no copy could be published
    by ``until`` (time.monotonic()) or the soft time limit, whichever comes first. Never returns, never drops the
    message."""
    settings = task.app.settings
    job_id = str(task.request.args[0]) if task.request.args else None

    def publish() -> Retry:
        try:
            retry: Retry = task.retry(exc=exc, countdown=settings.worker_db_retry_max_s, max_retries=None, throw=False)
        except Reject as rejected:  # Celery's answer to a copy it could not publish: the reason is the error
            cause = rejected.reason if isinstance(rejected.reason, BaseException) else rejected
            raise PublishFailed(cause) from rejected
        return retry

    def log_wait(state: RetryCallState) -> None:
        if state.attempt_number % 30 == 1:  # once at the start, then about every 30 s at the cap
            error = state.outcome.exception() if state.outcome else None
            log.warning(
                "broker unreachable; retrying the re-publish of an unclaimed message (kept unacknowledged)",
                extra={"job_id": job_id, "error": repr(error)[:300]},
            )

    retrying = Retrying(
        retry=retry_if_exception(broker_unreachable),
        stop=stop_before_delay(max(0.0, until - time.monotonic())),
        wait=wait_random_exponential(multiplier=settings.worker_db_retry_base_s, max=settings.worker_db_retry_max_s),
        before_sleep=log_wait,
        reraise=True,
    )
    try:
        retry = retrying(publish)
    except Exception as failed:  # PublishFailed, SoftTimeLimitExceeded, or anything else: the original goes back
        log.warning(
            "unclaimed message not re-published; rejected with requeue",
            extra={"job_id": job_id, "error": repr(failed)[:300]},
        )
        raise Reject(failed, requeue=True) from failed
    log.info("unclaimed message re-published", extra={"job_id": job_id})
    raise retry
