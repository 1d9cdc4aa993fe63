"""The whole path on real services: REST → Postgres → Redis → Celery worker → MP4 in S3 → signed webhook."""

from __future__ import annotations

import time

import httpx
from standardwebhooks.webhooks import Webhook

from services.worker.video import probe
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
