"""The webhook schedule on real services: a receiver down for a while gets every event once it is back, a worker
crash between attempts loses nothing (the next attempt's time is in Postgres and the sweeper hands it over), 410
stops the retries, and a tenant lists its failed deliveries and asks for a redelivery.

Retries happen only when the sweeper hands them over, and the tests drive the sweeper themselves: with the
session's compressed schedule (VIDQ_WEBHOOK_SCHEDULE_S=[0.2,0.5,1], tests/conftest.py) every retry is due within
a second or two, and whether one happens before or after the receiver comes back is the test's choice, not a race.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from shared.infra.db import session_scope
from shared.tenants import issue_key
from tests.integration.helpers import free_port, submit, sweeper
from tools.processes import wait_until


class SwitchableReceiver:
    """A receiver on a fixed port: ``refuse`` (nothing listens: connection refused), or answers ``status``."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/hook"
        self.status = 204
        self.requests: list[dict[str, Any]] = []
        self._server: ThreadingHTTPServer | None = None

    def up(self, status: int = 204) -> None:
        self.status = status
        if self._server is not None:
            return
        received, receiver = self.requests, self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                received.append({"headers": dict(self.headers.items()), "body": body, "status": receiver.status})
                self.send_response(receiver.status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def refuse(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def delivered_ids(self) -> list[str]:
        return [r["headers"]["webhook-id"] for r in self.requests if 200 <= r["status"] < 300]


@pytest.fixture
def hook() -> Iterator[SwitchableReceiver]:
    r = SwitchableReceiver()
    yield r
    r.refuse()


def log(client: httpx.Client, job_id: str) -> list[dict[str, Any]]:
    r = client.get(f"/v1/jobs/{job_id}/webhooks")
    assert r.status_code == 200, r.text
    rows: list[dict[str, Any]] = r.json()
    return rows


def wait_attempts(client: httpx.Client, job_id: str, count: int, *, sweep: Any = None, timeout_s: float = 30) -> Any:
    """The job's delivery log once it holds ``count`` attempts, sweeping meanwhile when given a sweeper."""
    deadline = time.monotonic() + timeout_s
    rows: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        rows = log(client, job_id)
        if len(rows) >= count:
            return rows
        if sweep is not None:
            sweep.sweep_once()
        time.sleep(0.1)
    raise AssertionError(f"expected {count} attempts, got {rows}")


def finished_job(client: httpx.Client, url: str | None) -> dict[str, Any]:
    """A finished job without rendering anything: cancelled while queued (its event is job.cancelled)."""
    job = submit(client, webhook_url=url) if url else submit(client)
    client.post(f"/v1/jobs/{job['id']}/cancel").raise_for_status()
    return job


def test_receiver_down_then_up_gets_every_event_once(client, start_worker, hook, settings):
    start_worker("webhooks")
    sw = sweeper(settings)
    hook.refuse()  # down: connection refused
    jobs = [finished_job(client, hook.url) for _ in range(3)]
    for job in jobs:  # attempt 1 (immediate) refused, then attempt 2 (the sweeper's) answered 503
        wait_attempts(client, job["id"], 1)
    hook.up(503)
    while any(len(log(client, job["id"])) < 2 for job in jobs):  # every job's retry answered 503 at least once
        sw.sweep_once()
        time.sleep(0.1)
    hook.up(204)
    for job in jobs:
        rows = wait_attempts(client, job["id"], 3, sweep=sw)
        while not rows[-1]["ok"]:
            rows = wait_attempts(client, job["id"], len(rows) + 1, sweep=sw)
        # Refused, 503 (once, or twice when the other jobs' retries took a while), then delivered; never more.
        assert (rows[0]["ok"], rows[0]["error"]) == (False, "connect_error")
        assert [(r["ok"], r["status_code"]) for r in rows[1:-1]] in ([(False, 503)], [(False, 503)] * 2)
        assert (rows[-1]["ok"], rows[-1]["status_code"], rows[-1]["next_attempt_at"]) == (True, 204, None)
        assert [r["attempt"] for r in rows] == list(range(1, len(rows) + 1))
        # Each failed attempt says when the next was planned; every attempt carries the same message id.
        assert all(r["next_attempt_at"] is not None for r in rows[:-1])
        assert {r["msg_id"] for r in rows} == {rows[0]["msg_id"]}
    for _ in range(5):  # nothing is due any more: more sweeps deliver nothing twice
        assert sw.sweep_once().webhook_retries == []
        time.sleep(0.1)
    delivered = hook.delivered_ids()
    assert sorted(delivered) == sorted({r["msg_id"] for job in jobs for r in log(client, job["id"])})


def test_worker_crash_between_attempts_loses_nothing(client, start_worker, procs, hook, settings):
    worker = start_worker("webhooks")
    hook.up(503)
    job = finished_job(client, hook.url)
    (first,) = wait_attempts(client, job["id"], 1)
    assert first["next_attempt_at"] is not None  # the retry's time is in Postgres, not in a broker countdown
    procs.kill(worker)  # a crash: nothing of the worker's survives
    hook.up(204)
    # Once the retry is due (the first delay of the schedule), a sweep hands it to the webhook queue: no worker
    # is there to make it.
    sw, handed = sweeper(settings), list[uuid.UUID]()
    wait_until(lambda: bool(handed.extend(sw.sweep_once().webhook_retries) or handed), timeout_s=30, what="a sweep")
    assert handed == [uuid.UUID(job["id"])]
    start_worker("webhooks")
    rows = wait_attempts(client, job["id"], 2)
    assert [(r["attempt"], r["ok"]) for r in rows] == [(1, False), (2, True)]
    assert hook.delivered_ids() == [first["msg_id"]]


def test_gone_stops_retries_and_failed_deliveries_are_listed(client, start_worker, hook, settings, api_url):
    start_worker("webhooks")
    sw = sweeper(settings)
    hook.up(410)
    gone = [finished_job(client, hook.url) for _ in range(2)]
    for job in gone:
        (attempt,) = wait_attempts(client, job["id"], 1)
        assert (attempt["status_code"], attempt["next_attempt_at"]) == (410, None)
    hook.up(503)
    retrying = finished_job(client, hook.url)
    wait_attempts(client, retrying["id"], 2, sweep=sw)  # its retries go on while the gone ones stay put
    for _ in range(5):
        sw.sweep_once()
    assert [len(log(client, job["id"])) for job in gone] == [1, 1]

    def listed(state: str, **params: Any) -> dict[str, Any]:
        r = client.get("/v1/webhooks/deliveries", params={"state": state, **params})
        assert r.status_code == 200, r.text
        page: dict[str, Any] = r.json()
        return page

    first = listed("failed", limit=1)
    assert first["next_cursor"] is not None
    second = listed("failed", limit=1, cursor=first["next_cursor"])
    assert second["next_cursor"] is None
    assert [d["job_id"] for d in first["data"] + second["data"]] == [gone[1]["id"], gone[0]["id"]]  # newest first
    (planned,) = listed("retrying")["data"]
    assert planned["job_id"] == retrying["id"] and planned["next_attempt_at"] is not None
    bad = client.get("/v1/webhooks/deliveries", params={"cursor": "x"})
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_request"
    # Another tenant sees none of them.
    with session_scope(settings) as session:
        other = issue_key(session, tenant_name=f"other-{time.monotonic_ns()}")
    with httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {other.api_key}"}) as stranger:
        assert stranger.get("/v1/webhooks/deliveries").json() == {"data": [], "next_cursor": None}


def test_redeliver_makes_one_fresh_attempt_with_the_same_id(client, start_worker, hook, settings, api_url):
    start_worker("webhooks")
    hook.up(410)
    job = finished_job(client, hook.url)
    (first,) = wait_attempts(client, job["id"], 1)
    hook.up(204)
    r = client.post(f"/v1/jobs/{job['id']}/webhooks/redeliver")
    assert r.status_code == 202, r.text
    assert r.json() == {"job_id": job["id"], "event_type": "job.cancelled", "msg_id": first["msg_id"]}
    rows = wait_attempts(client, job["id"], 2)
    assert [(x["attempt"], x["ok"], x["msg_id"]) for x in rows] == [
        (1, False, first["msg_id"]),
        (2, True, first["msg_id"]),
    ]
    assert hook.delivered_ids() == [first["msg_id"]]

    # Another tenant's job is not found; a job not finished, or without a webhook URL, is a conflict.
    with session_scope(settings) as session:
        other = issue_key(session, tenant_name=f"other-{time.monotonic_ns()}")
    with httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {other.api_key}"}) as stranger:
        r = stranger.post(f"/v1/jobs/{job['id']}/webhooks/redeliver")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    queued = submit(client, webhook_url=hook.url)  # no video worker: it stays queued
    assert client.post(f"/v1/jobs/{queued['id']}/webhooks/redeliver").status_code == 409
    no_url = finished_job(client, None)
    r = client.post(f"/v1/jobs/{no_url['id']}/webhooks/redeliver")
    assert r.status_code == 409 and r.json()["error"]["code"] == "conflict"
