"""The API's door on its own (no services): past the limit, requests wait for a slot, then get the 503; while every
priority class is full, a known caller's new submit gets the 429 without reaching the app."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter

import httpx
import pytest
from starlette.datastructures import State
from starlette.types import Receive, Scope, Send

from services.api.admission import Door
from services.api.deps import Caller, KeyCache
from shared.queues import PriorityClass
from shared.scheduling.watermark import FleetFull
from shared.tenants import hash_key

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
    app = Door(gate, limit=3, max_queued=max_queued, queue_timeout_s=0.2, retry_after_s=2)
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
        app = Door(gate, limit=2, max_queued=3, queue_timeout_s=60.0, retry_after_s=1)
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
        app = Door(gate, limit=2, max_queued=8, queue_timeout_s=0.2, retry_after_s=1)
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


# The watermark's 429 at the door: while every class is full, a known caller's new submit is refused before the app.

KEY = "vq_test_key"
FULL = FleetFull(classes=tuple((k, 9, 8) for k in PriorityClass), retry_after_s=7)


class _Watermark:
    def __init__(self, full: FleetFull | None) -> None:
        self.full = full

    def fleet_full(self) -> FleetFull | None:
        return self.full


async def _submit(
    full: FleetFull | None, *, path: str = "/v1/jobs", method: str = "POST", headers: dict[str, str] | None = None
) -> tuple[httpx.Response, _Gate]:
    gate = _Gate()
    gate.opened.set()
    keys = KeyCache(ttl_s=60)
    keys.put(hash_key(KEY), Caller(id=uuid.uuid4(), name="t"))
    state = State({"watermark": _Watermark(full), "key_cache": keys})
    app = Door(gate, limit=2, max_queued=8, queue_timeout_s=0.2, retry_after_s=1, state=state)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        sent = {"Authorization": f"Bearer {KEY}", **(headers or {})}
        # Not even JSON: a refusal at the door reads no body (past the door it would be a 422).
        response = await http.request(method, path, content=b"{not json", headers=sent)
    return response, gate


def test_while_every_class_is_full_a_submit_is_refused_at_the_door() -> None:
    response, gate = asyncio.run(_submit(FULL))
    assert response.status_code == 429 and response.headers["retry-after"] == "7"
    assert gate.most_inside == 0  # the app never saw it
    error = response.json()["error"]
    assert error["code"] == "queue_full"
    assert error["details"] == {"classes": {k.value: {"backlog": 9, "watermark": 8} for k in PriorityClass}}


def test_on_the_videos_api_the_door_refuses_in_openais_shape() -> None:
    response, _ = asyncio.run(_submit(FULL, path="/v1/videos"))
    assert response.status_code == 429 and response.headers["retry-after"] == "7"
    error = response.json()["error"]
    assert error["code"] == "queue_full" and error["type"] == "rate_limit_error"


@pytest.mark.parametrize(
    ("full", "method", "path", "headers"),
    [
        (None, "POST", "/v1/jobs", {}),  # some class has room: the job's own class decides, inside
        (FULL, "GET", "/v1/jobs", {}),  # not a submit
        (FULL, "POST", "/v1/jobs/abc/cancel", {}),  # not a submit
        (FULL, "POST", "/v1/jobs", {"Idempotency-Key": "k1"}),  # may be a replay: never refused
        (FULL, "POST", "/v1/jobs", {"Authorization": "Bearer someone-else"}),  # unknown key: its 401 is inside
        (FULL, "POST", "/v1/jobs", {"Authorization": ""}),  # no key: the same
    ],
)
def test_the_door_lets_through_what_it_cannot_refuse_for_sure(full, method, path, headers) -> None:
    response, gate = asyncio.run(_submit(full, method=method, path=path, headers=headers))
    assert response.status_code == 200 and gate.most_inside == 1
