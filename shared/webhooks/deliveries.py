"""Queries on the webhook delivery log (``webhook_deliveries``) that more than one process asks."""

from __future__ import annotations

import uuid

from sqlalchemy import Select, select

from shared.models import WebhookDelivery


def latest_attempt(job_id: uuid.UUID, event_type: str) -> Select[WebhookDelivery]:
    """The newest live attempt of a job's event: the webhook task plans the next one from it, a redelivery makes it
    due now. Superseded rows belong to an earlier event of the job and stay only for the log."""
    return (
        select(WebhookDelivery)
        .where(
            WebhookDelivery.job_id == job_id,
            WebhookDelivery.event_type == event_type,
            ~WebhookDelivery.superseded,
        )
        .order_by(WebhookDelivery.attempt.desc())
        .limit(1)
    )
