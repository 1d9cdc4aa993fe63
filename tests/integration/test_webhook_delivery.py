"""Webhook delivery through the real task: retries on the schedule (handed over by the sweeper), every attempt on
record, failed and cancelled events. The schedule's own cases (outages, a worker crash between attempts, 410,
redelivery) are in test_webhook_schedule.py; the sweeper's housekeeping in tests/services/sweeper/."""

from __future__ import annotations

import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from standardwebhooks.webhooks import Webhook

from shared.infra.db import session_scope
from shared.jobs.states import claim, fail
from tests.integration.helpers import submit, sweeper, wait_job


class FlakyReceiver:
    """Answers 503 to the first ``failures`` requests, then 200."""

    def __init__(self, failures: int) -> None:
        self.requests: list[dict[str, Any]] = []
        state = {"left": failures}
        received = self.requests

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                received.append({"headers": dict(self.headers.items()), "body": body})
                status = 503 if state["left"] > 0 else 200
                state["left"] -= 1
                self.send_response(status)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def flaky():
    r = FlakyReceiver(failures=2)
    yield r
    r.server.shutdown()
    r.server.server_close()


def deliveries(client, job_id: str, count: int, *, sweep=None, timeout_s: float = 30) -> list[dict[str, Any]]:
    """The job's delivery log once it holds ``count`` attempts; retries happen when ``sweep`` hands them over."""
    deadline = time.monotonic() + timeout_s
    rows: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        rows = client.get(f"/v1/jobs/{job_id}/webhooks").json()
        if len(rows) >= count:
            return rows
        if sweep is not None:
            sweep.sweep_once()
        time.sleep(0.2)
    raise AssertionError(f"expected {count} delivery attempts, got {rows}")


def test_retries_until_delivered_with_one_message_id(client, start_worker, flaky, tenant_key, settings):
    start_worker("all")
    job = submit(client, webhook_url=flaky.url)
    wait_job(client, job["id"], {"succeeded"})
    rows = deliveries(client, job["id"], 3, sweep=sweeper(settings))
    assert [(r["attempt"], r["ok"], r["status_code"]) for r in rows] == [
        (1, False, 503),
        (2, False, 503),
        (3, True, 200),
    ]
    assert rows[0]["error"] == "http_5xx"
    # Failed attempts say when the next one was planned (the schedule's 0.2 s, then 0.5 s, ±10%).
    assert [r["next_attempt_at"] is not None for r in rows] == [True, True, False]
    ids = {r["headers"]["webhook-id"] for r in flaky.requests}
    assert ids == {rows[0]["msg_id"]}  # the same id on every retry: receivers dedupe on it
    wh = Webhook(tenant_key["webhook_secret"])
    assert all(wh.verify(r["body"], r["headers"])["type"] == "job.succeeded" for r in flaky.requests)


def test_cancel_and_failure_send_their_events(client, start_worker, receiver, settings, tenant_key):
    start_worker("webhooks")
    queued = submit(client, webhook_url=receiver.url)
    client.post(f"/v1/jobs/{queued['id']}/cancel").raise_for_status()
    assert receiver.event.wait(30)
    assert receiver.json_bodies()[0]["type"] == "job.cancelled"

    # A job that fails (here: failed by its worker with a permanent error) reports job.failed.
    receiver.event.clear()
    failing = submit(client, webhook_url=receiver.url)
    with session_scope(settings) as session:
        token = claim(session, uuid.UUID(failing["id"]), worker_id="test", lease_s=30).attempt
        fail(session, uuid.UUID(failing["id"]), token=token, code="invalid_for_model", message="rejected")
    sweep_deadline = time.monotonic() + 60
    sw = sweeper(settings.model_copy(update={"webhook_resend_grace_s": 0.5}))
    while not receiver.event.is_set() and time.monotonic() < sweep_deadline:
        # The test failed the job behind the worker's back, so nobody queued the webhook: the sweeper does,
        # once the job has been finished for its grace period.
        sw.sweep_once()
        time.sleep(0.3)
    events = [b for b in receiver.json_bodies() if b["data"]["id"] == failing["id"]]
    assert events and events[0]["type"] == "job.failed"
    assert events[0]["data"]["error"] == {"code": "invalid_for_model", "message": "rejected"}
