"""The admission watermark through a real API process: a storm of submits over W gets 429s with Retry-After in the
error envelope (OpenAI's shape under /v1/videos), nothing is written for a refused job, an idempotent replay is never
refused, and a worker draining the queue opens it again. The API here has its own broker key prefix, so its
watermark and queues are its own, with W held at 8 (every level 8)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from sqlalchemy import func, select

from shared.infra.db import session_scope
from shared.models import IdempotencyKey, Job, JobTransition
from tests.conftest import _delete_broker_keys
from tests.integration.helpers import TINY, free_port, wait_job
from tools.processes import ProcessGroup, vidq_argv, wait_for_log, wait_http

W = 8


# Thresholds under which these three bodies fall in three classes (the door's 429 needs every class full).
LONG_PROMPT = "a tiny red boat drifts across a misty golden lake, cinematic and dramatic, while birds fly"
BY_CLASS = {
    "high": {**TINY, "prompt": LONG_PROMPT},
    "medium": TINY,
    "low": {**TINY, "duration_s": 4.0},
}
THRESHOLDS = {"VIDQ_SCORE_HIGH": "0.40", "VIDQ_SCORE_MEDIUM": "0.30"}


@pytest.fixture
def group(procs: ProcessGroup, settings, request) -> Iterator[ProcessGroup]:
    prefix = f"{settings.broker_key_prefix}wm-{os.urandom(3).hex()}:"
    levels = {f"VIDQ_WATERMARK_{k}": str(W) for k in ("IDLE", "NORMAL", "BUSY", "MIN", "MAX")}
    extra = getattr(request, "param", {})  # more environment, from an indirect parametrization
    own = ProcessGroup(
        env={**procs.env, "VIDQ_BROKER_KEY_PREFIX": prefix, **levels, **extra},
        log_dir=procs.log_dir,
        spawn=procs.spawn,
    )
    yield own
    own.stop_all(timeout_s=10)
    _delete_broker_keys(str(settings.broker_url), prefix)


@pytest.fixture
def api(group: ProcessGroup, tenant_key) -> Iterator[httpx.Client]:
    port = free_port()
    group.start("api-watermark", vidq_argv("api", "--no-migrate", "--port", str(port)))
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/readyz", timeout_s=60, group=group)
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {tenant_key['api_key']}"}, timeout=30) as c:
        yield c


def storm(api: httpx.Client, n: int, path: str = "/v1/jobs") -> list[httpx.Response]:
    with ThreadPoolExecutor(max_workers=16) as pool:
        return list(pool.map(lambda i: api.post(path, json={**TINY, "seed": 1000 + i}), range(n)))


def rows(settings, model) -> int:
    with session_scope(settings) as session:
        return int(session.scalar(select(func.count()).select_from(model)) or 0)


def test_a_storm_over_w_is_refused_with_429_and_writes_nothing(api, settings):
    answers = storm(api, 30)
    codes = sorted(r.status_code for r in answers)
    assert codes == [202] * W + [429] * (30 - W), codes
    for refused in (r for r in answers if r.status_code == 429):
        error = refused.json()["error"]
        assert error["code"] == "queue_full"
        assert error["details"] == {"priority_class": "low", "backlog": W, "watermark": W}  # each job counted once
        assert int(refused.headers["Retry-After"]) >= 1
    # Only the admitted jobs exist; a refused one left no row, no audit row, no key.
    assert rows(settings, Job) == W
    assert rows(settings, JobTransition) == 0
    assert rows(settings, IdempotencyKey) == 0


def test_openai_videos_get_429_in_openai_shape(api, settings):
    storm(api, W)
    r = api.post("/v1/videos", json={"prompt": "a boat", "size": "64x64", "seconds": "1"})
    assert r.status_code == 429, r.text
    error = r.json()["error"]
    assert error["code"] == "queue_full" and error["type"] == "rate_limit_error"
    assert int(r.headers["Retry-After"]) >= 1
    assert rows(settings, Job) == W


def test_an_idempotent_replay_is_answered_even_when_the_class_is_full(api, settings):
    first = api.post("/v1/jobs", json={**TINY, "seed": 7}, headers={"Idempotency-Key": "k-1"})
    assert first.status_code == 202
    storm(api, W)
    replay = api.post("/v1/jobs", json={**TINY, "seed": 7}, headers={"Idempotency-Key": "k-1"})
    assert replay.status_code == 202 and replay.json()["id"] == first.json()["id"]
    assert replay.headers["Idempotent-Replayed"] == "true"
    fresh = api.post("/v1/jobs", json={**TINY, "seed": 8}, headers={"Idempotency-Key": "k-2"})
    assert fresh.status_code == 429
    assert rows(settings, IdempotencyKey) == 1


def test_a_worker_draining_the_queue_opens_it_again(api, group, settings):
    accepted = [r.json()["id"] for r in storm(api, W + 4) if r.status_code == 202]
    assert len(accepted) == W
    name = "worker-watermark"
    group.start(name, vidq_argv("worker", "--role", "video", "--name", name))
    wait_for_log(group, name, "pipeline loaded", timeout_s=120)
    for job_id in accepted:
        wait_job(api, job_id, {"succeeded"}, timeout_s=120)
    later = api.post("/v1/jobs", json={**TINY, "seed": 99})
    assert later.status_code == 202
    assert uuid.UUID(later.json()["id"])


@pytest.mark.parametrize("group", [THRESHOLDS], indirect=True)
def test_while_every_class_is_full_a_submit_is_refused_at_the_door(api, settings):
    """Past the door nothing of the request is read: a body that is not even JSON gets the 429, not a 422."""
    for klass, body in BY_CLASS.items():
        answers = [api.post("/v1/jobs", json={**body, "seed": 100 + i}) for i in range(W + 1)]
        assert [r.status_code for r in answers] == [202] * W + [429]
        assert answers[-1].json()["error"]["details"]["priority_class"] == klass
    refused = api.post("/v1/jobs", content=b"{not json", headers={"Content-Type": "application/json"})
    assert refused.status_code == 429, refused.text
    assert int(refused.headers["Retry-After"]) >= 1
    details = refused.json()["error"]["details"]
    assert details == {"classes": {k: {"backlog": W, "watermark": W} for k in BY_CLASS}}
    assert rows(settings, Job) == 3 * W
    # An unknown key still gets its 401, and a request with an Idempotency-Key goes in (a replay is never refused).
    stranger = api.post("/v1/jobs", content=b"{}", headers={"Authorization": "Bearer nobody"})
    assert stranger.status_code == 401
    keyed = api.post("/v1/jobs", content=b"{not json", headers={"Idempotency-Key": "k-9"})
    assert keyed.status_code == 422
