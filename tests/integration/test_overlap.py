"""A rendered job is finished (encoded, uploaded, finalized) on the worker's finisher thread while the next job
renders: the order of jobs, fencing, cancel, warm shutdown and a SIGKILL all keep working. Each test holds the
uploads (VIDQ_WORKER_FAULT_HOLD_UPLOAD_FILE) so a job is surely being finished when the test acts."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import update

from shared.infra.db import session_scope
from shared.infra.storage import Storage
from shared.models import Job
from tests.integration.helpers import db_job, process_env, submit, transitions, wait_job
from tests.integration.test_reliability import sweep_until
from tools.processes import wait_for_log, wait_until

STEPS = 2


@pytest.fixture
def upload_hold(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "hold-upload"
    path.touch()
    yield path
    path.unlink(missing_ok=True)


def overlapping_worker(start_worker, procs, upload_hold: Path) -> str:
    with process_env(procs, VIDQ_WORKER_FAULT_HOLD_UPLOAD_FILE=str(upload_hold)):
        return start_worker("video")


def rendered(client, job_id: str) -> dict:
    """Wait until the job's render is done (every step recorded) while it is still running: being finished."""
    return wait_job(client, job_id, {"running"}, min_step=STEPS, timeout_s=120)


def test_the_next_jobs_render_while_one_is_finished_in_order_with_cancel(
    client, start_worker, procs, settings, upload_hold
):
    overlapping_worker(start_worker, procs, upload_hold)
    jobs = [submit(client, seed=seed, steps=STEPS) for seed in range(5)]
    ids = [job["id"] for job in jobs]

    # Job 0 waits in its upload; job 1 rendered meanwhile and waits for the finisher; job 2 rendered too and its
    # task waits to hand it over (one job may wait behind the one being finished): job 3 cannot have started.
    for job_id in ids[:3]:
        rendered(client, job_id)
    assert db_job(settings, ids[0]).status == "running"
    assert db_job(settings, ids[3]).status == "queued"

    # A job rendered and waiting to be finished is cancelled: its finish sees the cancel before its upload.
    assert client.post(f"/v1/jobs/{ids[1]}/cancel").status_code in (200, 202)
    upload_hold.unlink()

    done = [wait_job(client, job_id, {"succeeded", "cancelled", "failed"}, timeout_s=120) for job_id in ids]
    assert [job["status"] for job in done] == ["succeeded", "cancelled", "succeeded", "succeeded", "succeeded"]
    assert all(job["attempt"] == 1 for job in done)
    succeeded = [db_job(settings, job_id) for job_id in ids if job_id != ids[1]]
    # Claimed in submission order and finalized in the order they rendered.
    assert [job.started_at for job in succeeded] == sorted(job.started_at for job in succeeded)
    assert [job.finished_at for job in succeeded] == sorted(job.finished_at for job in succeeded)
    cancelled = transitions(settings, ids[1])
    assert cancelled[-1][1] == "cancelled" and "succeeded" not in {to for _, to, _ in cancelled}


def test_a_job_whose_lease_went_to_another_attempt_during_its_finish_is_not_finalized(
    client, start_worker, procs, settings, tenant_key, upload_hold
):
    name = overlapping_worker(start_worker, procs, upload_hold)
    job = submit(client, steps=STEPS)
    rendered(client, job["id"])
    # Another attempt owns the job now (as after a lease expiry and a re-claim elsewhere).
    with session_scope(settings) as session:
        session.execute(update(Job).where(Job.id == uuid.UUID(job["id"])).values(attempt=Job.attempt + 1))
    wait_for_log(procs, name, "lease lost; another attempt owns the job", timeout_s=30)
    upload_hold.unlink()

    assert db_job(settings, job["id"]).status == "running"
    assert "succeeded" not in {to for _, to, _ in transitions(settings, job["id"])}
    assert Storage(settings).list_keys(f"videos/{tenant_key['tenant_id']}/") == []


def test_sigkill_while_jobs_are_being_finished_loses_nothing(
    client, start_worker, procs, settings, tenant_key, upload_hold
):
    first = overlapping_worker(start_worker, procs, upload_hold)
    ids = [submit(client, seed=seed, steps=STEPS)["id"] for seed in range(2)]
    for job_id in ids:  # job 0 in its upload, job 1 rendered and waiting for the finisher; both tasks acked
        rendered(client, job_id)
    procs.kill(first)  # SIGKILL to the whole process group
    upload_hold.unlink()

    start_worker("video")
    # Their leases expire unrenewed; the sweeper re-queues both; the new worker renders them again.
    sweep_until(settings, lambda: all(db_job(settings, i).attempt == 2 for i in ids), timeout_s=60)
    for job_id in ids:
        done = wait_job(client, job_id, {"succeeded", "failed"}, timeout_s=120)
        assert done["status"] == "succeeded" and done["attempt"] == 2
        assert transitions(settings, job_id) == [
            ("queued", "running", 1),
            ("running", "queued", 1),
            ("queued", "running", 2),
            ("running", "succeeded", 2),
        ]
    tenant = tenant_key["tenant_id"]
    keys = Storage(settings).list_keys(f"videos/{tenant}/")
    assert sorted(keys) == sorted(f"videos/{tenant}/{i}.{ext}" for i in ids for ext in ("mp4", "jpg"))


def test_a_warm_shutdown_finishes_the_jobs_already_rendered(client, start_worker, procs, settings, upload_hold):
    name = overlapping_worker(start_worker, procs, upload_hold)
    job = submit(client, steps=STEPS)
    rendered(client, job["id"])  # its task has returned: only the finisher holds the job now
    proc = procs.procs[name]
    os.killpg(proc.pid, signal.SIGTERM)
    wait_for_log(procs, name, "finishing rendered jobs before exit", timeout_s=60)
    assert proc.poll() is None  # waiting for the finish
    upload_hold.unlink()

    done = wait_job(client, job["id"], {"succeeded", "failed"}, timeout_s=60)
    assert done["status"] == "succeeded" and done["attempt"] == 1
    wait_until(lambda: proc.poll() is not None, timeout_s=60, what="the worker's exit")
    assert proc.poll() == 0
