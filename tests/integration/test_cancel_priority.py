"""Cancel (queued and running) and strict priority order, with real worker processes."""

from __future__ import annotations

import time

from tests.integration.helpers import SLOW, db_job, queue_key, submit, sweeper, transitions, wait_job


def test_cancel_queued_job_never_runs(client, start_worker, settings):
    job = submit(client)
    r = client.post(f"/v1/jobs/{job['id']}/cancel")
    assert r.status_code == 202 and r.json()["status"] == "cancelled"
    start_worker("video")
    follow = submit(client)  # proves the worker is consuming: it finishes the next job
    wait_job(client, follow["id"], {"succeeded"})
    row = db_job(settings, job["id"])
    assert row.status == "cancelled" and row.attempt == 0 and row.started_at is None
    assert transitions(settings, job["id"]) == [("queued", "cancelled", 0)]
    # A finished job cannot be cancelled.
    assert client.post(f"/v1/jobs/{follow['id']}/cancel").status_code == 409


def test_cancel_running_job_stops_at_next_step_and_frees_the_worker(client, start_worker, settings):
    start_worker("video")
    job = submit(client, **SLOW)
    wait_job(client, job["id"], {"running"}, min_step=2)
    r = client.post(f"/v1/jobs/{job['id']}/cancel")
    assert r.status_code == 202 and r.json()["cancel_requested"] is True
    done = wait_job(client, job["id"], {"cancelled", "succeeded", "failed"}, timeout_s=30)
    assert done["status"] == "cancelled"
    assert done["progress"]["step"] < SLOW["steps"]  # it stopped early
    assert done["output"] is None
    nxt = submit(client)  # the worker is free again
    assert wait_job(client, nxt["id"], {"succeeded"})["status"] == "succeeded"


def test_high_runs_before_medium_before_low_when_all_are_queued(client, start_worker, settings):
    # With the default weights: a one-word long clip is low; a busy prompt on a short clip is medium; a very
    # busy prompt, the largest size and the shortest clip is high (see shared/scoring.py for the formula).
    busy = "a bright golden red dragon slowly flying over misty blue mountains"
    low = submit(client, prompt="boat", width=64, height=64, duration_s=3.0, fps=4)
    medium = submit(client, prompt=", ".join([busy] * 5), width=64, height=64, duration_s=1.0, fps=4)
    high = submit(client, prompt=", ".join([busy] * 12), width=448, height=448, duration_s=0.25, fps=4)
    assert (low["priority_class"], medium["priority_class"], high["priority_class"]) == (
        "low",
        "medium",
        "high",
    )
    start_worker("video")
    for j in (low, medium, high):
        wait_job(client, j["id"], {"succeeded"}, timeout_s=120)
    started = {
        name: db_job(settings, j["id"]).started_at for name, j in {"low": low, "medium": medium, "high": high}.items()
    }
    assert started["high"] < started["medium"] < started["low"], started


def test_low_job_is_aged_up_so_it_cannot_starve(client, settings, clean_state):
    """With no worker, a low job waiting past aging_promote_after_s is re-sent to video.medium, then video.high."""
    import redis

    from shared.config import Settings

    job = submit(client, prompt="boat", width=64, height=64, duration_s=3.0, fps=4)
    assert job["queue"] == "video.low"
    fast = Settings(aging_promote_after_s=0.5)
    r = redis.Redis.from_url(str(settings.broker_url), socket_timeout=5)

    def depth(queue: str) -> int:
        # This session's queues only: other suites may share the Redis database under their own prefix.
        return int(r.llen(queue_key(settings, queue)))

    assert depth("video.low") == 1 and depth("video.medium") == 0
    time.sleep(0.7)
    sweeper(fast).sweep_once()
    assert db_job(settings, job["id"]).queue == "video.medium" and depth("video.medium") == 1
    time.sleep(0.7)
    sweeper(fast).sweep_once()
    assert db_job(settings, job["id"]).queue == "video.high" and depth("video.high") == 1
    time.sleep(0.7)
    sweeper(fast).sweep_once()  # high is the top: no further sends
    assert depth("video.high") == 1
