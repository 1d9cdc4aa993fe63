"""Webhook delivery: a Celery task on its own queue. Each attempt is one signed POST (Standard Webhooks), no
redirects followed, the resolved address checked at connect time; every attempt is written to
``webhook_deliveries``. The message id is deterministic per job and event, so a receiver can drop duplicates."""

from __future__ import annotations

import json
import logging
import uuid
from datetime import UTC, datetime

from celery import Task, shared_task
from sqlalchemy import insert, select, update
from tenacity import RetryCallState, wait_random_exponential

from shared.db import session_scope
from shared.models import Job, Tenant, WebhookDelivery
from shared.presenters import present_job
from shared.queues import TASK_DELIVER_WEBHOOK
from shared.states import JobStatus
from shared.webhooks.signing import build_event, sign
from shared.webhooks.transport import deliver

log = logging.getLogger("vidq.webhooks")


def retry_delay_s(attempt: int, *, base_s: float, max_s: float) -> float:
    """Delay after failed attempt ``attempt`` (1-based): uniform in [0, min(max_s, base_s * 2**(attempt-1))].
    Full jitter spreads the retries of many failed deliveries instead of sending them in waves."""
    state = RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]
    state.attempt_number = attempt
    return float(wait_random_exponential(multiplier=base_s, max=max_s)(state))


@shared_task(name=TASK_DELIVER_WEBHOOK, bind=True, acks_late=True, ignore_result=True, max_retries=None)
def deliver_webhook(self: Task, job_id: str) -> str:
    settings = self.app.settings
    jid = uuid.UUID(job_id)
    ctx = {"job_id": job_id}
    with session_scope(settings) as session:
        row = session.execute(
            select(Job, Tenant.webhook_secret).join(Tenant, Tenant.id == Job.tenant_id).where(Job.id == jid)
        ).first()
        if row is None:
            return "no_job"
        job, secret = row
        if not job.webhook_url or not JobStatus(job.status).is_terminal():
            return "nothing_to_send"
        event_type = f"job.{job.status}"
        payload = build_event(
            event_type=event_type,
            job=present_job(job, settings=settings, storage=self.app.storage).model_dump(mode="json"),
        )
        url = job.webhook_url
    msg_id = f"msg_{job_id.replace('-', '')}_{event_type.split('.')[1]}"
    body = json.dumps(payload, separators=(",", ":")).encode()
    attempt = self.request.retries + 1
    result = deliver(
        url,
        body=body,
        headers=sign(secret, msg_id=msg_id, body=body, timestamp=datetime.now(UTC)),
        timeout_s=settings.webhook_timeout_s,
        allow_private=settings.webhook_allow_private,
    )
    with session_scope(settings) as session:
        session.execute(
            insert(WebhookDelivery).values(
                job_id=jid,
                event_type=event_type,
                msg_id=msg_id,
                attempt=attempt,
                url=url,
                ok=result.ok,
                status_code=result.status_code,
                error=result.error,
                duration_ms=result.duration_ms,
                response_excerpt=result.response_excerpt,
            )
        )
        # An attempt is on record: the sweeper no longer needs to hand this job over (ix_jobs_webhook_pending).
        session.execute(
            update(Job)
            .where(Job.id == jid, Job.webhook_pending_since.is_not(None))
            .values(webhook_pending_since=None)
            .execution_options(synchronize_session=False)
        )
    log.info(
        "webhook attempt",
        extra={
            **ctx,
            "attempt": attempt,
            "ok": result.ok,
            "status": result.status_code,
            "error": result.error,
        },
    )
    if result.ok:
        return "delivered"
    if result.retryable and attempt < settings.webhook_max_attempts:
        delay = retry_delay_s(attempt, base_s=settings.webhook_backoff_base_s, max_s=settings.webhook_backoff_max_s)
        raise self.retry(countdown=delay)
    return "gave_up"
