"""The API's side of job progress: ``ProgressHub``, async, one per API process. One Redis connection carries every
stream's subscription, so 1,000 open streams cost 1,000 queues, not 1,000 connections. The channels and messages
are shared/messaging/progress.py's."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import uuid
from collections import deque
from typing import Any

from redis.asyncio.client import PubSub

from shared.infra.config import Settings
from shared.infra.redis_clients import async_broker_client
from shared.messaging.progress import Message, Signal, channel, decode

log = logging.getLogger("vidq.progress")

# A stream that falls this far behind has its backlog replaced by one RESYNC (it reads Postgres instead): a
# message only ever says what Postgres will say too, so nothing is lost but intermediate steps.
QUEUE_SIZE = 64
# Reconnect backoff of the hub: from 100 ms, ×2, at most 1 s, with jitter (docs/architecture.md, "Retries").
RECONNECT_FIRST_S = 0.1
RECONNECT_MAX_S = 1.0


class Subscription:
    """One stream's view of one job's channel. ``close()`` is synchronous and idempotent, so it can run in any
    ``finally`` (also one that is being cancelled)."""

    def __init__(self, hub: ProgressHub, *, channel_name: str, queue: asyncio.Queue[Message]) -> None:
        self._hub = hub
        self.channel = channel_name
        self._queue = queue
        self._closed = False

    async def get(self, *, timeout: float) -> Message | None:
        """The next message, or None after ``timeout`` seconds of silence."""
        try:
            async with asyncio.timeout(timeout):
                return await self._queue.get()
        except TimeoutError:
            return None

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._hub._release(self.channel, self._queue)


class ProgressHub:
    """One Redis pub/sub connection per API process, fanned out to per-stream queues.

    A channel is subscribed while at least one stream wants it (reference counted by the set of queues).
    ``subscribe()`` returns once Redis has confirmed the subscription, so a read of Postgres after it misses no
    message: Redis confirms in command order, and each confirmation resolves the oldest waiter of its channel.
    After a reconnect every channel is subscribed again and its streams get RESYNC when Redis confirms it,
    because messages published while the connection was down are gone.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # No retries inside redis-py: a connection error must reach _run, which reconnects and resyncs streams.
        self._client = async_broker_client(
            settings,
            retries=0,
            socket_keepalive=True,
            decode_responses=True,
            client_name="vidq-progress-hub",  # CLIENT LIST shows one per API process
        )
        # Subscribed on every connection: it makes the connection exist before any stream subscribes.
        self._control = f"{settings.broker_key_prefix}vidq:progress:hub"
        self._queues: dict[str, set[asyncio.Queue[Message]]] = {}
        self._waiters: dict[str, deque[asyncio.Future[None]]] = {}
        self._pubsub: PubSub | None = None
        self._send_lock = asyncio.Lock()  # SUBSCRIBE/UNSUBSCRIBE go out one at a time, in order
        self._task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()

    @property
    def connected(self) -> bool:
        return self._pubsub is not None

    @property
    def streams(self) -> int:
        return sum(len(queues) for queues in self._queues.values())

    async def start(self) -> None:
        """Starts the reader; returns at once (an unreachable Redis delays progress, never the API's start)."""
        self._task = asyncio.create_task(self._run(), name="progress-hub")

    async def close(self) -> None:
        for task in [*self._background, *([self._task] if self._task is not None else [])]:
            await _stop(task)
        for queues in self._queues.values():
            for queue in queues:
                _offer(queue, Signal.CLOSED)
        await self._client.aclose()

    async def subscribe(self, job_id: uuid.UUID) -> Subscription:
        name = channel(self.settings, job_id)
        queue: asyncio.Queue[Message] = asyncio.Queue(maxsize=QUEUE_SIZE)
        queues = self._queues.setdefault(name, set())
        first = not queues
        queues.add(queue)
        subscription = Subscription(self, channel_name=name, queue=queue)
        try:
            waiter = await self._send_subscribe(name, first=first)
            if waiter is not None:
                # A lost confirmation means a broken connection: _run reconnects and RESYNCs this channel.
                async with asyncio.timeout(self.settings.redis_socket_timeout_s):
                    await asyncio.shield(waiter)
        except TimeoutError:
            log.warning("progress subscription not confirmed in time", extra={"job_id": str(job_id)})
        except BaseException:
            subscription.close()
            raise
        return subscription

    async def _send_subscribe(self, name: str, *, first: bool) -> asyncio.Future[None] | None:
        async with self._send_lock:
            pubsub = self._pubsub
            if pubsub is None:  # disconnected: _run subscribes every wanted channel once it is back
                return None
            if not first:  # already subscribed, or on its way: wait for the newest pending confirmation, if any
                pending = self._waiters.get(name)
                return pending[-1] if pending else None
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.setdefault(name, deque()).append(waiter)
            try:
                await pubsub.subscribe(name)
            except Exception as exc:  # the reader sees the broken connection too and reconnects
                log.warning("progress subscribe failed", extra={"channel": name, "error": repr(exc)})
                return None
            return waiter

    def _release(self, name: str, queue: asyncio.Queue[Message]) -> None:
        queues = self._queues.get(name)
        if queues is None:
            return
        queues.discard(queue)
        if not queues:
            del self._queues[name]
            # close() runs in finally blocks, cancelled ones too: the UNSUBSCRIBE goes out from a task of its own.
            task = asyncio.get_running_loop().create_task(self._unsubscribe(name))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _unsubscribe(self, name: str) -> None:
        async with self._send_lock:
            pubsub = self._pubsub
            if name in self._queues or pubsub is None:  # wanted again meanwhile, or nothing to undo
                return
            try:
                await pubsub.unsubscribe(name)
            except Exception as exc:
                log.warning("progress unsubscribe failed", extra={"channel": name, "error": repr(exc)})

    async def _run(self) -> None:
        delay = RECONNECT_FIRST_S
        while True:
            pubsub = self._client.pubsub()
            try:
                async with self._send_lock:
                    # Every channel wanted now; one subscribed later goes through _send_subscribe.
                    await pubsub.subscribe(self._control, *self._queues)
                    self._pubsub = pubsub
                log.info("progress hub connected", extra={"channels": len(self._queues)})
                delay = RECONNECT_FIRST_S
                await self._read(pubsub)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("progress hub disconnected; reconnecting", extra={"error": repr(exc)})
            finally:
                self._pubsub = None
                self._release_waiters()
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, RECONNECT_MAX_S)

    async def _read(self, pubsub: PubSub) -> None:
        # A silent connection is pinged after events_resync_s; no answer by the next silence means it is dead
        # (a network partition closes nothing), and _run reconnects.
        silence_s = self.settings.events_resync_s
        pinged = False
        while True:
            message = await pubsub.get_message(timeout=silence_s)
            if message is None:
                if pinged:
                    raise ConnectionError(f"no answer from Redis for {2 * silence_s:.0f} s")
                async with self._send_lock:
                    await pubsub.ping()
                pinged = True
                continue
            pinged = False
            self._dispatch(message)

    def _dispatch(self, message: dict[str, Any]) -> None:
        kind, name = message.get("type"), message.get("channel")
        if not isinstance(name, str):
            return
        if kind == "subscribe":
            waiters = self._waiters.get(name)
            if waiters:
                waiter = waiters.popleft()
                if not waiters:
                    del self._waiters[name]
                if not waiter.done():
                    waiter.set_result(None)
            else:  # a subscription nobody waited for: a reconnect's, after messages may have been lost
                self._fan_out(name, Signal.RESYNC)
        elif kind == "message":
            decoded = decode(message.get("data") or "")
            if decoded is None:
                log.warning("malformed progress message dropped", extra={"channel": name})
                return
            self._fan_out(name, decoded)

    def _fan_out(self, name: str, message: Message) -> None:
        for queue in self._queues.get(name, ()):
            _offer(queue, message)

    def _release_waiters(self) -> None:
        """On a lost connection nobody's confirmation will come: let the waiters go (their streams read Postgres
        and get RESYNC once the channel is subscribed again)."""
        for waiters in self._waiters.values():
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)
        self._waiters.clear()


def _offer(queue: asyncio.Queue[Message], message: Message) -> None:
    try:
        queue.put_nowait(message)
    except asyncio.QueueFull:
        # The stream is far behind: replace the backlog with one signal (it reads Postgres instead); a signal that
        # was to be offered is kept (FINISHED reads Postgres too, CLOSED ends the stream).
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(message if isinstance(message, Signal) else Signal.RESYNC)


async def _stop(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` and wait for its end. redis-py can swallow a cancellation that arrives while it connects
    (the reader then goes on to subscribe and read), so the cancel is repeated until the task is done: a hub closed
    during its first connect (an API stopped, or failing to bind, right after it started) must not hang the
    shutdown."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.5)
    with contextlib.suppress(asyncio.CancelledError):
        task.result()  # a task that failed raises its error here, as an awaited one would
