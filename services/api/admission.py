"""The API's door (docs/architecture.md, invariant 10: load is shed, not absorbed): the outermost layer of the app,
ahead of FastAPI's own middleware, routing, dependencies and body parsing, so that a refusal costs about what the
HTTP server spends on any request and an overloaded process answers fast, with a refusal, never with silence.

It refuses two ways, from the path, the method and a few headers only, in the one error envelope (OpenAI's shape
under /v1/videos):

- **503 ``overloaded``, capacity.** At most ``limit`` requests are handled at once per process; the next ones wait
  up to ``queue_timeout_s`` for a slot, then get the 503 with ``Retry-After``. No more wait than the slots can serve
  within that time: with ``max_queued`` 0 the bound follows the measured time a request holds its slot (``limit`` ×
  ``queue_timeout_s`` / that time, at least ``limit``), else it is ``max_queued``. A request that finds the wait
  queue full is refused at once. The limit is sized with the database pool (a request in progress holds at most one
  connection), so no request waits for a connection while holding a slot, and a burst cannot wedge the process:
  when it ends, the queue drains within ``queue_timeout_s``.
- **429 ``queue_full``, the admission watermark, for a new submit** (``POST /v1/jobs``, ``POST /v1/videos``) while
  every priority class is at its watermark, as the submits of the last scheduling cycle found it
  (services/api/jobs/watermark.py ``Watermark.fleet_full``): the class of a job is known only from its body, so
  while only some classes are full the submit goes in and the watermark check of its own class decides. Only for a
  caller whose API key this process knows (a missing or wrong key gets its 401 inside) and never for a request
  with an ``Idempotency-Key`` (it may be a replay, which is never refused).

Health checks, metrics, progress streams (long-lived, they hold no connection) and the operator endpoints (no
database; wanted most while the API is shedding load) pass through uncounted. A refusal at the door is counted in
``vidq_api_refused_at_door_total`` and ``vidq_api_errors_total`` by code; it is not in the latency histogram, which
times what went in from the moment it had its slot (the wait for one is ``vidq_api_slot_wait_seconds``).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from starlette.datastructures import State
from starlette.types import ASGIApp, Receive, Scope, Send

from services.api.error_handlers import OPENAI_PREFIX, error_body, is_openai_path
from services.api.metrics import ERRORS, INFLIGHT, REFUSED_AT_DOOR, SHED, SLOT_WAIT_SECONDS
from shared.infra.config import Settings
from shared.scheduling.watermark import FleetFull

# Probes, metrics and operator endpoints are wanted most under load; the console's files are a few static reads (its
# API calls are shed like any other, and the page shows the 503), so a loaded API still serves the page.
_EXEMPT_PREFIXES = ("/healthz", "/readyz", "/metrics", "/v1/admin/", "/console")
_SUBMIT_PATHS = frozenset({"/v1/jobs", OPENAI_PREFIX})
_OVERLOADED = "the API is at capacity; retry after the given seconds"
_QUEUE_FULL = "every priority class holds as many waiting jobs as its admission watermark allows; submit again later"

_SHED = (ERRORS.labels("overloaded", "503"), REFUSED_AT_DOOR.labels("overloaded"), SHED)
_FULL = (ERRORS.labels("queue_full", "429"), REFUSED_AT_DOOR.labels("queue_full"))


class Door:
    def __init__(
        self,
        app: ASGIApp,
        *,
        limit: int,
        max_queued: int,
        queue_timeout_s: float,
        retry_after_s: int,
        state: State | None = None,
    ) -> None:
        """``state``: the app's state, where the lifespan puts the watermark and the key cache (absent: no 429 at
        the door)."""
        self.app = app
        self.limit = limit
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.retry_after_s = retry_after_s
        self.state = state
        self._slots: asyncio.Semaphore | None = None  # made on first use, inside the server's event loop
        self._waiting = 0
        self._held_s = 0.0  # EWMA of the seconds a request holds its slot (0: none measured yet)
        self._full: FleetFull | None = None  # the last state of a full fleet refused, and its answers
        self._full_answers: dict[bool, Response] = {}
        self._busy = {
            openai: _response(path, 503, "overloaded", _OVERLOADED, self._busy_details(0.0), retry_after_s)
            for openai, path in ((False, "/v1/jobs"), (True, OPENAI_PREFIX))
        }

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot now."""
        return self._waiting

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _exempt(path := scope["path"]):
            await self.app(scope, receive, send)
            return
        if scope["method"] == "POST" and path in _SUBMIT_PATHS and (full := self._fleet_full(scope)) is not None:
            _count(_FULL)
            if full is not self._full:  # a new state of the fleet: encoded once, refused many times
                self._full, self._full_answers = full, {openai: _queue_full(full, openai) for openai in (False, True)}
            await _send(send, self._full_answers[path == OPENAI_PREFIX])
            return
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.limit)
        if self._slots.locked():  # no free slot: wait in the queue, if it has room
            if self._waiting >= self._queue_bound():
                _count(_SHED)
                await _send(send, self._busy[is_openai_path(path)])
                return
            queued = time.monotonic()
            self._waiting += 1
            try:
                async with asyncio.timeout(self.queue_timeout_s):
                    await self._slots.acquire()
            except TimeoutError:
                _count(_SHED)
                details = self._busy_details(time.monotonic() - queued)
                await _send(send, _response(path, 503, "overloaded", _OVERLOADED, details, self.retry_after_s))
                return
            finally:
                self._waiting -= 1
                SLOT_WAIT_SECONDS.observe(time.monotonic() - queued)
        else:
            await self._slots.acquire()  # a free slot: taken at once
        INFLIGHT.inc()
        started = time.monotonic()
        try:
            await self.app(scope, receive, send)
        finally:
            INFLIGHT.dec()
            self._slots.release()
            held = time.monotonic() - started
            self._held_s = held if self._held_s == 0.0 else 0.9 * self._held_s + 0.1 * held

    def _fleet_full(self, scope: Scope) -> FleetFull | None:
        """What the watermark last found, while every class is full, for a known caller's new submit; else None."""
        watermark = getattr(self.state, "watermark", None)
        if watermark is None or (full := watermark.fleet_full()) is None:
            return None
        authorization = b""
        for name, value in scope["headers"]:
            if name == b"idempotency-key":
                return None
            if name == b"authorization":
                authorization = value
        keys = getattr(self.state, "key_cache", None)
        return full if keys is not None and keys.knows(authorization.decode("latin-1")) else None

    def _queue_bound(self) -> float:
        """How many may wait: ``max_queued``, or as many as the slots serve within the queue timeout."""
        if self.max_queued:
            return self.max_queued
        if self._held_s <= 0.0:
            return float("inf")  # nothing measured yet: the timeout alone bounds the wait
        return max(self.limit, self.limit * self.queue_timeout_s / self._held_s)

    def _busy_details(self, waited_s: float) -> dict[str, Any]:
        return {"in_flight": self.limit, "waited_s": round(waited_s, 3)}


Response = tuple[dict[str, Any], dict[str, Any]]  # the two ASGI messages of a refusal


def _response(path: str, status: int, code: str, message: str, details: Any, retry_after_s: int) -> Response:
    status, body = error_body(path, status, code, message, details)  # vidq's envelope, or OpenAI's shape
    encoded = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(encoded)).encode()),
        (b"retry-after", str(retry_after_s).encode()),
    ]
    return {"type": "http.response.start", "status": status, "headers": headers}, {
        "type": "http.response.body",
        "body": encoded,
    }


def _queue_full(full: FleetFull, openai: bool) -> Response:
    details = {"classes": {klass.value: {"backlog": b, "watermark": w} for klass, b, w in full.classes}}
    path = OPENAI_PREFIX if openai else "/v1/jobs"
    return _response(path, 429, "queue_full", _QUEUE_FULL, details, full.retry_after_s)


def _count(counters: tuple[Any, ...]) -> None:
    for counter in counters:
        counter.inc()


async def _send(send: Send, response: Response) -> None:
    start, body = response
    await send(start)
    await send(body)


def _exempt(path: str) -> bool:
    return path.startswith(_EXEMPT_PREFIXES) or path.endswith("/events")


def door_kwargs(settings: Settings) -> dict[str, Any]:
    limit = settings.api_max_inflight or settings.db_pool_size
    return {
        "limit": limit,
        "max_queued": settings.api_max_queued,
        "queue_timeout_s": settings.api_queue_timeout_s,
        "retry_after_s": settings.api_retry_after_s,
    }
