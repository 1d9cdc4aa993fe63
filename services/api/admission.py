"""Load shedding at the door (docs/architecture.md, invariant 10: load is shed, not absorbed).

At most ``limit`` requests are handled at once per process; the next ones wait up to ``queue_timeout_s`` for a
slot, and then get a fast 503 with ``Retry-After`` in the error envelope. No more wait than the slots can serve
within that time: with ``max_queued`` 0 the bound follows the measured time a request holds its slot (``limit`` ×
``queue_timeout_s`` / that time, at least ``limit``), else it is ``max_queued``. A request that finds the wait queue
full is refused at once, before anything of it is read: under a burst far past capacity the refusals cost the
process almost nothing (no routing, no dependencies, no body parsing, no timer per waiting request), every request
is answered within about ``queue_timeout_s``, and the requests it admits are served at full speed.

The limit is sized with the database pool (a request in progress holds at most one connection), so no request ever
waits for a connection while holding a slot, and a burst cannot wedge the process: when it ends, the queue drains
within ``queue_timeout_s``.
Health checks, metrics, progress streams (long-lived, they hold no connection) and the operator endpoints (no
database; wanted most while the API is shedding load) are not counted.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from services.api.error_handlers import error_body
from services.api.metrics import ERRORS, INFLIGHT, SHED
from shared.infra.config import Settings

# Probes, metrics and operator endpoints are wanted most under load; the console's files are a few static reads (its
# API calls are shed like any other, and the page shows the 503), so a loaded API still serves the page.
_EXEMPT_PREFIXES = ("/healthz", "/readyz", "/metrics", "/v1/admin/", "/console")


class AdmissionLimit:
    def __init__(
        self, app: ASGIApp, *, limit: int, max_queued: int, queue_timeout_s: float, retry_after_s: int
    ) -> None:
        self.app = app
        self.limit = limit
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.retry_after_s = retry_after_s
        self._slots: asyncio.Semaphore | None = None  # made on first use, inside the server's event loop
        self._waiting = 0
        self._held_s = 0.0  # EWMA of the seconds a request holds its slot (0: none measured yet)

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot now."""
        return self._waiting

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _exempt(scope["path"]):
            await self.app(scope, receive, send)
            return
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.limit)
        if self._slots.locked():  # no free slot: wait in the queue, if it has room
            if self._waiting >= self._queue_bound():
                SHED.inc()
                await self._refuse(send, path=scope["path"], waited_s=0.0)
                return
            queued = time.monotonic()
            self._waiting += 1
            try:
                async with asyncio.timeout(self.queue_timeout_s):
                    await self._slots.acquire()
            except TimeoutError:
                SHED.inc()
                await self._refuse(send, path=scope["path"], waited_s=time.monotonic() - queued)
                return
            finally:
                self._waiting -= 1
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

    def _queue_bound(self) -> float:
        """How many may wait: ``max_queued``, or as many as the slots serve within the queue timeout."""
        if self.max_queued:
            return self.max_queued
        if self._held_s <= 0.0:
            return float("inf")  # nothing measured yet: the timeout alone bounds the wait
        return max(self.limit, self.limit * self.queue_timeout_s / self._held_s)

    async def _refuse(self, send: Send, *, path: str, waited_s: float) -> None:
        ERRORS.labels("overloaded", "503").inc()
        _, body = error_body(  # vidq's envelope, or OpenAI's shape under /v1/videos
            path,
            503,
            "overloaded",
            "the API is at capacity; retry after the given seconds",
            {"in_flight": self.limit, "waited_s": round(waited_s, 3)},
        )
        headers: list[tuple[bytes, bytes]] = [
            (b"content-type", b"application/json"),
            (b"retry-after", str(self.retry_after_s).encode()),
        ]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})


def _exempt(path: str) -> bool:
    return path.startswith(_EXEMPT_PREFIXES) or path.endswith("/events")


def admission_kwargs(settings: Settings) -> dict[str, Any]:
    limit = settings.api_max_inflight or settings.db_pool_size
    return {
        "limit": limit,
        "max_queued": settings.api_max_queued,
        "queue_timeout_s": settings.api_queue_timeout_s,
        "retry_after_s": settings.api_retry_after_s,
    }
