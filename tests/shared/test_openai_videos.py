"""A job as OpenAI's videos API shows it, and its webhook event, on their own (no services): what the official
``openai`` SDK parses and verifies."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import openai
import pytest
from openai.types import Video as SdkVideo

from shared.infra.config import Settings
from shared.jobs.openai_videos import job_id_of, present_video, video_id
from shared.models import ApiFlavour, Job
from shared.spec import GenerationSpec
from shared.webhooks.events import event_body, event_type
from shared.webhooks.schedule import message_id
from shared.webhooks.signing import new_secret, sign

CREATED = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)
SPEC = GenerationSpec(
    model="tiny-wan",
    prompt="a heron in the reeds",
    negative_prompt="",
    width=1280,  # one of the SDK's VideoSize literals, so that its type validates strictly below
    height=720,
    num_frames=9,
    fps=8,
    steps=4,
    guidance_scale=5.0,
    seed=1,
)


def job(status: str, **values: Any) -> Job:
    row = Job(
        id=uuid.uuid4(),
        status=status,
        spec=SPEC.to_dict(),
        duration_s=1.0,
        progress_step=0,
        progress_total=0,
        created_at=CREATED,
        finished_at=None,
        error_code=None,
        error_message=None,
        api_flavour=ApiFlavour.OPENAI.value,
        webhook_url="https://example.com/hook",
        **{name: 0.5 for name in ("score", "score_complexity", "score_resolution", "score_duration")},
        priority_class="low",
        attempt=0,
        cancel_requested=False,
        timings={},
        metadata_={},
        started_at=None,
        result_of=None,
        output_key=None,
    )
    for name, value in values.items():
        setattr(row, name, value)
    return row


@pytest.mark.parametrize(
    ("status", "values", "shown", "progress", "error"),
    [
        ("queued", {}, "queued", 0, None),
        ("running", {"progress_step": 3, "progress_total": 4}, "in_progress", 75, None),
        ("running", {"progress_step": 4, "progress_total": 4}, "in_progress", 99, None),  # 100 only once stored
        ("succeeded", {"progress_step": 4, "progress_total": 4}, "completed", 100, None),
        ("failed", {"error_code": "render_failed", "error_message": "boom"}, "failed", 0, ("render_failed", "boom")),
        ("cancelled", {"progress_step": 2}, "failed", 50, ("cancelled", "the job was cancelled")),
    ],
)
def test_statuses_progress_and_errors_as_the_sdk_parses_them(status, values, shown, progress, error) -> None:
    finished = CREATED + timedelta(seconds=7) if status in ("succeeded", "failed", "cancelled") else None
    video = present_video(job(status, finished_at=finished, **values))
    parsed = SdkVideo.model_validate(video.model_dump(mode="json"))  # the SDK's own type, strictly validated
    assert (parsed.status, parsed.progress, parsed.object) == (shown, progress, "video")
    assert (parsed.size, parsed.seconds, parsed.model, parsed.prompt) == ("1280x720", "1", "tiny-wan", SPEC.prompt)
    assert parsed.created_at == int(CREATED.timestamp()) and parsed.expires_at is None
    assert parsed.completed_at == (int(finished.timestamp()) if finished else None)
    assert (parsed.error.code, parsed.error.message) == error if error else parsed.error is None


def test_video_ids_name_their_job_in_every_accepted_form() -> None:
    jid = uuid.uuid4()
    assert video_id(jid) == f"video_{jid.hex}"
    for form in (video_id(jid), f"video_{jid}", str(jid), jid.hex):
        assert job_id_of(form) == jid
    for bad in ("video_", "video_xyz", f"urn:uuid:{jid}", f"{{{jid}}}", f"video_{jid.hex}0", ""):
        assert job_id_of(bad) is None


def test_webhook_events_follow_the_api_that_created_the_job() -> None:
    settings = Settings(env="test")
    finished = CREATED + timedelta(seconds=7)
    done, failed = job("succeeded", finished_at=finished), job("cancelled", finished_at=finished)
    assert (event_type(done), event_type(failed)) == ("video.completed", "video.failed")
    assert event_body(done, settings=settings, storage=None) == {
        "id": f"evt_{done.id.hex}",
        "object": "event",
        "type": "video.completed",
        "created_at": int(finished.timestamp()),
        "data": {"id": video_id(done.id)},
    }
    vidq = job("cancelled", finished_at=finished, api_flavour=ApiFlavour.VIDQ.value)
    body = event_body(vidq, settings=settings, storage=None)
    assert event_type(vidq) == body["type"] == "job.cancelled" and body["data"]["id"] == str(vidq.id)


def test_the_sdk_verifies_and_unwraps_a_signed_video_event() -> None:
    secret, done = new_secret(), job("succeeded", finished_at=CREATED)
    raw = json.dumps(event_body(done, settings=Settings(env="test"), storage=None)).encode()
    headers = sign(secret, msg_id=message_id(done.id, event_type(done)), body=raw, timestamp=datetime.now(UTC))
    client = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:9/v1")
    event = client.webhooks.unwrap(raw, headers, secret=secret)
    assert (event.type, event.data.id) == ("video.completed", video_id(done.id))
    with pytest.raises(openai.InvalidWebhookSignatureError):
        client.webhooks.verify_signature(raw, headers, secret=new_secret())
