"""The whole path on real services: REST → Postgres → Redis → Celery worker → MP4 in S3 → signed webhook."""

from __future__ import annotations

import json
import time

import httpx
from standardwebhooks.webhooks import Webhook

from shared.render.video import probe
from tests.integration.helpers import submit, transitions, wait_job


def test_prompt_becomes_mp4_in_s3_and_a_signed_webhook(
    client, api_url, start_worker, receiver, settings, tenant_key, tmp_path
):
    start_worker("all")
    job = submit(client, webhook_url=receiver.url, metadata={"order": 42})
    assert job["status"] == "queued"
    assert job["queue"] == f"video.{job['priority_class']}"
    assert set(job["score"]) == {"value", "complexity", "resolution", "duration"}
    assert job["num_frames"] == 9 and job["links"]["self"].endswith(job["id"])

    done = wait_job(client, job["id"], {"succeeded", "failed", "cancelled"})
    assert done["status"] == "succeeded", done
    assert done["attempt"] == 1
    assert done["progress"] == {"step": 4, "total": 4, "percent": 100.0}
    out = done["output"]
    assert out["frames"] == 9 and out["width"] == 64 and out["height"] == 64 and out["fps"] == 8

    # The MP4 really is in S3 at the deterministic key, and reads back as H.264.
    mp4 = tmp_path / "v.mp4"
    mp4.write_bytes(httpx.get(out["url"], timeout=30).raise_for_status().content)
    assert mp4.stat().st_size == out["bytes"]
    info = probe(mp4)
    assert (info.codec, info.frames, info.width, info.height, info.pix_fmt) == ("h264", 9, 64, 64, "yuv420p")
    poster = httpx.get(out["poster_url"], timeout=30).raise_for_status().content
    assert poster[:3] == b"\xff\xd8\xff"

    # The webhook arrives and verifies with the tenant's secret.
    assert receiver.event.wait(30), "no webhook received"
    request = receiver.requests[0]
    payload = Webhook(tenant_key["webhook_secret"]).verify(request["body"], request["headers"])
    assert payload["type"] == "job.succeeded"
    assert payload["data"]["id"] == job["id"] and payload["data"]["metadata"] == {"order": 42}

    # The delivery is on record and visible through the API.
    deadline = time.monotonic() + 10
    while not (deliveries := client.get(f"/v1/jobs/{job['id']}/webhooks").json()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert deliveries[0]["ok"] is True and deliveries[0]["status_code"] == 204
    assert deliveries[0]["msg_id"] == request["headers"]["webhook-id"]

    assert transitions(settings, job["id"]) == [("queued", "running", 1), ("running", "succeeded", 1)]


def test_progress_streams_as_server_sent_events(client, start_worker, hold):
    start_worker("video")
    hold.on()  # the render waits after its first step until the stream is open: every later step is streamed
    job = submit(client, steps=8)
    events: list[tuple[str, dict]] = []
    with client.stream("GET", f"/v1/jobs/{job['id']}/events", timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        event = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: ") and event:
                events.append((event, json.loads(line.removeprefix("data: "))))
                hold.release()
    kinds = [k for k, _ in events]
    assert kinds[-1] == "job" and kinds.count("job") == 1
    assert events[-1][1]["status"] == "succeeded" and events[-1][1]["output"]["frames"] == 9
    steps = [d["step"] for k, d in events if k == "progress" and d["status"] == "running"]
    assert steps == sorted(steps) and len(steps) >= 3 and steps[-1] == 8  # real steps, not 0 → 100
    assert client.get("/v1/jobs/00000000-0000-0000-0000-000000000000/events").status_code == 404
