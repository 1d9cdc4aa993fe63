"""Progress streams (``GET /v1/jobs/{id}/events``) on real processes: fed by Redis pub/sub through one hub per API
process, holding no database connection while open, and always ending with the final ``job`` event.

Most tests run against an API whose safety-net re-read (VIDQ_EVENTS_RESYNC_S) is an hour away, so only the
worker's and the API's pub/sub messages can move their streams; the safety net has a test and an API of its own.
The ``asyncio.timeout`` guards are hang guards for events expected within a second, not timing assertions.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import psycopg
import pytest
from httpx_sse import connect_sse

from shared.infra.db import get_engine, session_scope
from shared.jobs.states import fail
from shared.tenants import issue_key
from tests.integration.helpers import TINY, free_port, submit
from tools.processes import ManagedProcess, ProcessGroup, vidq_argv, wait_http

STREAMS = 200
STREAMS_PER_JOB = 5  # several streams of one job share one subscription in the hub
HANG_GUARD_S = 60.0


def _start_api(procs: ProcessGroup, name: str, *, resync_s: float) -> str:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**procs.env, "VIDQ_PUBLIC_BASE_URL": url, "VIDQ_EVENTS_RESYNC_S": str(resync_s)}
    env["PGAPPNAME"] = _application_name(url)  # libpq names its connections: Postgres tells them from others
    argv = vidq_argv("api", "--no-migrate", "--port", str(port))
    procs.procs[name] = ManagedProcess(argv, log_path=procs.log_path(name), name=name, env=env, spawn=procs.spawn)
    wait_http(f"{url}/readyz", timeout_s=60, group=procs)
    return url


@pytest.fixture(scope="module")
def pubsub_api(procs: ProcessGroup) -> Iterator[str]:
    """An API whose streams move only on pub/sub messages (the safety-net re-read is an hour away)."""
    name = f"api-pubsub-{os.urandom(2).hex()}"
    yield _start_api(procs, name, resync_s=3600)
    procs.stop(name, timeout_s=15)


@pytest.fixture
def resync_api(procs: ProcessGroup) -> Iterator[str]:
    """An API that re-reads a silent stream's job every half second."""
    name = f"api-resync-{os.urandom(2).hex()}"
    yield _start_api(procs, name, resync_s=0.5)
    procs.stop(name, timeout_s=15)


def _auth(tenant_key: dict[str, str]) -> dict[str, str]:
    return {"Authorization": f"Bearer {tenant_key['api_key']}"}


@pytest.fixture
def stream_client(pubsub_api: str, tenant_key: dict[str, str]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=pubsub_api, headers=_auth(tenant_key), timeout=30) as c:
        yield c


def _application_name(api_url: str) -> str:
    return f"vidq-test-api-{api_url.rsplit(':', 1)[1]}"


def _pg_connections(settings: Any, api_url: str) -> tuple[int, int]:
    """(connections, of which idle in a transaction) of the API at ``api_url`` to this session's database: only its
    own, as the session's other processes (workers, sweepers, the tests) share the database."""
    with psycopg.connect(str(settings.database_url).replace("+psycopg", ""), connect_timeout=5) as conn:
        row = conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE state = 'idle in transaction') FROM pg_stat_activity"
            " WHERE datname = current_database() AND application_name = %s",
            (_application_name(api_url),),
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


async def _sse(lines: AsyncIterator[str]) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    event = None
    async for line in lines:
        if line.startswith("event: "):
            event = line.removeprefix("event: ")
        elif line.startswith("data: ") and event:
            yield event, json.loads(line.removeprefix("data: "))
            event = None


class _Stream:
    """One open progress stream read with httpx's async client."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.events = _sse(response.aiter_lines())

    @classmethod
    async def open(cls, http: httpx.AsyncClient, job_id: str) -> _Stream:
        response = await http.send(http.build_request("GET", f"/v1/jobs/{job_id}/events"), stream=True)
        return cls(response)

    async def next(self) -> tuple[str, dict[str, Any]]:
        return await anext(self.events)

    async def rest(self) -> list[tuple[str, dict[str, Any]]]:
        return [item async for item in self.events]


def test_a_rendered_job_streams_every_step_then_the_job(stream_client, start_worker, settings):
    job = submit(stream_client, steps=12)
    with connect_sse(
        stream_client, "GET", f"/v1/jobs/{job['id']}/events", timeout=httpx.Timeout(30, read=120)
    ) as source:
        assert source.response.status_code == 200
        assert source.response.headers["content-type"].startswith("text/event-stream")
        sse = source.iter_sse()
        first = next(sse)
        assert (first.event, first.json()["status"], first.json()["step"]) == ("progress", "queued", 0)
        start_worker("video")  # only now: the stream is subscribed before the job is claimed
        events = [(e.event, e.json()) for e in sse]
    kinds = [k for k, _ in events]
    assert kinds[-1] == "job" and kinds.count("job") == 1 and set(kinds[:-1]) == {"progress"}
    final = events[-1][1]
    assert final["status"] == "succeeded" and final["output"]["frames"] == job["num_frames"]
    assert final.keys() == stream_client.get(f"/v1/jobs/{job['id']}").json().keys()  # the job as GET shows it
    running = [d for k, d in events if k == "progress" and d["status"] == "running"]
    # Every step, from the claim's step 0 to the last: pub/sub carries each one (Postgres gets them throttled).
    assert [d["step"] for d in running] == list(range(13)), running
    assert all(d["attempt"] == 1 and d["total"] == 12 for d in running)
    assert running[6]["percent"] == 50.0
    assert events[-2][1] == {"status": "succeeded", "attempt": 1, "step": 12, "total": 12, "percent": 100.0}


def test_a_stream_of_another_tenants_job_is_404(stream_client, pubsub_api, settings):
    job = submit(stream_client)
    with session_scope(settings) as session:
        other = issue_key(session, tenant_name=f"other-{os.urandom(3).hex()}")
    r = httpx.get(f"{pubsub_api}/v1/jobs/{job['id']}/events", headers={"Authorization": f"Bearer {other.api_key}"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert httpx.get(f"{pubsub_api}/v1/jobs/{job['id']}/events").status_code == 401
    assert stream_client.get(f"/v1/jobs/{uuid.uuid4()}/events").status_code == 404


def test_cancelling_a_queued_job_ends_its_stream_with_the_job(stream_client, pubsub_api, tenant_key):
    job = submit(stream_client)

    async def follow() -> list[tuple[str, dict[str, Any]]]:
        async with (
            asyncio.timeout(HANG_GUARD_S),
            httpx.AsyncClient(base_url=pubsub_api, headers=_auth(tenant_key), timeout=30) as http,
        ):
            stream = await _Stream.open(http, job["id"])
            try:
                assert stream.response.status_code == 200
                first = await stream.next()
                assert first == ("progress", {"status": "queued", "attempt": 0, "step": 0, "total": 4, "percent": 0.0})
                r = await http.post(f"/v1/jobs/{job['id']}/cancel")
                assert r.status_code == 202 and r.json()["status"] == "cancelled"
                return await stream.rest()
            finally:
                await stream.response.aclose()

    events = asyncio.run(follow())
    assert [k for k, _ in events] == ["progress", "job"]
    assert events[0][1]["status"] == "cancelled" and events[1][1]["status"] == "cancelled"
    assert events[1][1]["id"] == job["id"] and events[1][1]["cancel_requested"] is True


def test_open_streams_hold_no_database_connection_while_other_requests_answer(pubsub_api, tenant_key, settings):
    """200 open streams on one API process: every one opens with 200, other requests (this tenant's and
    another's) keep answering 2xx, and Postgres sees no connection per stream."""
    with session_scope(settings) as session:
        other = issue_key(session, tenant_name=f"other-{os.urandom(3).hex()}").__dict__
    engine = get_engine(settings)  # built like the API's: its pool is the most the API may hold
    api_pool = engine.pool.size() + engine.pool._max_overflow  # type: ignore[attr-defined]
    report: dict[str, Any] = {}

    async def scenario() -> None:
        limits = httpx.Limits(max_connections=STREAMS + 50, max_keepalive_connections=STREAMS + 50)
        timeout = httpx.Timeout(30, read=120)
        async with (
            httpx.AsyncClient(base_url=pubsub_api, headers=_auth(tenant_key), timeout=timeout, limits=limits) as http,
            httpx.AsyncClient(base_url=pubsub_api, headers=_auth(other), timeout=timeout) as other_http,
        ):
            jobs = []
            for _ in range(STREAMS // STREAMS_PER_JOB):
                r = await http.post("/v1/jobs", json=TINY)
                assert r.status_code == 202, r.text
                jobs.append(r.json()["id"])
            baseline, _ = _pg_connections(settings, pubsub_api)

            # 1. Open every stream at once; each has its first event (so it is subscribed and past its read).
            async def open_one(job_id: str) -> _Stream:
                stream = await _Stream.open(http, job_id)
                if stream.response.status_code == 200:
                    assert (await stream.next())[1]["status"] == "queued"
                return stream

            t0 = time.perf_counter()
            streams = await asyncio.gather(*(open_one(j) for j in jobs for _ in range(STREAMS_PER_JOB)))
            report["open_all_s"] = round(time.perf_counter() - t0, 3)
            try:
                report["stream_statuses"] = sorted({s.response.status_code for s in streams})
                assert [s.response.status_code for s in streams] == [200] * STREAMS
                # Several looks: a stream holding a transaction holds it in every one; the API's own background
                # work (its views' refreshes) may be caught between two statements of a transaction in one.
                looks = []
                for _ in range(5):
                    looks.append(_pg_connections(settings, pubsub_api))
                    await asyncio.sleep(0.05)
                report["pg_idle"] = max(looks)
                report["pg_idle_in_transaction_each_look"] = [idle for _, idle in looks]

                # 2. Other requests while the streams stay open.
                latencies: list[float] = []
                statuses: list[int] = []

                async def timed(call: Any) -> None:
                    start = time.perf_counter()
                    response = await call
                    latencies.append(time.perf_counter() - start)
                    statuses.append(response.status_code)

                for round_ in range(10):
                    await asyncio.gather(
                        timed(http.get("/v1/jobs", params={"limit": 20})),
                        timed(other_http.get("/v1/jobs", params={"limit": 20})),
                        timed(other_http.post("/v1/jobs", json=TINY)),
                        timed(http.get(f"/v1/jobs/{jobs[round_]}")),
                    )
                report["pg_busy"] = _pg_connections(settings, pubsub_api)
                latencies.sort()
                report["other_requests"] = len(latencies)
                report["latency_p50_s"] = round(latencies[len(latencies) // 2], 4)
                report["latency_max_s"] = round(latencies[-1], 4)
                assert all(200 <= s < 300 for s in statuses), statuses

                # 3. The streams are alive: a cancel ends all of that job's streams with the job.
                r = await http.post(f"/v1/jobs/{jobs[0]}/cancel")
                assert r.status_code == 202
                async with asyncio.timeout(HANG_GUARD_S):
                    ended = await asyncio.gather(*(s.rest() for s in streams[:STREAMS_PER_JOB]))
                for events in ended:
                    assert [k for k, _ in events] == ["progress", "job"] and events[-1][1]["status"] == "cancelled"
            finally:
                await asyncio.gather(*(s.response.aclose() for s in streams))
            report["pg_baseline"] = baseline

    asyncio.run(scenario())
    print("open streams report:", report)  # latencies are recorded, never asserted
    # The old stream held a transaction open per stream: 200 streams would need 200 connections, each idle in its
    # transaction in every look. None may be in all of them.
    assert min(report["pg_idle_in_transaction_each_look"]) == 0, report
    assert report["pg_idle"][0] <= api_pool, report  # the API's own connections: at most its pool
    assert report["pg_busy"][0] <= api_pool, report


def test_a_lost_message_is_covered_by_the_resync(resync_api, tenant_key, settings):
    """A change that publishes nothing (as the sweeper's recoveries) still reaches the stream by its re-read."""
    headers = _auth(tenant_key)
    with httpx.Client(base_url=resync_api, headers=headers, timeout=30) as http:
        job = submit(http)

    async def follow() -> list[tuple[str, dict[str, Any]]]:
        async with (
            asyncio.timeout(HANG_GUARD_S),
            httpx.AsyncClient(base_url=resync_api, headers=headers, timeout=30) as http,
        ):
            stream = await _Stream.open(http, job["id"])
            try:
                assert (await stream.next())[1]["status"] == "queued"
                with session_scope(settings) as session:  # behind the API's back: no message
                    assert fail(session, uuid.UUID(job["id"]), token=None, code="lost", message="test") is not None
                return await stream.rest()
            finally:
                await stream.response.aclose()

    events = asyncio.run(follow())
    assert [k for k, _ in events] == ["progress", "job"] and events[-1][1]["error"]["code"] == "lost"
