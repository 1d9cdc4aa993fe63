"""Standard Webhooks (signature v1): secrets, event bodies and the signed headers of one message."""

from __future__ import annotations

import base64
import secrets
from datetime import UTC, datetime
from typing import Any

from standardwebhooks.webhooks import Webhook

EVENT_TYPES = ("job.succeeded", "job.failed", "job.cancelled")
USER_AGENT = "vidq-webhooks/1"


def new_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode("ascii")


def build_event(*, event_type: str, job: dict[str, Any], at: datetime | None = None) -> dict[str, Any]:
    if event_type not in EVENT_TYPES:
        raise ValueError(f"unknown event type {event_type!r}; expected one of {', '.join(EVENT_TYPES)}")
    return {"type": event_type, "timestamp": (at or datetime.now(UTC)).isoformat(), "data": job}


def sign(secret: str, *, msg_id: str, body: bytes, timestamp: datetime) -> dict[str, str]:
    """Headers for one message. Keep ``msg_id`` the same across retries: receivers dedupe on it."""
    if timestamp.tzinfo is None:
        raise ValueError("timestamp must be timezone-aware")
    # The library replaces the zone with UTC instead of converting, which would shift the signed time.
    utc = timestamp.astimezone(UTC)
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(utc.timestamp())),
        "webhook-signature": Webhook(secret).sign(msg_id, utc, body.decode("utf-8")),
        "content-type": "application/json",
        "user-agent": USER_AGENT,
    }
