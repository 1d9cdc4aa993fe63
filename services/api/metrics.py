"""API metrics (Prometheus)."""

from __future__ import annotations

import time

from prometheus_client import Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_SECONDS = Histogram("vidq_api_request_seconds", "API request latency", ["method", "route", "status"])
SUBMITS = Counter("vidq_api_submits_total", "Jobs accepted, by priority class", ["priority_class"])
RESULT_CACHE_HITS = Counter(
    "vidq_api_result_cache_hits_total", "Jobs accepted and finished at once with a stored result (no render)"
)
ERRORS = Counter("vidq_api_errors_total", "Error responses, by stable code and HTTP status", ["code", "status"])
INFLIGHT = Gauge("vidq_api_inflight_requests", "Requests being handled (admitted)", multiprocess_mode="livesum")
SLOT_WAIT_SECONDS = Histogram(
    "vidq_api_slot_wait_seconds",
    "How long a request waited at the door for a slot (only those that waited; the refused ones too)",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
REFUSED_AT_DOOR = Counter(
    "vidq_api_refused_at_door_total", "Requests the door answered itself (not in the latency histogram)", ["code"]
)
SHED = Counter("vidq_api_shed_total", "Requests refused with 503 because the process was at capacity")


class RequestTiming:
    """Observes every request's latency by method, route template and status (a plain ASGI wrapper: Starlette's
    BaseHTTPMiddleware would add a task group per request)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")  # the router writes the matched route here
            REQUEST_SECONDS.labels(scope["method"], route, str(status)).observe(time.perf_counter() - start)
