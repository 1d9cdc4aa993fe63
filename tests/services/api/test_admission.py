"""The admission limit on its own (no services): past the limit, requests wait for a slot, then get the 503."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
from starlette.types import Receive, Scope, Send

from services.api.admission import AdmissionLimit

HANG_GUARD_S = 30.0  # the burst settles within the queue timeout (0.2 s); this only ends a broken test


class _Gate:
    """An ASGI app whose requests stay in flight until the test opens the gate."""

    def __init__(self) -> None:
        self.opened = asyncio.Event()
        self.inside = 0
        self.most_inside = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.inside += 1
        self.most_inside = max(self.most_inside, self.inside)
        if scope["path"] != "/healthz":
            await self.opened.wait()
        self.inside -= 1
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


async def _burst(
    n: int, *, path: str = "/v1/jobs", max_queued: int = 100
) -> tuple[Counter[int], _Gate, list[httpx.Response]]:
    gate = _Gate()
    app = AdmissionLimit(gate, limit=3, max_queued=max_queued, queue_timeout_s=0.2, retry_after_s=2)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        pending = [asyncio.create_task(http.get(path)) for _ in range(n)]
        # The gate opens once every request is either answered or held at the gate: none is still waiting for a
        # slot, so each request queued past the limit has had its whole queue timeout (a condition, not a sleep).
        async with asyncio.timeout(HANG_GUARD_S):
            while sum(task.done() for task in pending) + gate.inside < n:
                await asyncio.sleep(0.01)
        gate.opened.set()
        responses = await asyncio.gather(*pending)
    return Counter(r.status_code for r in responses), gate, responses


def test_at_most_limit_in_flight_and_the_rest_refused_with_retry_after() -> None:
    statuses, gate, responses = asyncio.run(_burst(10))
    assert statuses == Counter({200: 3, 503: 7})
    assert gate.most_inside == 3
    refused = [r for r in responses if r.status_code == 503]
    assert all(r.headers["retry-after"] == "2" for r in refused)
    assert all(r.json()["error"]["code"] == "overloaded" for r in refused)


def test_past_a_full_wait_queue_a_request_is_refused_at_once() -> None:
    async def run() -> tuple[Counter[int], list[float]]:
        gate = _Gate()
        app = AdmissionLimit(gate, limit=2, max_queued=3, queue_timeout_s=60.0, retry_after_s=1)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            held = [asyncio.create_task(http.get("/v1/jobs")) for _ in range(5)]  # 2 in flight, 3 waiting
            async with asyncio.timeout(HANG_GUARD_S):
                while gate.inside < 2 or app.waiting < 3:
                    await asyncio.sleep(0.01)
            # The queue is full: these are answered now, though the queue's timeout is a minute.
            refused = await asyncio.gather(*(http.get("/v1/jobs") for _ in range(4)))
            gate.opened.set()
            served = await asyncio.gather(*held)
        return Counter(r.status_code for r in [*refused, *served]), [r.status_code for r in refused]

    statuses, refused = asyncio.run(run())
    assert refused == [503] * 4
    assert statuses == Counter({200: 5, 503: 4})  # the waiting ones were served once slots came back


def test_health_checks_are_never_shed() -> None:
    statuses, _, _ = asyncio.run(_burst(10, path="/healthz"))
    assert statuses == Counter({200: 10})


def test_slots_come_back_after_a_burst() -> None:
    async def run() -> list[int]:
        gate = _Gate()
        gate.opened.set()
        app = AdmissionLimit(gate, limit=2, max_queued=8, queue_timeout_s=0.2, retry_after_s=1)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            return [(await http.get("/v1/jobs")).status_code for _ in range(20)]

    assert asyncio.run(run()) == [200] * 20


def test_operator_endpoints_are_never_shed() -> None:
    """They hold no database connection (the limit is sized with the pool) and are wanted most under load."""
    statuses, _, _ = asyncio.run(_burst(10, path="/v1/admin/cache/stats"))
    assert statuses == Counter({200: 10})


def test_the_console_page_is_never_shed() -> None:
    """Its files hold no database connection; the API calls it makes are shed like any other (previous tests)."""
    statuses, _, _ = asyncio.run(_burst(10, path="/console/console.js"))
    assert statuses == Counter({200: 10})


def test_the_videos_api_is_refused_in_openais_error_shape() -> None:
    statuses, _, responses = asyncio.run(_burst(5, path="/v1/videos"))
    assert statuses == Counter({200: 3, 503: 2})
    refused = [r for r in responses if r.status_code == 503]
    assert all(r.headers["retry-after"] == "2" for r in refused)
    assert [r.json()["error"] for r in refused] == 2 * [
        {
            "message": "the API is at capacity; retry after the given seconds",
            "type": "server_error",
            "param": None,
            "code": "overloaded",
        }
    ]
