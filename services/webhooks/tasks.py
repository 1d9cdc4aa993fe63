"""Webhook delivery: a Celery task on its own queue. Each attempt is one signed POST (Standard Webhooks), no
redirects followed, the resolved address checked at connect time; every attempt is written to
``webhook_deliveries``. The message id is deterministic per job and event, so a receiver can drop duplicates.

Retries follow the schedule in shared/webhooks/schedule.py and are kept in Postgres, not in a broker countdown:
a retryable failure records when the next attempt is due (``next_attempt_at``), the sweeper hands the due attempt
back to this task, and the task makes attempt ``last + 1``. So a worker restart, a Redis restart or a receiver
down for hours delays the event, never loses it. A message that finds no attempt due (a duplicate, or one sent
for an event already delivered) is dropped: the latest attempt on record decides.
"""

from __future__ import annotations

import json
import logging
import uuid
from datetime import UTC, datetime

from celery import Task, shared_task
from opentelemetry.trace import StatusCode

from shared.infra.config import Settings
from shared.infra.db import session_scope
from shared.infra.tracing import stage_span
from shared.jobs.status import JobStatus
from shared.queues import TASK_DELIVER_WEBHOOK
from shared.webhooks import deliveries
from shared.webhooks.events import event_body, event_type
from shared.webhooks.schedule import message_id, next_delay_s
from shared.webhooks.signing import sign
from shared.webhooks.transport import DeliveryResult, deliver

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


@shared_task(name=TASK_DELIVER_WEBHOOK, bind=True, acks_late=True, ignore_result=True)
def deliver_webhook(self: Task, job_id: str) -> str:
    settings: Settings = self.app.settings
    jid = uuid.UUID(job_id)
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
        payload = event_body(job, settings=settings, storage=self.app.storage)
        url = job.webhook_url
    # 2. One guarded POST, outside any transaction (it may take webhook_timeout_s); a span of the job's trace.
    msg_id = message_id(jid, kind)
    body = json.dumps(payload, separators=(",", ":")).encode()
    with stage_span("webhook", {"vidq.job_id": job_id, "vidq.event": kind}) as span:
        result = deliver(
            url,
            body=body,
            headers=sign(secret, msg_id=msg_id, body=body, timestamp=datetime.now(UTC)),
            timeout_s=settings.webhook_timeout_s,
            allow_private=settings.webhook_allow_private,
        )
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
