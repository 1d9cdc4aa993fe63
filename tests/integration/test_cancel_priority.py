"""Cancel (queued and running) and strict priority order, with real worker processes."""

from __future__ import annotations

import uuid
from datetime import timedelta

from shared.infra.db import session_scope
from tests.integration.helpers import db_job, queue_key, submit, sweeper, transitions, wait_job
from tools.processes import wait_until


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


def test_cancel_running_job_stops_at_next_step_and_frees_the_worker(client, start_worker, settings, hold):
    start_worker("video")
    hold.on()  # the render holds after each step until cancelled: it is surely mid-render when the cancel comes
    job = submit(client, steps=8)
    wait_job(client, job["id"], {"running"}, min_step=1)
    r = client.post(f"/v1/jobs/{job['id']}/cancel")
    assert r.status_code == 202 and r.json()["cancel_requested"] is True
    done = wait_job(client, job["id"], {"cancelled", "succeeded", "failed"}, timeout_s=30)
    assert done["status"] == "cancelled"
    assert done["progress"]["step"] < 8  # it stopped early
    assert done["output"] is None
    hold.release()
    nxt = submit(client)  # the worker is free again
    assert wait_job(client, nxt["id"], {"succeeded"})["status"] == "succeeded"


def test_high_runs_before_medium_before_low_when_all_are_queued(client, start_worker, settings):
    # With the default weights: a one-word long clip is low; a busy prompt on a short clip is medium; a very
    # busy prompt, the largest size and the shortest clip is high (see shared/jobs/scoring.py for the formula).
    busy = "a bright golden red dragon slowly flying over misty blue mountains"
    low = submit(client, prompt="boat", width=64, height=64, duration_s=3.0, fps=4)
    medium = submit(client, prompt=", ".join([busy] * 5), width=64, height=64, duration_s=1.0, fps=4)
    high = submit(client, prompt=", ".join([busy] * 12), width=448, height=448, duration_s=0.25, fps=4, steps=1)
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
    from sqlalchemy import update

    from shared.models import Job

    job = submit(client, prompt="boat", width=64, height=64, duration_s=3.0, fps=4)
    assert job["queue"] == "video.low"
    aging = sweeper(settings.model_copy(update={"aging_promote_after_s": 60.0}))
    r = redis.Redis.from_url(str(settings.broker_url), socket_timeout=5)

    def depth(queue: str) -> int:
        # This session's queues only: other suites may share the Redis database under their own prefix.
        return int(r.llen(queue_key(settings, queue)))

    def sent_to(queue: str) -> None:
        # A send is recorded (queue, enqueued_at) by a background thread of the sender's process: wait for it.
        wait_until(
            lambda: db_job(settings, job["id"]).queue == queue and db_job(settings, job["id"]).enqueued_at is not None,
            timeout_s=10,
            what=f"the send to {queue} on record",
        )
        assert depth(queue) == 1

    def waited_a_minute() -> None:
        # The job's last send a minute earlier: past aging_promote_after_s without waiting for it.
        with session_scope(settings) as session:
            session.execute(
                update(Job)
                .where(Job.id == uuid.UUID(job["id"]))
                .values(enqueued_at=Job.enqueued_at - timedelta(seconds=61))
            )

    sent_to("video.low")
    assert depth("video.medium") == 0
    assert aging.sweep_once().promoted == []  # not yet waited long enough
    waited_a_minute()
    assert aging.sweep_once().promoted == [uuid.UUID(job["id"])]
    sent_to("video.medium")
    waited_a_minute()
    assert aging.sweep_once().promoted == [uuid.UUID(job["id"])]
    sent_to("video.high")
    waited_a_minute()
    assert aging.sweep_once().promoted == []  # high is the top: no further sends
    assert depth("video.high") == 1
