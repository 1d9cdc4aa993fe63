"""Task messages onto the Redis broker in batches: many messages, one round trip.

``celery.send_task`` costs ~0.9 ms of CPU per message on a 2-core machine (producer pool, routing, kombu's
publish path) and one Redis round trip each; under a burst of submits that was the largest single cost of the API
(benchmarks/results/api_load_*.md). Here the message is built by Celery itself (``app.amqp.as_task_v2``: task
protocol 2, the headers and body every Celery worker reads) and wrapped exactly as kombu's Redis transport wraps it
(JSON envelope, base64 body, ``delivery_info`` of the default exchange, ``delivery_tag``), then LPUSHed to the
queue's list (with ``broker_key_prefix``) in one transaction, which also ends each job's admission reservation
(shared/scheduling/watermark.py). This module owns the wire format both ways: ``decode`` and
``job_id_of`` read what is on a queue (the prewarmer and workers look ahead at queued jobs without taking them).
tests/shared/test_broker.py checks both against messages kombu writes; every integration test's worker consumes
these messages.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from celery.utils.nodenames import anon_nodename

from shared.infra.redis_clients import broker_client
from shared.infra.tracing import publishing
from shared.messaging.celery_app import VidqCelery
from shared.scheduling.watermark import take_reservation


@dataclass(frozen=True, slots=True)
class TaskMessage:
    task: str
    job_id: uuid.UUID
    queue: str
    traceparent: str | None = None  # the job's stored trace context (shared/infra/tracing.py)


def envelope(
    celery: VidqCelery, message: TaskMessage, *, origin: str, trace_headers: Mapping[str, str] | None = None
) -> str:
    """The JSON string kombu's Redis transport would LPUSH for ``send_task(task, args=[job_id], queue=queue)``;
    ``trace_headers`` (W3C trace context) join the message headers, where Celery's tracing reads them."""
    task_id = str(uuid.uuid4())
    args = [str(message.job_id)]
    task = celery.amqp.as_task_v2(task_id, message.task, args=args, kwargs={}, argsrepr=repr(args), origin=origin)
    body = json.dumps(task.body).encode()
    return json.dumps(
        {
            "body": base64.b64encode(body).decode("ascii"),
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": {**task.headers, **(trace_headers or {})},
            "properties": {
                **task.properties,
                "delivery_mode": 2,  # persistent
                "delivery_info": {"exchange": "", "routing_key": message.queue},
                "priority": 0,
                "body_encoding": "base64",
                "delivery_tag": str(uuid.uuid4()),
            },
        }
    )


class Publisher:
    """One Redis client per process (thread-safe pool), with the settings' socket timeouts."""

    def __init__(self, celery: VidqCelery) -> None:
        settings = celery.settings
        self.celery = celery
        self.prefix = settings.broker_key_prefix
        self.origin = anon_nodename()
        self.client = broker_client(settings)

    def publish(self, messages: Sequence[TaskMessage]) -> None:
        """All of ``messages`` in one round trip. Raises redis errors: the caller decides (the sweeper resends)."""
        # One transaction: a job's message and the end of its admission reservation are seen together.
        pipe = self.client.pipeline(transaction=True)
        with publishing(messages) as trace_headers:
            for message, headers in zip(messages, trace_headers, strict=True):
                body = envelope(self.celery, message, origin=self.origin, trace_headers=headers)
                pipe.lpush(f"{self.prefix}{message.queue}", body)
                take_reservation(pipe, self.prefix, queue=message.queue, job_id=message.job_id)
            pipe.execute()


def publisher(celery: VidqCelery) -> Publisher:
    return celery.resource("publisher", lambda: Publisher(celery))


def decode(raw: bytes | str) -> dict[str, Any]:
    """A stored message (``envelope``'s, or one kombu wrote) with its body decoded."""
    message: dict[str, Any] = json.loads(raw)
    message["body"] = json.loads(base64.b64decode(message["body"]))
    return message


def job_id_of(raw: bytes | str) -> uuid.UUID | None:
    """The job id a stored task message carries (its body's first argument); None for anything else on the list."""
    try:
        return uuid.UUID(str(decode(raw)["body"][0][0]))
    except (ValueError, KeyError, IndexError, TypeError):  # binascii and JSON errors are ValueErrors
        return None
