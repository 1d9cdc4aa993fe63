"""OpenAI's videos API (/v1/videos) driven by the official ``openai`` SDK against the real API process, a real
worker, Postgres and S3: the SDK's own calls, parsing and exceptions, unchanged."""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from services.api.deps import Caller
from services.api.jobs.service import create_job
from shared.infra.db import session_scope
from shared.infra.storage import Storage
from shared.jobs.schemas import JobCreate
from shared.jobs.states import claim, succeed
from shared.render.video import probe
from shared.tenants import issue_key
from tests.integration.helpers import TINY, db_job, free_port, transitions
from tools.processes import ProcessGroup, vidq_argv, wait_http, wait_until

# 9 frames of 64×64 at 4 steps: well under a second of rendering with tiny-wan on this CPU.
FAST: dict[str, Any] = {"size": "64x64", "seconds": "1"}
FAST_EXTRA: dict[str, Any] = {"steps": 4, "fps": 8, "seed": 3}
# A small render of several steps, held mid-render by the `hold` fixture for the delete to land there.
HELD_VIDEO: dict[str, Any] = {"size": "64x64", "seconds": "1"}
HELD_EXTRA: dict[str, Any] = {"steps": 8, "fps": 8}


def sdk(api_url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=f"{api_url}/v1", max_retries=0, timeout=30)


@pytest.fixture
def videos(api_url: str, tenant_key: dict[str, str]) -> Iterator[openai.OpenAI]:
    with sdk(api_url, tenant_key["api_key"]) as client:
        yield client


@pytest.fixture
def other_tenant(api_url: str, settings: Any, tenant_key: dict[str, str]) -> Iterator[openai.OpenAI]:
    with session_scope(settings) as session:
        issued = issue_key(session, tenant_name=f"other-{os.urandom(3).hex()}")
    with sdk(api_url, issued.api_key) as client:
        yield client


def job_id(video_id: str) -> str:
    assert video_id.startswith("video_")
    return str(uuid.UUID(video_id.removeprefix("video_")))


def test_create_and_poll_renders_downloads_and_sends_a_verifiable_webhook(
    videos, client, start_worker, receiver, settings, tenant_key, tmp_path
):
    start_worker("all")
    video = videos.videos.create_and_poll(
        prompt="a paper boat drifting down a gutter",
        model="sora-2",
        **FAST,
        extra_body={**FAST_EXTRA, "webhook_url": receiver.url, "metadata": {"order": "42"}},
        poll_interval_ms=100,
    )
    assert video.status == "completed", video
    assert (video.object, video.progress, video.size, video.seconds) == ("video", 100, "64x64", "1")
    assert video.model == "tiny-wan"  # OpenAI's model names render with vidq's default model
    assert video.error is None and video.expires_at is None and video.remixed_from_video_id is None
    assert video.completed_at is not None and video.completed_at >= video.created_at
    assert video.prompt == "a paper boat drifting down a gutter"

    # The same job on /v1/jobs, with vidq's own parameters from extra_body (multipart fields) in its spec.
    job = client.get(f"/v1/jobs/{job_id(video.id)}").raise_for_status().json()
    assert (job["status"], job["steps"], job["seed"], job["fps"], job["num_frames"]) == ("succeeded", 4, 3, 8, 9)
    assert (job["width"], job["height"], job["metadata"]) == (64, 64, {"order": "42"})

    # The MP4 streamed through the API is the one stored in S3, byte for byte.
    mp4 = videos.videos.download_content(video.id).content
    assert hashlib.sha256(mp4).hexdigest() == job["output"]["sha256"] and len(mp4) == job["output"]["bytes"]
    (tmp_path / "v.mp4").write_bytes(mp4)
    info = probe(tmp_path / "v.mp4")
    assert (info.codec, info.frames, info.width, info.height) == ("h264", 9, 64, 64)
    poster = videos.videos.download_content(video.id, variant="thumbnail")
    assert poster.content[:3] == b"\xff\xd8\xff" and poster.response.headers["content-type"] == "image/jpeg"
    with pytest.raises(openai.BadRequestError) as exc:
        videos.videos.download_content(video.id, variant="spritesheet")
    assert exc.value.param == "variant"

    # OpenAI's event, signed so that the SDK's own unwrap accepts it with the tenant's whsec_ secret.
    assert receiver.event.wait(30), "no webhook received"
    request = receiver.requests[0]
    event = videos.webhooks.unwrap(request["body"], request["headers"], secret=tenant_key["webhook_secret"])
    assert (event.type, event.object, event.data.id) == ("video.completed", "event", video.id)
    assert json.loads(request["body"]) == {
        "id": f"evt_{uuid.UUID(job_id(video.id)).hex}",
        "object": "event",
        "type": "video.completed",
        "created_at": video.completed_at,
        "data": {"id": video.id},
    }
    with pytest.raises(openai.InvalidWebhookSignatureError):
        videos.webhooks.unwrap(request["body"] + b" ", request["headers"], secret=tenant_key["webhook_secret"])
    deadline = time.monotonic() + 10
    while not (deliveries := client.get(f"/v1/jobs/{job['id']}/webhooks").json()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [(d["event_type"], d["ok"]) for d in deliveries] == [("video.completed", True)]

    # Deleting a completed video: 404 from then on; its files stay in S3 (the result cache may share them).
    deleted = videos.videos.delete(video.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (video.id, "video.deleted", True)
    with pytest.raises(openai.NotFoundError):
        videos.videos.download_content(video.id)
    assert Storage(settings).exists(db_job(settings, job["id"]).output_key or "")


def test_json_create_maps_parameters_and_retrieve_follows_the_job(videos, api_url, tenant_key, settings):
    r = httpx.post(
        f"{api_url}/v1/videos",
        headers={"Authorization": f"Bearer {tenant_key['api_key']}"},
        json={
            "prompt": "tide pools at dawn",
            "size": "96x64",
            "seconds": "2",
            "steps": 3,
            "seed": 9,
            "fps": 8,
            "precision": "fast",
        },
        timeout=30,
    )
    assert r.status_code == 200, r.text
    created = r.json()
    assert created["status"] == "queued" and created["progress"] == 0 and created["object"] == "video"
    assert (created["size"], created["seconds"]) == ("96x64", "2")
    assert created["completed_at"] is None and created["error"] is None
    assert r.headers["location"] == f"/v1/videos/{created['id']}"

    video = videos.videos.retrieve(created["id"])
    assert (video.id, video.status, video.created_at) == (created["id"], "queued", created["created_at"])
    job = httpx.get(
        f"{api_url}/v1/jobs/{job_id(video.id)}", headers={"Authorization": f"Bearer {tenant_key['api_key']}"}
    ).json()
    assert (job["width"], job["height"], job["num_frames"], job["steps"], job["seed"]) == (96, 64, 17, 3, 9)
    assert job["precision"] == "fast" and db_job(settings, job["id"]).spec["precision"] == "fast"
    # The bare job id names the same video.
    assert videos.videos.retrieve(job_id(video.id)).id == video.id

    # Idempotency-Key as on /v1/jobs (the SDK sends it through extra_headers).
    once = {"prompt": "the same request", **FAST, "extra_body": FAST_EXTRA, "extra_headers": {"Idempotency-Key": "k-1"}}
    first = videos.videos.with_raw_response.create(**once)
    again = videos.videos.with_raw_response.create(**once)
    assert first.parse().id == again.parse().id and again.headers["idempotent-replayed"] == "true"


def test_the_sdks_extra_body_carries_precision_into_the_spec(videos, client, settings):
    named = {
        precision: videos.videos.create(
            prompt=f"a {precision} render", **FAST, extra_body={**FAST_EXTRA, "precision": precision}
        )
        for precision in ("exact", "fast")
    }
    unnamed = videos.videos.create(prompt="a render at the worker's default", **FAST, extra_body=FAST_EXTRA)
    for precision, video in [*named.items(), (None, unnamed)]:
        job = client.get(f"/v1/jobs/{job_id(video.id)}").raise_for_status().json()
        assert job["precision"] == precision, video.id
        assert db_job(settings, job["id"]).spec.get("precision", None) == precision
    assert "precision" not in db_job(settings, job_id(unnamed.id)).spec  # stored as before the field existed


def test_list_pages_with_after_limit_and_order_and_shows_one_tenant_only(videos, other_tenant, client):
    ids = [videos.videos.create(prompt=f"clip {i}", **FAST, extra_body=FAST_EXTRA).id for i in range(5)]
    assert [v.id for v in videos.videos.list(limit=2)] == ids[::-1]  # the SDK follows last_id/has_more
    assert [v.id for v in videos.videos.list(limit=2, order="asc")] == ids

    page = videos.videos.list(limit=2)
    assert [v.id for v in page.data] == ids[::-1][:2] and page.has_more is True and page.last_id == ids[3]
    rest = videos.videos.list(limit=10, after=page.last_id)
    assert [v.id for v in rest.data] == ids[2::-1] and rest.has_more is False
    oldest_first = videos.videos.list(limit=3, order="asc", after=ids[0])
    assert [v.id for v in oldest_first.data] == ids[1:4] and oldest_first.has_more is True

    # /v1/jobs lists the same jobs.
    assert [j["id"] for j in client.get("/v1/jobs").json()["data"]] == [job_id(i) for i in ids[::-1]]

    # Another tenant sees none of them.
    assert list(other_tenant.videos.list()) == []
    with pytest.raises(openai.NotFoundError):
        other_tenant.videos.retrieve(ids[0])
    with pytest.raises(openai.NotFoundError):
        other_tenant.videos.delete(ids[0])
    with pytest.raises(openai.BadRequestError) as exc:
        other_tenant.videos.list(after=ids[0])  # not a video of theirs
    assert exc.value.param == "after"


def test_delete_cancels_a_queued_job_and_hides_it_everywhere(videos, client, settings):
    kept = videos.videos.create(prompt="kept", **FAST, extra_body=FAST_EXTRA)
    video = videos.videos.create(prompt="deleted", **FAST, extra_body=FAST_EXTRA)
    assert videos.videos.delete(video.id).deleted is True

    # Cancelled through the state machine (it never runs), and gone for its tenant on both APIs.
    assert transitions(settings, job_id(video.id)) == [("queued", "cancelled", 0)]
    assert db_job(settings, job_id(video.id)).deleted_at is not None
    with pytest.raises(openai.NotFoundError):
        videos.videos.retrieve(video.id)
    with pytest.raises(openai.NotFoundError):
        videos.videos.delete(video.id)
    assert [v.id for v in videos.videos.list()] == [kept.id]
    assert client.get(f"/v1/jobs/{job_id(video.id)}").status_code == 404
    assert [j["id"] for j in client.get("/v1/jobs").json()["data"]] == [job_id(kept.id)]
    assert client.post(f"/v1/jobs/{job_id(video.id)}/cancel").status_code == 404


def test_delete_stops_a_running_job_at_its_next_step(videos, client, start_worker, settings, hold):
    start_worker("video")
    hold.on()  # the render holds after each step until cancelled: it is surely mid-render when the delete comes
    video = videos.videos.create(prompt="a long render", **HELD_VIDEO, extra_body=HELD_EXTRA)
    wait_until(lambda: videos.videos.retrieve(video.id).progress > 0, timeout_s=60, what="the render's first step")
    seen = videos.videos.retrieve(video.id)
    assert seen.status == "in_progress" and seen.progress > 0, seen
    videos.videos.delete(video.id)
    with pytest.raises(openai.NotFoundError):
        videos.videos.retrieve(video.id)
    wait_until(lambda: db_job(settings, job_id(video.id)).status != "running", timeout_s=60, what="the render to stop")
    stopped = db_job(settings, job_id(video.id))
    assert stopped.status == "cancelled" and stopped.progress_step < HELD_EXTRA["steps"]
    assert transitions(settings, job_id(video.id))[-1] == ("running", "cancelled", 1)


def test_a_cancelled_job_is_a_failed_video_with_a_video_failed_webhook(
    videos, client, start_worker, receiver, tenant_key
):
    video = videos.videos.create(
        prompt="never rendered", **FAST, extra_body={**FAST_EXTRA, "webhook_url": receiver.url}
    )
    with pytest.raises(openai.ConflictError):
        videos.videos.download_content(video.id)  # not completed yet
    assert client.post(f"/v1/jobs/{job_id(video.id)}/cancel").status_code == 202
    failed = videos.videos.retrieve(video.id)
    assert failed.status == "failed" and failed.error is not None and failed.error.code == "cancelled"
    assert failed.completed_at is not None

    start_worker("webhooks")
    assert receiver.event.wait(30), "no webhook received"
    request = receiver.requests[0]
    event = videos.webhooks.unwrap(request["body"], request["headers"], secret=tenant_key["webhook_secret"])
    assert (event.type, event.data.id, event.created_at) == ("video.failed", video.id, failed.completed_at)


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"size": "65x64"}, "size"),  # not a multiple of 16
        ({"size": "64 by 64"}, "size"),
        ({"size": "1920x1920"}, "size"),  # over the pixel cap
        ({"seconds": "99"}, "seconds"),  # over the duration cap
        ({"seconds": "soon"}, "seconds"),
        ({"model": "dall-e-3"}, "model"),
        ({"extra_body": {"steps": 0}}, "steps"),
        ({"extra_body": {"resolution": "480p"}}, "resolution"),  # not a parameter of this API
        ({"extra_body": {"precision": "turbo"}}, "precision"),
        ({"extra_body": {"precision": "EXACT"}}, "precision"),
    ],
)
def test_bad_parameters_are_openai_400s(videos, params, param):
    extra = params.pop("extra_body", {})
    with pytest.raises(openai.BadRequestError) as exc:
        videos.videos.create(prompt="a bad request", **{**FAST, **params}, extra_body={**FAST_EXTRA, **extra})
    error = exc.value.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (exc.value.status_code, error["type"], error["param"], error["code"]) == (
        400,
        "invalid_request_error",
        param,
        "invalid_request",
    )
    assert list(videos.videos.list()) == []  # nothing was written


def test_every_error_of_the_videos_api_has_openais_shape_and_jobs_keep_theirs(api_url, videos, client):
    with sdk(api_url, "vidq_not-a-key") as stranger, pytest.raises(openai.AuthenticationError) as exc:
        stranger.videos.list()
    assert exc.value.response.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.NotFoundError) as missing:
        videos.videos.retrieve("video_" + uuid.uuid4().hex)
    assert set(missing.value.response.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError) as bad:
        videos.videos.list(limit=0)
    assert bad.value.param == "limit"
    r = client.post("/v1/videos", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    # /v1/jobs keeps vidq's envelope and its 422.
    r = client.post("/v1/jobs", json={"prompt": "x", "width": 65, "height": 64})
    assert r.status_code == 422 and set(r.json()["error"]) == {"code", "message", "details"}


def _succeeded_without_files(settings: Any, tenant_key: dict[str, str]) -> str:
    """A job finished in Postgres whose video was never stored (as after a bucket reset): its video id."""
    tenant = Caller(id=uuid.UUID(tenant_key["tenant_id"]), name=tenant_key["tenant_name"])
    with session_scope(settings) as session:
        job = create_job(session, settings, tenant=tenant, body=JobCreate(**TINY))
        running = claim(session, job.id, worker_id="test", lease_s=30)
        assert running is not None
        output = {"output_key": f"videos/{tenant.id}/{job.id}.mp4", "output_bytes": 1, "output_sha256": "0" * 64}
        assert succeed(session, job.id, token=running.attempt, output=output) is not None
        return f"video_{job.id.hex}"


@pytest.fixture
def api_without_s3(procs: ProcessGroup, tmp_path: Any) -> Iterator[str]:
    """An API whose S3 is gone (nothing listens on its port)."""
    port = free_port()
    group = ProcessGroup(
        env={**procs.env, "VIDQ_S3_ENDPOINT": f"127.0.0.1:{free_port()}"}, log_dir=tmp_path, spawn=procs.spawn
    )
    group.start("api-nos3", vidq_argv("api", "--no-migrate", "--port", str(port)))
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/healthz", timeout_s=60, group=group)
    yield url
    group.stop_all(timeout_s=10)


def test_content_of_a_file_gone_from_s3_is_404_and_s3_down_is_503(videos, api_without_s3, settings, tenant_key):
    video = _succeeded_without_files(settings, tenant_key)
    assert videos.videos.retrieve(video).status == "completed"
    with pytest.raises(openai.NotFoundError) as gone:
        videos.videos.download_content(video)
    assert "no longer stored" in gone.value.message

    with sdk(api_without_s3, tenant_key["api_key"]) as cut_off:
        with pytest.raises(openai.InternalServerError) as down:
            cut_off.videos.download_content(video)
        assert cut_off.videos.retrieve(video).status == "completed"  # reads need no S3
    assert down.value.status_code == 503 and int(down.value.response.headers["retry-after"]) >= 1
    error = down.value.response.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "unavailable")
