"""GET /v1/admin/cache/stats with the app in this process (only app.state.settings is needed, no API process):
Redis failures are the API's 503 envelope, and the synchronous Redis call never blocks the event loop. Marked
integration through ``settings`` (the last test reads the session's real Redis). The endpoint served by a real API
process: tests/integration/test_admin_cache.py."""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import httpx
import pytest
import redis

from services.api.admin import routes as admin
from services.api.app import create_app
from shared.infra.config import Settings
from tools.processes import free_ports

TOKEN = f"operator-{os.urandom(12).hex()}"
PATH = "/v1/admin/cache/stats"
# How long a test thread waits on an event the test itself sets: only reached when the code under test is broken.
FALLBACK_S = 30.0


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def in_process(settings: Settings, **update: Any) -> httpx.AsyncClient:
    configured = settings.model_copy(update={"admin_token": TOKEN, **update})
    app = create_app(configured)
    app.state.settings = configured  # what the lifespan sets; these routes use nothing else
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://vidq", headers=bearer(TOKEN))


def test_an_unreachable_redis_is_the_503_envelope(settings: Settings) -> None:
    async def run() -> httpx.Response:
        async with in_process(settings, broker_url=f"redis://127.0.0.1:{free_ports(1)[0]}/0") as http:
            return await http.get(PATH)

    r = asyncio.run(run())
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "unavailable" and r.headers["retry-after"] == str(settings.api_retry_after_s)


def test_any_other_redis_error_is_the_503_envelope_too(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: Any, **__: Any) -> dict[str, Any]:
        raise redis.ResponseError("OOM command not allowed when used memory > 'maxmemory'")

    monkeypatch.setattr(admin, "stats_for", refuse)

    async def run() -> httpx.Response:
        async with in_process(settings) as http:
            return await http.get(PATH)

    r = asyncio.run(run())
    assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable", r.text


def test_the_redis_call_runs_off_the_event_loop(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """While one stats request waits on a slow Redis, the same process answers other requests: /healthz answers
    while the stats call is still blocked (order, not time), and the stats call answers once Redis does."""
    real = admin.stats_for
    entered, release = threading.Event(), threading.Event()
    released: list[bool] = []  # per call: whether the test released it (False: the fallback ended the wait)

    def slow(*args: Any, **kwargs: Any) -> dict[str, Any]:
        entered.set()
        # Blocking, like a Redis round trip that takes long. Run on the event loop (the bug), it would hold the
        # loop until the fallback, and /healthz could only answer after it.
        released.append(release.wait(FALLBACK_S))
        return real(*args, **kwargs)

    monkeypatch.setattr(admin, "stats_for", slow)

    async def run() -> tuple[int, bool, int]:
        async with in_process(settings) as http:
            stats = asyncio.create_task(http.get(PATH))
            try:
                # A hang guard, longer than the fallback so that a blocked loop fails on the assertions below.
                async with asyncio.timeout(2 * FALLBACK_S):
                    while not entered.is_set():
                        await asyncio.sleep(0.01)
                health = await http.get("/healthz")
                stats_pending = not stats.done()
            finally:
                release.set()
            response = await stats
            return health.status_code, stats_pending, response.status_code

    health_status, stats_pending, stats_status = asyncio.run(run())
    assert health_status == 200
    assert stats_pending, "/healthz answered only after the stats call: the Redis call blocked the event loop"
    assert released == [True], "the stats call outwaited its fallback: /healthz could not answer meanwhile"
    assert stats_status == 200
