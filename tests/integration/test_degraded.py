"""Degraded rendering on real processes (tiny-wan on the CPU, the VIDQ_WORKER_FAULT_OOM_RENDERS test knob): a job
that allows it and runs out of memory even in low_vram renders at the next lower tier, and says so in its body and
its webhook; one that does not fails with out_of_memory (tests/integration/test_worker_faults.py). A model+shape
whose breaker is open fails fast with model_unavailable, or renders degraded for a job that allows it. A bad
``allow_degraded`` is refused and writes nothing."""

from __future__ import annotations

from sqlalchemy import func, select

from shared.infra.db import session_scope
from shared.models import Job
from tests.integration.helpers import TINY, process_env, submit, wait_job

# 64×64, 4 steps (TINY) → 32×32, 2 steps
LOWER = {"steps": 2, "width": 32, "height": 32}


def job_count(settings) -> int:
    with session_scope(settings) as session:
        return int(session.execute(select(func.count()).select_from(Job)).scalar_one())


def test_out_of_memory_in_low_vram_renders_an_allowing_job_at_the_lower_tier(client, start_worker, procs, receiver):
    with process_env(procs, VIDQ_WORKER_FAULT_OOM_RENDERS="2"):  # the render and its low_vram retry
        start_worker("all")
    job = submit(client, allow_degraded=True, webhook_url=receiver.url)
    assert job["allow_degraded"] is True and job["degraded"] is False and job["degraded_from"] is None
    done = wait_job(client, job["id"], {"succeeded", "failed"}, timeout_s=120)
    assert done["status"] == "succeeded" and done["attempt"] == 1, done
    assert done["degraded"] is True
    asked = {"steps": TINY["steps"], "width": TINY["width"], "height": TINY["height"]}
    assert done["degraded_from"] == {"reason": "out_of_memory", **asked}
    assert (done["steps"], done["width"], done["height"]) == tuple(asked.values())  # the request, as asked
    assert (done["output"]["width"], done["output"]["height"]) == (LOWER["width"], LOWER["height"])
    assert done["progress"] == {"step": LOWER["steps"], "total": LOWER["steps"], "percent": 100.0}
    assert done["timings"]["degraded"] == {"reason": "out_of_memory", "from": asked, "to": LOWER}
    # The webhook carries the same body.
    assert receiver.event.wait(30)
    (event,) = receiver.json_bodies()
    assert event["type"] == "job.succeeded"
    assert event["data"]["degraded"] is True and event["data"]["degraded_from"] == done["degraded_from"]
    # A degraded video is never served from the result cache: the same request renders again.
    again = submit(client, allow_degraded=True, seed=job["seed"])
    assert again["result_of"] is None


def test_an_open_model_breaker_fails_fast_or_degrades(client, start_worker, procs):
    # Two failed renders of 64×64×5 open its breaker (min 2 calls); the first puts the model in low_vram, so the
    # second fails there at once: three out-of-memory renders in all.
    with process_env(procs, VIDQ_WORKER_FAULT_OOM_RENDERS="3", VIDQ_BREAKER_MIN_CALLS="2"):
        start_worker("video")
    for seed in (1, 2):
        failed = wait_job(client, submit(client, seed=seed)["id"], {"succeeded", "failed"}, timeout_s=120)
        assert failed["error"]["code"] == "out_of_memory", failed
    refused = wait_job(client, submit(client, seed=3)["id"], {"succeeded", "failed"}, timeout_s=120)
    assert refused["status"] == "failed" and refused["error"]["code"] == "model_unavailable", refused
    assert refused["attempt"] == 1 and refused["timings"] == {}
    degraded = wait_job(
        client, submit(client, seed=4, allow_degraded=True)["id"], {"succeeded", "failed"}, timeout_s=120
    )
    assert degraded["status"] == "succeeded", degraded
    assert degraded["degraded_from"]["reason"] == "model_unavailable"
    assert (degraded["output"]["width"], degraded["output"]["height"]) == (LOWER["width"], LOWER["height"])


def test_a_bad_allow_degraded_is_refused_and_writes_nothing(client, settings):
    before = job_count(settings)
    for value in ("maybe", 3, [True], {"yes": 1}):
        r = client.post("/v1/jobs", json={**TINY, "allow_degraded": value})
        assert r.status_code == 422, r.text
        assert r.json()["error"]["code"] == "invalid_request"
        r = client.post("/v1/videos", json={"prompt": "a boat", "size": "64x64", "allow_degraded": value})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "allow_degraded"
    assert job_count(settings) == before


def test_allow_degraded_passes_through_the_openai_api(client):
    r = client.post("/v1/videos", json={"prompt": "a boat", "size": "64x64", "seconds": "1", "allow_degraded": True})
    assert r.status_code == 200, r.text
    job_id = r.json()["id"].removeprefix("video_")
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["allow_degraded"] is True
