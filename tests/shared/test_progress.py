"""shared/messaging/progress.py and the API's hub (services/api/jobs/progress_hub.py) in this process: the hub survives
a dropped Redis connection (real Redis, marked integration through ``settings``) and closes whatever its reader
does; the workers' publisher never raises into a render and stays quiet after a failure (no service: a port nothing
listens on, and a listener that counts connections).

The ``asyncio.timeout`` guards are hang guards for events expected within a second, not timing assertions."""

from __future__ import annotations

import asyncio
import uuid

import redis
from pydantic import RedisDsn

from services.api.jobs.progress_hub import ProgressHub
from shared.infra.config import Settings
from shared.messaging.progress import ProgressPublisher, ProgressUpdate, Signal
from tests.shared.sockets import ClosingListener
from tools.processes import free_ports

HANG_GUARD_S = 60.0


def test_the_hub_resubscribes_after_its_connection_drops(settings):
    """The hub's one Redis connection is killed: it reconnects, tells its streams to re-read (messages may have
    been lost meanwhile), and messages flow again."""
    publisher = ProgressPublisher(settings)
    job_id = uuid.uuid4()

    async def scenario() -> list[object]:
        hub = ProgressHub(settings)
        await hub.start()
        try:
            async with asyncio.timeout(HANG_GUARD_S):
                while not hub.connected:
                    await asyncio.sleep(0.05)
                subscription = await hub.subscribe(job_id)
                await asyncio.to_thread(publisher.progress, job_id, status="running", step=1, total=4, attempt=1)
                seen: list[object] = [await subscription.get(timeout=HANG_GUARD_S)]
                # This process's own hub connection, found by its local port (never another session's).
                port = hub._pubsub.connection._writer.get_extra_info("sockname")[1]  # type: ignore[union-attr]
                with redis.Redis.from_url(str(settings.broker_url), socket_timeout=5) as admin:
                    ids = [c["id"] for c in admin.client_list() if c["addr"].endswith(f":{port}")]
                    assert len(ids) == 1
                    admin.client_kill_filter(_id=ids[0])
                seen.append(await subscription.get(timeout=HANG_GUARD_S))
                await asyncio.to_thread(publisher.finished, job_id, status="succeeded")
                seen.append(await subscription.get(timeout=HANG_GUARD_S))
                subscription.close()
                return seen
        finally:
            await hub.close()

    seen = asyncio.run(scenario())
    publisher.close()
    assert seen == [ProgressUpdate(status="running", step=1, total=4, attempt=1), Signal.RESYNC, Signal.FINISHED]


def test_the_hub_closes_although_its_reader_swallowed_a_cancellation():
    """redis-py can swallow a cancellation that arrives while it connects, and the reader then goes on: a hub
    closed during its first connect (an API stopped, or failing to bind its port, right after it started) must
    still close, not wait on that reader forever."""
    settings = Settings(broker_url=RedisDsn(f"redis://127.0.0.1:{free_ports(1)[0]}/0"))
    cancels = 0

    async def stubborn_reader() -> None:
        nonlocal cancels
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancels += 1
                if cancels > 1:
                    raise  # the second cancel ends it; the first is swallowed, as in a connect

    async def scenario() -> tuple[bool, bool]:
        hub = ProgressHub(settings)
        reader = hub._task = asyncio.create_task(stubborn_reader())
        await asyncio.sleep(0)  # the reader is waiting now
        closing = asyncio.create_task(hub.close())
        await asyncio.wait({closing}, timeout=HANG_GUARD_S)  # a hang guard that cancels nothing
        closed = closing.done()
        for task in (closing, reader):  # after a failure, leave nothing running
            task.cancel()
        await asyncio.gather(closing, reader, return_exceptions=True)
        return closed, reader.done()

    assert asyncio.run(scenario()) == (True, True)
    assert cancels == 2


def _publisher(address: str) -> ProgressPublisher:
    # A quiet period far longer than this test: a stalled machine cannot end it between two calls.
    return ProgressPublisher(Settings(broker_url=RedisDsn(f"redis://{address}/0"), redis_socket_timeout_s=60.0))


def test_publishing_to_an_unreachable_redis_never_raises():
    job_id = uuid.uuid4()
    refused = _publisher(f"127.0.0.1:{free_ports(1)[0]}")  # nothing listens there
    try:
        assert refused.progress(job_id, status="running", step=1, total=4, attempt=1) is None
        assert refused.finished(job_id, status="succeeded") is None
    finally:
        refused.close()

    # Quiet after the first failure: the calls that follow make no connection attempt, so none of them waits.
    with ClosingListener() as dying:
        publisher = _publisher(dying.address)
        try:
            publisher.progress(job_id, status="running", step=1, total=4, attempt=1)
            tried = dying.accepted
            assert tried >= 1, "the first publish never reached the listener: the count below would prove nothing"
            for step in range(2, 5):
                publisher.progress(job_id, status="running", step=step, total=4, attempt=1)
            publisher.finished(job_id, status="succeeded")
            assert dying.accepted == tried
        finally:
            publisher.close()
