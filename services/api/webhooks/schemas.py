"""The webhook endpoints' responses: a delivery attempt, a page of failing deliveries, a redelivery queued."""

from __future__ import annotations

import uuid
from datetime import datetime

from pydantic import BaseModel, ConfigDict


class WebhookDeliveryOut(BaseModel):
    """One delivery attempt. ``next_attempt_at``: when the retry after it was planned (null after the attempt
    that delivered, or the last one); the latest attempt's value is when the next attempt is due."""

    model_config = ConfigDict(from_attributes=True)

    id: int
    job_id: uuid.UUID
    event_type: str
    msg_id: str
    attempt: int
    url: str
    ok: bool
    status_code: int | None
    error: str | None
    duration_ms: int
    created_at: datetime
    next_attempt_at: datetime | None


class WebhookDeliveryPage(BaseModel):
    """The latest attempt of each failing delivery, newest first; pass ``next_cursor`` back as ``cursor``."""

    data: list[WebhookDeliveryOut]
    next_cursor: str | None


class RedeliveryOut(BaseModel):
    """A redelivery queued: one fresh attempt of the job's event, with the same ``webhook-id``."""

    job_id: uuid.UUID
    event_type: str
    msg_id: str
