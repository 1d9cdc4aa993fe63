"""The Celery application as every process sees it. The API and the sweeper use it only to ``send_task`` by name
(they never import a task module, so never torch); the video worker (services/worker/app.py) and the webhook
worker (services/webhooks/app.py) register their tasks on it. The app carries the process's settings, so a task
reads ``self.app.settings`` instead of building its own.

Priority: kombu's Redis transport issues one ``BRPOP video.high video.medium video.low …`` per fetch. With
``queue_order_strategy="priority"`` the key order is fixed (Celery's default, round-robin, rotates it after each
message, which is fair, not priority), so Redis pops from the first non-empty queue. Low is kept from starving
by aging in the sweeper, not by the broker (see services/sweeper/sweeper.py).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar, cast

from celery import Celery
from kombu import Exchange
from kombu import Queue as KQueue

from shared.infra.config import Settings
from shared.infra.storage import Storage
from shared.messaging.progress import ProgressPublisher
from shared.queues import TASK_DELIVER_WEBHOOK, TASK_GENERATE, Queue

T = TypeVar("T")
_apps: weakref.WeakSet[VidqCelery] = weakref.WeakSet()


class VidqCelery(Celery):  # type: ignore[misc]  # celery ships no types
    """A Celery app that carries the settings it was built from, and the per-process resources built from them."""

    def __init__(self, settings: Settings) -> None:
        super().__init__("vidq", broker=str(settings.broker_url), set_as_current=True)
        self.settings = settings
        self._resources: dict[str, Any] = {}
        self._resources_lock = threading.Lock()
        _apps.add(self)

    def resource(self, name: str, factory: Callable[[], T]) -> T:
        """This process's ``name`` (a client, a background thread…), built on first use. A forked child (a Celery
        pool process) starts with none: sockets and threads do not survive a fork."""
        with self._resources_lock:
            if name not in self._resources:
                self._resources[name] = factory()
            return cast(T, self._resources[name])

    @property
    def storage(self) -> Storage:
        """The process's S3 client."""
        return self.resource("storage", lambda: Storage(self.settings))

    @property
    def progress(self) -> ProgressPublisher:
        """The process's progress publisher (Redis pub/sub)."""
        return self.resource("progress", lambda: ProgressPublisher(self.settings))


def _forget_resources_in_child() -> None:
    for app in list(_apps):
        app._resources = {}
        app._resources_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_resources_in_child)


def make_celery(settings: Settings) -> VidqCelery:
    app = VidqCelery(settings)
    app.conf.update(
        task_queues=[KQueue(q.value, Exchange(q.value, type="direct"), routing_key=q.value) for q in Queue],
        task_default_queue=Queue.MEDIUM.value,
        task_routes={
            TASK_DELIVER_WEBHOOK: {"queue": Queue.WEBHOOKS.value},
            TASK_GENERATE: {"queue": Queue.MEDIUM.value},
        },
        # Long GPU tasks: ack after the work, one message at a time, Postgres holds the result.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        task_soft_time_limit=settings.task_soft_time_limit_s,
        task_time_limit=settings.task_time_limit_s,
        worker_cancel_long_running_tasks_on_connection_loss=True,
        broker_connection_retry_on_startup=True,
        broker_connection_timeout=settings.redis_socket_timeout_s,
        broker_transport_options={
            "queue_order_strategy": "priority",
            # Must exceed the longest task, or Redis redelivers a message whose task is still running.
            "visibility_timeout": settings.visibility_timeout_s,
            "socket_timeout": settings.redis_socket_timeout_s,
            "socket_connect_timeout": settings.redis_socket_timeout_s,
            # kombu prefixes every key it touches: the BRPOP queue keys, unacked/unacked_index/unacked_mutex,
            # the binding sets and pub/sub channels ("" = no prefix).
            "global_keyprefix": settings.broker_key_prefix,
        },
        # Flower needs events. Workers send them (received, started, succeeded…); the API does not send a
        # "sent" event per submit, which would cost a second broker round trip on the hot path.
        worker_send_task_events=True,
        task_send_sent_event=False,
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
    )
    return app


class WorkerApp:
    """The one Celery app a worker process runs, built from settings at start-up (never at import), for the code
    that Celery calls without an app in hand (its signal handlers)."""

    def __init__(self, include: list[str]) -> None:
        self._include = include
        self._app: VidqCelery | None = None

    def build(self, settings: Settings) -> VidqCelery:
        self._app = make_celery(settings)
        self._app.conf.include = self._include
        return self._app

    @property
    def settings(self) -> Settings:
        if self._app is None:
            raise RuntimeError("this worker's Celery app is not built yet (build(settings) at start-up)")
        return self._app.settings
