"""The result cache on real services: a request whose every render parameter equals a succeeded job of the same
tenant finishes at once with that job's video (the same S3 objects, a new job), unless it says ``"cache": false``;
never across tenants, never for another parameter; its webhook goes out as any finished job's, the sweeper's rule
included."""

from __future__ import annotations

import hashlib
import io
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis
from sqlalchemy import select
from standardwebhooks.webhooks import Webhook

from services.api.jobs.service import create_job
from shared.infra.config import Settings
from shared.infra.db import session_scope
from shared.infra.storage import Storage
from shared.jobs.schemas import JobCreate
from shared.jobs.states import claim, succeed
from shared.models import JobTransition, Tenant
from shared.queues import Queue
from shared.tenants import issue_key
from tests.integration.helpers import TINY, db_job, queue_key, submit, sweeper, transitions, wait_job


@pytest.fixture
def broker(settings: Settings) -> Iterator[redis.Redis]:
    r = redis.Redis.from_url(str(settings.broker_url), socket_timeout=5)
    yield r
    r.close()


def depth(broker: redis.Redis, settings: Settings, queue: str) -> int:
    """Messages waiting in one of this session's queues."""
    return int(broker.llen(queue_key(settings, queue)))


def wait_for(check: Any, *, what: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def reasons(settings: Settings, job_id: str) -> list[str]:
    with session_scope(settings) as session:
        rows = session.execute(
            select(JobTransition.reason).where(JobTransition.job_id == uuid.UUID(job_id)).order_by(JobTransition.id)
        )
        return list(rows.scalars())


def other_tenant(api_url: str, settings: Settings) -> httpx.Client:
    with session_scope(settings) as session:
        issued = issue_key(session, tenant_name=f"other-{uuid.uuid4().hex[:6]}")
    return httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {issued.api_key}"}, timeout=30)


def succeeded_without_rendering(settings: Settings, tenant_id: str, **body: Any) -> str:
    """A succeeded job made through the state machine (claim, succeed) with made-up output columns: a source for the
    cache when the test is about what follows a hit, not about the video."""
    with session_scope(settings) as session:
        tenant = session.get(Tenant, uuid.UUID(tenant_id))
        job = create_job(session, settings, tenant=tenant, body=JobCreate(**{**TINY, **body}))
        running = claim(session, job.id, worker_id="test", lease_s=30)
        assert running is not None
        output = {
            "output_key": f"videos/{tenant_id}/{job.id}.mp4",
            "poster_key": f"videos/{tenant_id}/{job.id}.jpg",
            "output_bytes": 1234,
            "output_sha256": "ab" * 32,
            "output_frames": 9,
        }
        assert succeed(session, job.id, token=running.attempt, output=output) is not None
    # The cache reuses a video only while it is stored: put a stand-in there.
    storage = Storage(settings)
    storage.client.put_object(storage.bucket, output["output_key"], io.BytesIO(b"not a video"), length=11)
    return str(job.id)


def test_an_identical_request_reuses_the_video_and_cache_false_renders_again(
    client, start_worker, procs, settings, broker
):
    worker = start_worker("video")
    first = wait_job(client, submit(client)["id"], {"succeeded"})
    assert first["result_of"] is None and first["attempt"] == 1
    procs.stop(worker, timeout_s=15)  # from here on nothing consumes the video queues

    r = client.post("/v1/jobs", json=TINY)
    assert r.status_code == 202, r.text
    cached = r.json()
    assert r.headers["Location"] == f"/v1/jobs/{cached['id']}"
    assert cached["status"] == "succeeded" and cached["id"] != first["id"]
    assert cached["result_of"] == first["id"]
    assert (cached["attempt"], cached["timings"]) == (0, {"result_cache": True})  # never claimed, nothing rendered
    assert cached["progress"] == {"step": 4, "total": 4, "percent": 100.0}
    assert cached["started_at"] == cached["finished_at"] == cached["created_at"]
    for field in ("bytes", "sha256", "frames", "fps", "width", "height"):
        assert cached["output"][field] == first["output"][field], field
    # Scored and classed as any job, the same row shape.
    assert (cached["score"], cached["priority_class"]) == (first["score"], first["priority_class"])
    assert client.get(f"/v1/jobs/{cached['id']}").json()["result_of"] == first["id"]

    # The same S3 objects, no copy; its own presigned URL serves the first job's bytes.
    source, row = db_job(settings, first["id"]), db_job(settings, cached["id"])
    assert (row.output_key, row.poster_key, row.output_sha256) == (
        source.output_key,
        source.poster_key,
        source.output_sha256,
    )
    assert row.result_key == source.result_key is not None
    assert row.webhook_pending_since is None  # no webhook URL: nothing to deliver
    video = httpx.get(cached["output"]["url"], timeout=30).raise_for_status().content
    assert video == httpx.get(first["output"]["url"], timeout=30).raise_for_status().content
    assert hashlib.sha256(video).hexdigest() == cached["output"]["sha256"] and len(video) == cached["output"]["bytes"]
    assert httpx.get(cached["output"]["poster_url"], timeout=30).raise_for_status().content[:3] == b"\xff\xd8\xff"

    # One audit row: created succeeded from the cache; no claim, no running.
    assert transitions(settings, cached["id"]) == [(None, "succeeded", 0)]
    assert reasons(settings, cached["id"]) == ["result_cache"]

    # "cache": false renders again. Its message is the only one sent since the worker stopped: the sender thread
    # sends in order, so once it is in Redis a message for the cached job would be there too.
    fresh = submit(client, cache=False)
    assert fresh["status"] == "queued" and fresh["result_of"] is None
    video_queues = [q.value for q in Queue.video()]
    wait_for(lambda: depth(broker, settings, fresh["queue"]) >= 1, what="the cache: false job's message")
    assert sum(depth(broker, settings, q) for q in video_queues) == 1
    assert depth(broker, settings, Queue.WEBHOOKS.value) == 0

    # Another hit names the job that rendered the video, not the hit before it.
    again = client.post("/v1/jobs", json={**TINY, "cache": True}).json()
    assert (again["status"], again["result_of"]) == ("succeeded", first["id"])

    start_worker("video")
    rendered = wait_job(client, fresh["id"], {"succeeded"})
    assert (rendered["attempt"], rendered["result_of"]) == (1, None)
    assert transitions(settings, fresh["id"]) == [("queued", "running", 1), ("running", "succeeded", 1)]
    assert db_job(settings, fresh["id"]).output_key != source.output_key  # its own objects


def test_a_source_whose_video_is_gone_is_not_reused(client, settings, tenant_key):
    source = succeeded_without_rendering(settings, tenant_key["tenant_id"], seed=41)
    storage = Storage(settings)
    storage.client.remove_object(storage.bucket, db_job(settings, source).output_key)  # deleted, expired, reset
    job = submit(client, seed=41)
    assert (job["status"], job["result_of"]) == ("queued", None)  # rendered, never a link to nothing


def test_another_render_parameter_or_another_tenant_never_matches(client, start_worker, api_url, settings):
    start_worker("video")
    first = wait_job(client, submit(client)["id"], {"succeeded"})
    with other_tenant(api_url, settings) as stranger:
        misses = [submit(client, seed=2), submit(client, steps=5), submit(stranger)]
        for job in misses:
            assert (job["status"], job["result_of"]) == ("queued", None)
        for job, http in zip(misses, [client, client, stranger], strict=True):
            done = wait_job(http, job["id"], {"succeeded"})
            assert (done["attempt"], done["result_of"]) == (1, None)
            assert ("queued", "running", 1) in transitions(settings, job["id"])
        # Each tenant's identical request hits its own job only.
        theirs = stranger.post("/v1/jobs", json=TINY).json()
        assert (theirs["status"], theirs["result_of"]) == ("succeeded", misses[2]["id"])
    ours = client.post("/v1/jobs", json=TINY).json()
    assert (ours["status"], ours["result_of"]) == ("succeeded", first["id"])
    assert db_job(settings, theirs["id"]).output_key != db_job(settings, ours["id"]).output_key


def test_a_cached_job_with_a_webhook_gets_its_signed_event(client, start_worker, receiver, settings, tenant_key):
    start_worker("webhooks")
    source = succeeded_without_rendering(settings, tenant_key["tenant_id"])
    cached = submit(client, webhook_url=receiver.url, metadata={"order": 7})  # neither is a render parameter
    assert (cached["status"], cached["result_of"]) == ("succeeded", source)
    assert receiver.event.wait(30), "no webhook received"
    (request,) = receiver.requests
    payload = Webhook(tenant_key["webhook_secret"]).verify(request["body"], request["headers"])
    assert payload["type"] == "job.succeeded"
    data = payload["data"]
    assert (data["id"], data["result_of"], data["metadata"]) == (cached["id"], source, {"order": 7})
    assert data["output"]["sha256"] == "ab" * 32
    wait_for(
        lambda: [d["ok"] for d in client.get(f"/v1/jobs/{cached['id']}/webhooks").json()] == [True],
        what="the delivery on record",
    )
    assert db_job(settings, cached["id"]).webhook_pending_since is None  # cleared by the attempt


def test_a_cached_jobs_lost_webhook_is_handed_over_by_the_sweeper(
    client, start_worker, receiver, settings, broker, tenant_key
):
    source = succeeded_without_rendering(settings, tenant_key["tenant_id"])
    cached = submit(client, webhook_url=receiver.url)
    assert cached["result_of"] == source
    assert db_job(settings, cached["id"]).webhook_pending_since is not None  # marked by its insert
    # No webhook worker yet: its message waits in Redis. Lose it.
    wait_for(lambda: depth(broker, settings, Queue.WEBHOOKS.value) == 1, what="the webhook message")
    broker.delete(queue_key(settings, Queue.WEBHOOKS.value))
    start_worker("webhooks")
    sw = sweeper(settings.model_copy(update={"webhook_resend_grace_s": 0.5}))
    deadline = time.monotonic() + 30
    handed_over: list[uuid.UUID] = []
    while not receiver.event.is_set() and time.monotonic() < deadline:
        handed_over += sw.sweep_once().webhooks
        time.sleep(0.3)
    assert uuid.UUID(cached["id"]) in handed_over
    assert [b["data"]["id"] for b in receiver.json_bodies()] == [cached["id"]]


def test_idempotency_key_replays_the_cached_job(client, settings, tenant_key):
    source = succeeded_without_rendering(settings, tenant_key["tenant_id"])
    headers = {"Idempotency-Key": "order-9"}
    first = client.post("/v1/jobs", json=TINY, headers=headers)
    again = client.post("/v1/jobs", json=TINY, headers=headers)
    assert first.status_code == again.status_code == 202
    assert first.json()["id"] == again.json()["id"] and again.headers["Idempotent-Replayed"] == "true"
    assert (again.json()["status"], again.json()["result_of"]) == ("succeeded", source)
    # "cache": false is another request body for the same key.
    other = client.post("/v1/jobs", json={**TINY, "cache": False}, headers=headers)
    assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_key_reused"
