"""Job progress over Redis pub/sub: workers publish, the API's progress streams (SSE) listen
(services/api/jobs/progress_hub.py).

Postgres stays the source of truth (docs/architecture.md, invariant 1). A message is a hint: a step went by (shown as
it is) or the job left ``running`` (the stream reads Postgres for the final state). A lost message costs latency,
never the answer: a stream that hears nothing for ``events_resync_s`` reads Postgres anyway.

- Channel: ``{broker_key_prefix}vidq:progress:{job_id}``; the prefix keeps stacks (and test sessions) that share one
  Redis apart.
- Messages (JSON): ``{"status", "step", "total", "attempt"}`` for a step, ``{"finished": true, "status"}`` once a
  transition took the job out of ``running`` (succeeded, failed, cancelled, or back to queued for a retry).
- ``ProgressPublisher``: sync, one per process (workers, and the API's cancel); it never raises into its caller.
"""

from __future__ import annotations

import enum
import json
import logging
import time
import uuid
from dataclasses import dataclass

import redis

from shared.infra.config import Settings
from shared.infra.redis_clients import broker_client

log = logging.getLogger("vidq.progress")


def channel(settings: Settings, job_id: uuid.UUID | str) -> str:
    return f"{settings.broker_key_prefix}vidq:progress:{job_id}"


@dataclass(frozen=True, slots=True)
class ProgressUpdate:
    """One denoising step of a running attempt (or step 0, right after the claim)."""

    status: str
    step: int
    total: int
    attempt: int


class Signal(enum.Enum):
    FINISHED = "finished"  # the job left running: read Postgres for its state
    RESYNC = "resync"  # messages may have been lost (a reconnect, a full queue): read Postgres
    CLOSED = "closed"  # the hub is shutting down: end the stream (the client reconnects)


Message = ProgressUpdate | Signal


def encode_progress(*, status: str, step: int, total: int, attempt: int) -> str:
    return json.dumps({"status": status, "step": step, "total": total, "attempt": attempt})


def encode_finished(*, status: str) -> str:
    return json.dumps({"finished": True, "status": status})


def decode(data: str | bytes) -> Message | None:
    """The message, or None for anything malformed (logged by the caller)."""
    try:
        body = json.loads(data)
        if body.get("finished") is True:
            return Signal.FINISHED
        return ProgressUpdate(
            status=str(body["status"]), step=int(body["step"]), total=int(body["total"]), attempt=int(body["attempt"])
        )
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


class ProgressPublisher:
    """Publishes a job's progress. Best effort by design: a stream that misses a message reads Postgres later, so
    a Redis outage must never fail or stall a render. After a failure it stays quiet for one socket timeout, so an
    unreachable Redis costs a render one timeout per ``redis_socket_timeout_s``, not one per step."""

    def __init__(self, settings: Settings, *, client: redis.Redis | None = None) -> None:
        self.settings = settings
        # One retry covers a connection Redis closed while idle; more would multiply the cost of an outage.
        self._client = client or broker_client(settings, retries=1)
        self._quiet_until = 0.0

    def progress(self, job_id: uuid.UUID, *, status: str, step: int, total: int, attempt: int) -> None:
        self._publish(job_id, encode_progress(status=status, step=step, total=total, attempt=attempt))

    def finished(self, job_id: uuid.UUID, *, status: str) -> None:
        self._publish(job_id, encode_finished(status=status))

    def close(self) -> None:
        self._client.close()

    def _publish(self, job_id: uuid.UUID, payload: str) -> None:
        if time.monotonic() < self._quiet_until:
            return
        try:
            self._client.publish(channel(self.settings, job_id), payload)
        except Exception as exc:  # never into the render or the request: the streams' resync covers the loss
            self._quiet_until = time.monotonic() + self.settings.redis_socket_timeout_s
            log.warning("progress not published", extra={"job_id": str(job_id), "error": repr(exc)})
