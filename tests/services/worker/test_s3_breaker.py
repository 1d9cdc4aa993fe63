"""The worker's upload through its S3 circuit breaker (services/worker/render.py ``_upload``), without services:
while the breaker is open the upload waits without calling S3, then the half-open probe is the upload itself;
outages count against S3, refused requests do not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from minio.error import S3Error

from services.worker import breakers, render
from shared.infra.breakers import BreakerRule, CircuitBreaker, State
from shared.infra.config import Settings
from shared.infra.storage import StoredObject

SETTINGS = Settings(worker_db_retry_base_s=0.0001, worker_db_retry_max_s=0.0002, worker_upload_retry_s=30)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TickingLease:
    """Checked before every try; each check moves the breaker's clock by ``step`` seconds."""

    def __init__(self, clock: Clock, step: float) -> None:
        self.clock, self.step, self.checks = clock, step, 0

    def check(self) -> None:
        self.checks += 1
        self.clock.now += self.step


class Storage:
    def __init__(self, errors: list[BaseException]) -> None:
        self.errors, self.calls = errors, 0

    def upload(self, key: str, path: Path, *, content_type: str) -> StoredObject:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return StoredObject(key=key, size=1, sha256="0" * 64)


@pytest.fixture
def breaker(monkeypatch: pytest.MonkeyPatch) -> tuple[CircuitBreaker, Clock]:
    clock = Clock()
    b = CircuitBreaker("s3", BreakerRule(failure_ratio=0.5, min_calls=3, window_s=60, open_s=60), clock=clock)
    monkeypatch.setattr(breakers, "_s3", [b])
    return b, clock


def upload(storage: Storage, lease: Any) -> StoredObject:
    return render._upload(
        storage,  # type: ignore[arg-type]
        "videos/t/j.mp4",
        Path("/dev/null"),
        content_type="video/mp4",
        settings=SETTINGS,
        lease=lease,
        ctx={},
    )


def test_an_open_breaker_waits_without_calling_s3_then_the_upload_is_the_probe(breaker) -> None:
    b, clock = breaker
    for _ in range(3):
        b.failure()
    assert b.state is State.OPEN
    storage, lease = Storage([]), TickingLease(clock, step=1.0)  # 60 checks until the probe may go
    stored = upload(storage, lease)
    assert stored.key == "videos/t/j.mp4"
    assert storage.calls == 1  # only the probe reached S3
    assert lease.checks == 60  # the wait went on, checking the lease at every step, until open_s had passed
    assert b.state is State.CLOSED


def test_an_outage_opens_the_breaker_and_the_upload_waits_it_out(breaker) -> None:
    b, clock = breaker
    outage: list[BaseException] = [ConnectionRefusedError(111, "refused")] * 3
    storage, lease = Storage(list(outage)), TickingLease(clock, step=1.0)
    assert upload(storage, lease).size == 1
    # three refused calls opened it (3 of 3); then no call for open_s; then the probe succeeded
    assert storage.calls == 4 and b.state is State.CLOSED


def test_a_refused_request_is_s3_answering(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    b = CircuitBreaker("s3", BreakerRule(failure_ratio=0.7, min_calls=3, window_s=60, open_s=60), clock=clock)
    monkeypatch.setattr(breakers, "_s3", [b])

    class Response:
        status = 403

    denied = S3Error(Response(), "AccessDenied", "no", "/b/k", "r", "h")  # type: ignore[arg-type]
    with pytest.raises(S3Error):
        upload(Storage([denied]), TickingLease(clock, step=0))
    for _ in range(2):
        b.failure()
    assert b.state is State.CLOSED  # 2 failed of 3, under 70%: the refusal counted as a success
    b.failure()
    assert b.state is State.OPEN  # 3 of 4
