"""services/webhooks/tasks.py without services: what follows one delivery attempt. The attempts themselves
(shared/webhooks): tests/shared/test_webhooks.py; the task on real processes: tests/integration/test_webhook_*.py."""

from __future__ import annotations

from services.webhooks.tasks import outcome
from shared.infra.config import Settings
from shared.webhooks.transport import DeliveryResult


def _result(status: int | None, *, retryable: bool, error: str | None = "x") -> DeliveryResult:
    return DeliveryResult(status is not None and 200 <= status < 300, status, error, 1, "", retryable)


def test_outcome_of_an_attempt() -> None:
    settings = Settings(webhook_schedule_s=[1.0, 2.0], webhook_schedule_jitter=0.0)
    assert outcome(_result(204, retryable=False, error=None), attempt=1, settings=settings) == ("delivered", None)
    assert outcome(_result(503, retryable=True), attempt=1, settings=settings) == ("retry_scheduled", 1.0)
    assert outcome(_result(None, retryable=True), attempt=2, settings=settings) == ("retry_scheduled", 2.0)
    assert outcome(_result(429, retryable=True), attempt=3, settings=settings) == ("gave_up", None)  # schedule done
    assert outcome(_result(410, retryable=False), attempt=1, settings=settings) == ("gone", None)
    assert outcome(_result(400, retryable=False), attempt=1, settings=settings) == ("gave_up", None)
    assert outcome(_result(302, retryable=False), attempt=1, settings=settings) == ("gave_up", None)
