"""The admission watermark's Redis side (shared/scheduling/watermark.py) against real Redis: the stepper's rule,
the service rate, the atomic admission, and the API's check failing open during an outage. Marked integration by
tests/conftest.py, through the ``settings`` fixture."""

from __future__ import annotations

import asyncio
import os
import time
import uuid

import pytest
import redis

from services.api.jobs.watermark import FAILED_OPEN, Watermark
from shared.errors import QueueFull
from shared.infra.redis_clients import async_broker_client, broker_client
from shared.queues import PriorityClass
from shared.scheduling.watermark import Decision, admit, count_done, keys, publish_utilization, step
from tests.conftest import _delete_broker_keys
from tests.integration.helpers import free_port


@pytest.fixture
def wm(settings):
    """Settings with the real levels (the session's stack raises them out of the way) and a key prefix of this
    test's own; its keys are deleted after."""
    prefix = f"{settings.broker_key_prefix}wm-{os.urandom(3).hex()}:"
    own = settings.model_copy(
        update={
            "broker_key_prefix": prefix,
            "watermark_idle": 64,
            "watermark_normal": 128,
            "watermark_busy": 512,
            "watermark_min": 32,
            "watermark_max": 512,
            "scheduling_cycle_s": 0.0,  # every call steps: the test drives the cycles
        }
    )
    yield own
    _delete_broker_keys(str(own.broker_url), prefix)


def test_w_moves_a_quarter_per_cycle_toward_the_target_of_the_utilisation(wm):
    client = broker_client(wm)
    publish_utilization(client, wm, worker="gpu-0", utilization=0.95)
    publish_utilization(client, wm, worker="gpu-1", utilization=0.90)
    seen = [step(client, wm).watermarks[PriorityClass.MEDIUM] for _ in range(8)]
    assert seen == [160, 200, 250, 312, 390, 488, 512, 512]  # ×1.25 a cycle from 128, then held at the busy level
    publish_utilization(client, wm, worker="gpu-0", utilization=0.1)
    publish_utilization(client, wm, worker="gpu-1", utilization=0.1)
    snapshot = step(client, wm)
    assert snapshot.workers == 2 and snapshot.utilization == pytest.approx(0.1)
    assert snapshot.watermarks[PriorityClass.MEDIUM] == 384  # ×0.75 toward the idle level
    for _ in range(10):
        snapshot = step(client, wm)
    assert set(snapshot.watermarks.values()) == {64}
    publish_utilization(client, wm, worker="gpu-0", utilization=0.5)
    publish_utilization(client, wm, worker="gpu-1", utilization=0.5)
    assert step(client, wm).watermarks[PriorityClass.HIGH] == 80  # toward normal (128), a quarter at a time


def test_w_stays_within_its_bounds_and_silent_workers_are_forgotten(wm):
    client = broker_client(wm)
    narrow = wm.model_copy(update={"watermark_max": 200, "watermark_busy": 200, "scheduling_util_stale_s": 0.5})
    publish_utilization(client, narrow, worker="gpu-0", utilization=1.0)
    for _ in range(10):
        snapshot = step(client, narrow)
    assert set(snapshot.watermarks.values()) == {200}
    time.sleep(0.6)  # the worker falls silent for longer than scheduling_util_stale_s (by Redis's clock)
    snapshot = step(client, narrow)
    assert snapshot.workers == 0 and snapshot.utilization == 0.0
    assert client.hlen(keys(narrow).utilization) == 0


def test_a_cycle_steps_once_whoever_asks(wm):
    client = broker_client(wm)
    slow = wm.model_copy(update={"scheduling_cycle_s": 3600.0})
    first, second = step(client, slow), step(client, slow)
    assert first.stepped and not second.stepped
    assert second.watermarks == first.watermarks


def test_the_service_rate_is_measured_from_finished_jobs(wm):
    client = broker_client(wm)
    step(client, wm)
    for _ in range(30):
        count_done(client, wm)
    snapshot = step(client, wm)
    assert snapshot.rate > 0


def test_admission_is_atomic_across_concurrent_submits(wm):
    fixed = wm.model_copy(update={"watermark_idle": 8, "watermark_normal": 8, "watermark_busy": 8, "watermark_min": 8})

    async def storm() -> list[Decision]:
        client = async_broker_client(fixed, retries=0)
        try:
            return await asyncio.gather(
                *(admit(client, fixed, PriorityClass.LOW, job_id=uuid.uuid4()) for _ in range(40))
            )
        finally:
            await client.aclose()

    decisions = asyncio.run(storm())
    assert sum(d.admitted for d in decisions) == 8
    assert all(d.watermark == 8 for d in decisions)
    assert sorted(d.backlog for d in decisions if d.admitted) == list(range(8))
    # Messages on the queue count too: with 8 admissions pending and 3 messages waiting, still full.
    broker_client(fixed).lpush(keys(fixed).queue(PriorityClass.LOW), "a", "b", "c")
    again = asyncio.run(storm())
    assert not any(d.admitted for d in again) and again[0].backlog == 11


def test_retry_after_follows_the_backlog_and_the_service_rate(settings):
    full = Decision(admitted=False, backlog=140, watermark=128, rate=0.5)
    assert full.retry_after_s(settings) == 26  # 13 jobs over, at 0.5 jobs/s
    assert Decision(admitted=False, backlog=128, watermark=128, rate=0.0).retry_after_s(settings) == (
        settings.api_retry_after_s
    )
    assert Decision(admitted=False, backlog=10**6, watermark=1, rate=0.01).retry_after_s(settings) == (
        settings.scheduling_retry_after_max_s
    )


def test_the_check_refuses_over_w_with_retry_after(wm):
    fixed = wm.model_copy(update={"watermark_idle": 2, "watermark_normal": 2, "watermark_busy": 2, "watermark_min": 2})

    async def run() -> QueueFull:
        watermark = Watermark(fixed)
        try:
            await watermark.check(PriorityClass.HIGH, uuid.uuid4())
            await watermark.check(PriorityClass.HIGH, uuid.uuid4())
            with pytest.raises(QueueFull) as refused:
                await watermark.check(PriorityClass.HIGH, uuid.uuid4())
            await watermark.check(PriorityClass.LOW, uuid.uuid4())  # another class has its own backlog
            return refused.value
        finally:
            await watermark.close()

    refused = asyncio.run(run())
    assert refused.status_code == 429 and refused.retry_after_s is not None and refused.retry_after_s >= 1
    assert refused.details == {"priority_class": "high", "backlog": 2, "watermark": 2}


def test_during_a_redis_outage_admission_fails_open_after_one_short_try(settings):
    down = settings.model_copy(
        update={"broker_url": f"redis://127.0.0.1:{free_port()}/0", "scheduling_redis_backoff_s": 3600.0}
    )

    async def run() -> None:
        watermark = Watermark(down)
        try:
            for _ in range(20):
                await watermark.check(PriorityClass.MEDIUM, uuid.uuid4())  # never raises: admitted without the check
        finally:
            await watermark.close()

    before = FAILED_OPEN._value.get()
    asyncio.run(run())
    assert FAILED_OPEN._value.get() - before == 1  # one try, then the back-off skips Redis


def test_a_worker_publishes_under_its_own_id(wm):
    client = broker_client(wm)
    publish_utilization(client, wm, worker="host:1", utilization=0.5)
    value = client.hget(keys(wm).utilization, "host:1")
    assert value is not None and value.decode().startswith("0.5000 ")
    with pytest.raises(redis.ConnectionError):
        publish_utilization(
            broker_client(wm.model_copy(update={"broker_url": f"redis://127.0.0.1:{free_port()}/0"}), retries=0),
            wm,
            worker="x",
            utilization=0.1,
        )


def test_the_fleet_is_full_while_every_class_refused_within_a_cycle(wm):
    """What the API's door refuses on: every class at its watermark, as the submits' checks and the stepper found it
    within the last scheduling cycle."""
    fixed = wm.model_copy(update={"watermark_idle": 2, "watermark_normal": 2, "watermark_busy": 2, "watermark_min": 2})
    now = [1000.0]

    async def fill(watermark: Watermark, klass: PriorityClass) -> None:
        await watermark.check(klass, uuid.uuid4())
        await watermark.check(klass, uuid.uuid4())
        with pytest.raises(QueueFull):
            await watermark.check(klass, uuid.uuid4())

    async def run() -> None:
        watermark = Watermark(fixed, clock=lambda: now[0])
        try:
            await fill(watermark, PriorityClass.HIGH)
            await fill(watermark, PriorityClass.MEDIUM)
            assert watermark.fleet_full() is None  # the low class still has room
            await fill(watermark, PriorityClass.LOW)
            full = watermark.fleet_full()
            assert full is not None
            assert full.classes == tuple((k, 2, 2) for k in PriorityClass)
            assert full.retry_after_s == fixed.api_retry_after_s  # no service rate measured yet
            now[0] += 0.1  # a cycle later (0.1 s at least), what the checks found is forgotten
            assert watermark.fleet_full() is None
            await watermark.refresh()  # the stepper's turn sees every class's backlog, whichever class is submitted
            assert watermark.fleet_full() == full
            broker_client(fixed).delete(keys(fixed).reservations(PriorityClass.MEDIUM))  # a class has room again
            await watermark.check(PriorityClass.MEDIUM, uuid.uuid4())
            assert watermark.fleet_full() is None
        finally:
            await watermark.close()

    asyncio.run(run())
