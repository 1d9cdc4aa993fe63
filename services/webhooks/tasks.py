"""Webhook delivery: a Celery task on its own queue. Each attempt is one signed POST (Standard Webhooks), no
redirects followed, the resolved address checked at connect time; every attempt is written to
``webhook_deliveries``. The message id is deterministic per job and event, so a receiver can drop duplicates.

Retries follow the schedule in shared/webhooks/schedule.py and are kept in Postgres, not in a broker countdown:
a retryable failure records when the next attempt is due (``next_attempt_at``), the sweeper hands the due attempt
back to this task, and the task makes attempt ``last + 1``. So a worker restart, a Redis restart or a receiver
down for hours delays the event, never loses it. A message that finds no attempt due (a duplicate, or one sent
for an event already delivered) is dropped: the latest attempt on record decides.

Each receiver host (``host:port``) has a circuit breaker in this process (shared/infra/breakers.py): a retryable
failure (refused, timed out, 5xx, 408, 429) counts against it; any answer that is not one (2xx, another 4xx, a
redirect) counts for it. While it is open, a due attempt to that host is not made: it is deferred by the delay the
schedule puts after it (shared/webhooks/schedule.py ``deferral_s``) and is not spent — the next attempt made has
the number this one would have had, and nothing is added to the delivery log. Deferral ends where the schedule
would have: once the job finished longer ago than the whole schedule, an attempt is made whatever the breaker says,
so a delivery still gives up in the end.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from datetime import UTC, datetime, timedelta
from urllib.parse import urlsplit

from celery import Task, shared_task
from opentelemetry.trace import StatusCode

from shared.infra.breakers import BreakerRule, BreakerSet, CircuitBreaker
from shared.infra.config import Settings
from shared.infra.db import session_scope
from shared.infra.retries import non_idempotent
from shared.infra.storage import Storage
from shared.infra.tracing import stage_span
from shared.jobs.status import JobStatus
from shared.models import Job
from shared.queues import TASK_DELIVER_WEBHOOK
from shared.webhooks import deliveries
from shared.webhooks.events import event_body, event_type
from shared.webhooks.schedule import deferral_s, message_id, next_delay_s
from shared.webhooks.signing import sign
from shared.webhooks.transport import DeliveryResult, deliver_retrying

log = logging.getLogger("vidq.webhooks")

GONE = 410  # the receiver says the endpoint is gone for good: no retry, whatever the schedule says


def outcome(result: DeliveryResult, *, attempt: int, settings: Settings) -> tuple[str, float | None]:
    """What follows an attempt: ``(outcome, seconds to the next attempt or None)``. 2xx → delivered; 410 →
    gone; other non-retryable answers (4xx but 408/429, redirects, refused addresses) → gave_up; a retryable
    failure → the next attempt of the schedule, or gave_up after its last."""
    if result.ok:
        return "delivered", None
    if result.status_code == GONE:
        return "gone", None
    if not result.retryable:
        return "gave_up", None
    delay = next_delay_s(attempt, schedule=settings.webhook_schedule_s, jitter=settings.webhook_schedule_jitter)
    return ("gave_up", None) if delay is None else ("retry_scheduled", delay)


_hosts_lock = threading.Lock()
_hosts: list[BreakerSet] = []


def host_breakers(settings: Settings) -> BreakerSet:
    """This process's breakers, one per receiver host; made on first use."""
    with _hosts_lock:
        if not _hosts:
            rule = BreakerRule.from_settings(settings)
            _hosts.append(BreakerSet("webhook", rule, max_keys=settings.breaker_max_keys))
        return _hosts[0]


def host_of(url: str) -> str:
    """``host:port`` of a webhook URL (the port its scheme implies when it names none)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{(parts.hostname or '').lower()}:{port}"


def count(breaker: CircuitBreaker, result: DeliveryResult) -> None:
    """An attempt's result on its host's breaker: a retryable failure against it, any other answer for it; a
    request never sent for a reason of ours (an address refused, an invalid URL) counts neither way."""
    if result.ok or (result.status_code is not None and not result.retryable):
        breaker.success()
    elif result.retryable:
        breaker.failure()
    else:
        breaker.release()


def deferrable(job: Job, settings: Settings, *, now: datetime) -> bool:
    """Whether an attempt may still be deferred: the job finished less than the whole schedule ago."""
    if job.finished_at is None:
        return True
    return now < job.finished_at + timedelta(seconds=sum(settings.webhook_schedule_s))


@shared_task(name=TASK_DELIVER_WEBHOOK, bind=True, acks_late=True, ignore_result=True)
def deliver_webhook(self: Task, job_id: str) -> str:
    settings: Settings = self.app.settings
    return attempt_delivery(
        uuid.UUID(job_id), settings=settings, storage=self.app.storage, hosts=host_breakers(settings)
    )


def attempt_delivery(jid: uuid.UUID, *, settings: Settings, storage: Storage | None, hosts: BreakerSet) -> str:
    """The due attempt of the job's event, if one is due: made, or deferred while its host's breaker is open.
    Returns what happened ("delivered", "retry_scheduled", "deferred", "not_due", …) for logs and tests."""
    job_id = str(jid)
    # 1. The job, its tenant's secret, and whether an attempt is due: none on record yet, or the latest one
    #    has a retry planned (or a redelivery asked) for now or earlier, on the database's clock.
    with session_scope(settings) as session:
        found = deliveries.job_and_secret(session, jid)
        if found is None:
            return "no_job"
        job, secret = found
        if not job.webhook_url or not JobStatus(job.status).is_terminal():
            return "nothing_to_send"
        kind = event_type(job)  # job.* or video.*, by the API that created the job
        latest = deliveries.latest_and_due(session, jid, kind)
        if latest is not None and not latest[1]:
            return "not_due"  # delivered, given up, or its retry is not due yet: the sweeper hands it over then
        attempt = 1 if latest is None else latest[0].attempt + 1
        payload = event_body(job, settings=settings, storage=storage)
        url = job.webhook_url
        breaker = hosts.get(host_of(url))
        if deferrable(job, settings, now=datetime.now(UTC)) and not breaker.allow():
            wait_s = deferral_s(attempt, schedule=settings.webhook_schedule_s, jitter=settings.webhook_schedule_jitter)
            deferred_s = settings.breaker_open_s if wait_s is None else wait_s
            deliveries.defer(
                session,
                job_id=jid,
                latest=None if latest is None else latest[0],
                delay_s=deferred_s,
                grace_s=settings.webhook_resend_grace_s,
            )
            log.info(
                "webhook deferred: its host's circuit is open",
                extra={"job_id": job_id, "attempt": attempt, "host": host_of(url), "next_in_s": deferred_s},
            )
            return "deferred"
    # 2. One guarded POST, outside any transaction (it may take webhook_timeout_s); a span of the job's trace.
    msg_id = message_id(jid, kind)
    body = json.dumps(payload, separators=(",", ":")).encode()
    with stage_span("webhook", {"vidq.job_id": job_id, "vidq.event": kind}) as span:
        try:
            result = deliver_retrying(
                url,
                policy=non_idempotent(settings),
                body=body,
                headers=sign(secret, msg_id=msg_id, body=body, timestamp=datetime.now(UTC)),
                timeout_s=settings.webhook_timeout_s,
                allow_private=settings.webhook_allow_private,
            )
        except BaseException:
            breaker.release()  # a probe that never ran frees its slot
            raise
        count(breaker, result)
        done, delay = outcome(result, attempt=attempt, settings=settings)
        span.set_attributes({"vidq.webhook.attempt": attempt, "vidq.webhook.outcome": done})
        if result.status_code is not None:
            span.set_attribute("http.response.status_code", result.status_code)
        if not result.ok:
            span.set_status(StatusCode.ERROR, result.error or f"HTTP {result.status_code}")
    # 3. The attempt on record, as the latest of its job and event; the next one planned when there is one.
    with session_scope(settings) as session:
        deliveries.record_attempt(
            session,
            job_id=jid,
            event_type=kind,
            next_in_s=delay,
            msg_id=msg_id,
            attempt=attempt,
            url=url,
            ok=result.ok,
            status_code=result.status_code,
            error=result.error,
            duration_ms=result.duration_ms,
            response_excerpt=result.response_excerpt,
        )
    log.info(
        "webhook attempt",
        extra={
            "job_id": job_id,
            "attempt": attempt,
            "ok": result.ok,
            "status": result.status_code,
            "error": result.error,
            "outcome": done,
            "next_in_s": delay,
        },
    )
    return done
