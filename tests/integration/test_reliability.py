"""Crashes lose nothing: a killed worker's job is finished by another, a job committed but never sent is sent by
the sweeper, and a redelivered message for a finished job changes nothing."""

from __future__ import annotations

import time
import uuid

from celery import Celery

from shared.infra.db import session_scope
from shared.infra.storage import Storage
from shared.messaging.celery_app import make_celery
from shared.queues import TASK_GENERATE
from tests.integration.helpers import TINY, db_job, submit, sweeper, transitions, wait_job
from tools.processes import wait_until


def sweep_until(settings, predicate, *, timeout_s: float = 30.0) -> None:
    sw = sweeper(settings)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sw.sweep_once()
        if predicate():
            return
        time.sleep(0.3)
    raise AssertionError("condition never met while sweeping")


def test_sigkill_mid_job_then_a_new_worker_finishes_it_once(client, start_worker, procs, settings, tenant_key, hold):
    first = start_worker("video")
    hold.on()
    job = submit(client)
    wait_job(client, job["id"], {"running"}, min_step=1)  # held after its first step
    procs.kill(first)  # SIGKILL to the whole process group: main process and pool child
    hold.release()

    start_worker("video")
    # The dead worker's lease expires; the sweeper re-queues the job; the new worker claims attempt 2.
    sweep_until(
        settings,
        lambda: db_job(settings, job["id"]).attempt == 2 or db_job(settings, job["id"]).status == "queued",
    )
    done = wait_job(client, job["id"], {"succeeded", "failed"}, timeout_s=120)
    assert done["status"] == "succeeded" and done["attempt"] == 2
    keys = Storage(settings).list_keys(f"videos/{tenant_key['tenant_id']}/")
    assert sorted(keys) == sorted(
        [
            f"videos/{tenant_key['tenant_id']}/{job['id']}.mp4",
            f"videos/{tenant_key['tenant_id']}/{job['id']}.jpg",
        ]
    )
    moves = transitions(settings, job["id"])
    assert moves == [
        ("queued", "running", 1),
        ("running", "queued", 1),
        ("queued", "running", 2),
        ("running", "succeeded", 2),
    ]


def test_commit_then_crash_before_send_the_sweeper_sends_it(client, start_worker, settings, tenant_key):
    from services.api.jobs.service import create_job
    from shared.jobs.schemas import JobCreate
    from shared.models import Tenant

    # The API's own create path, committed, and then "crash": no message is ever sent.
    with session_scope(settings) as session:
        tenant = session.get(Tenant, uuid.UUID(tenant_key["tenant_id"]))
        job = create_job(session, settings, tenant=tenant, body=JobCreate(**TINY))
        job_id = str(job.id)
    start_worker("video")
    follow = submit(client, seed=2)  # sent as usual: once it is done, the worker has read its queue
    wait_job(client, follow["id"], {"succeeded"})
    assert db_job(settings, job_id).status == "queued"  # nobody knows about it yet
    sw, resent = sweeper(settings), list[uuid.UUID]()

    def swept() -> bool:
        resent.extend(sw.sweep_once().resent)
        return uuid.UUID(job_id) in resent

    # A sweep sends it once VIDQ_ENQUEUE_GRACE_S has passed since its commit (by the database's clock).
    wait_until(swept, timeout_s=30, what="the sweeper's send", interval_s=0.2)
    done = wait_job(client, job_id, {"succeeded", "failed"})
    assert done["status"] == "succeeded" and done["attempt"] == 1


def test_redelivered_message_for_a_finished_job_changes_nothing(client, start_worker, procs, settings):
    worker = start_worker("video")
    job = submit(client)
    done = wait_job(client, job["id"], {"succeeded"})
    before = db_job(settings, job["id"])
    moves_before = transitions(settings, job["id"])

    celery: Celery = make_celery(settings)
    celery.send_task(TASK_GENERATE, args=[job["id"]], queue="video.high")
    log = procs.log_dir / f"{worker}.log"
    deadline = time.monotonic() + 30
    while "message dropped" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "message dropped" in log.read_text()
    after = db_job(settings, job["id"])
    assert (after.status, after.attempt, after.output_sha256, after.finished_at) == (
        before.status,
        before.attempt,
        before.output_sha256,
        before.finished_at,
    )
    assert transitions(settings, job["id"]) == moves_before
    assert client.get(f"/v1/jobs/{job['id']}").json()["output"]["sha256"] == done["output"]["sha256"]


def test_poison_job_fails_after_max_attempts(client, start_worker, procs, settings, hold):
    hold.on()  # every attempt holds after its first step: each kill lands mid-render
    job = submit(client)
    for attempt in range(1, settings.max_attempts + 1):
        name = start_worker("video")
        wait_job(client, job["id"], {"running"}, min_step=1, timeout_s=60)
        procs.kill(name)
        assert db_job(settings, job["id"]).attempt == attempt
        sweep_until(settings, lambda: db_job(settings, job["id"]).status in {"queued", "failed"})
    final = client.get(f"/v1/jobs/{job['id']}").json()
    assert final["status"] == "failed" and final["error"]["code"] == "max_attempts_exceeded"
    assert final["attempt"] == settings.max_attempts
