"""Dynamic batching with a real worker process, Postgres and Redis: jobs waiting together form a batch within the
window, incompatible jobs never share one, and every member keeps its own cancel, fencing and recovery (a SIGKILL
mid-batch loses no member). The worker here runs with a batch table that batches tiny-wan's small shapes by up to 4;
the session's other workers have none (every job alone). While the hold file exists, a batch's loop holds in the
first member's step (each member's step checks only its own job), which is how these tests catch a batch mid-way."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import func, select, update

from shared.infra.db import session_scope
from shared.models import Job
from tests.integration.helpers import db_job, submit, sweeper, wait_job
from tools.processes import ProcessGroup, vidq_argv, wait_for_log, wait_until

MAX_BATCH = 4


@pytest.fixture
def batching(procs: ProcessGroup, tmp_path: Path) -> Iterator[ProcessGroup]:
    table = tmp_path / "batch-table.json"
    shape = {"model": "tiny-wan", "frames": 17, "height": 64, "width": 64, "max_batch": MAX_BATCH}
    table.write_text(json.dumps({"device": "cpu", "gain": 1.3, "shapes": [shape]}))
    group = ProcessGroup(
        env={**procs.env, "VIDQ_WORKER_BATCH_TABLE": str(table)}, log_dir=procs.log_dir, spawn=procs.spawn
    )
    yield group
    group.kill_all()


def start(group: ProcessGroup) -> str:
    name = f"batch-worker-{os.urandom(2).hex()}"
    group.start(name, vidq_argv("worker", "--role", "video", "--name", name))
    wait_for_log(group, name, "pipeline loaded", timeout_s=120)
    return name


def sent(settings, ids: list[str]) -> None:
    """Wait until every job's message is out (only then may a job ride in another's batch)."""

    def all_sent() -> bool:
        with session_scope(settings) as session:
            waiting = [uuid.UUID(i) for i in ids]
            return session.scalar(select(func.count()).where(Job.id.in_(waiting), Job.enqueued_at.is_(None))) == 0

    wait_until(all_sent, timeout_s=30, what="every job sent")


def batch_of(job: dict) -> int:
    return int(job["timings"].get("batch", 1))


def test_jobs_waiting_together_render_as_one_batch_each_its_own_video(client, batching, settings):
    jobs = [submit(client, seed=i)["id"] for i in range(MAX_BATCH)]
    sent(settings, jobs)
    start(batching)
    done = [wait_job(client, j, {"succeeded"}) for j in jobs]
    assert [batch_of(j) for j in done] == [MAX_BATCH] * MAX_BATCH
    assert len({j["output"]["sha256"] for j in done}) == MAX_BATCH  # each its own seed, its own video
    assert all(j["progress"]["step"] == j["steps"] and j["attempt"] == 1 for j in done)


def test_incompatible_jobs_never_share_a_batch(client, batching, settings):
    three = [submit(client, seed=i, steps=3)["id"] for i in range(2)]
    four = [submit(client, seed=i, steps=4)["id"] for i in range(2)]
    # Three steps too, but with a step cache (a field stored only when set): never with the jobs that have none.
    cached = [submit(client, seed=i, steps=3, step_cache="taylor2")["id"] for i in range(2)]
    sent(settings, three + four + cached)
    start(batching)
    for group in (three, four, cached):
        done = [wait_job(client, j, {"succeeded"}) for j in group]
        assert [batch_of(j) for j in done] == [2, 2]  # each with its own kind only
        assert {j["steps"] for j in done} == {done[0]["steps"]}
        assert {j["step_cache"] for j in done} == {"taylor2" if group is cached else "off"}
        caches = [j["timings"]["precision"].get("step_cache") for j in done]
        assert caches == (
            [{"preset": "taylor2", "computed_steps": 3, "steps": 3}] * 2 if group is cached else [None] * 2
        )


def test_a_cancelled_member_stops_and_the_rest_of_the_batch_finishes(client, batching, settings, hold):
    jobs = [submit(client, seed=i)["id"] for i in range(3)]
    sent(settings, jobs)
    hold.on()  # every member holds after each step: the cancel surely lands mid-batch
    start(batching)
    for j in jobs:
        wait_job(client, j, {"running"})  # claimed together: one batch
    wait_job(client, jobs[0], {"running"}, min_step=1)  # the loop holds at its first step
    assert client.post(f"/v1/jobs/{jobs[1]}/cancel").status_code == 202
    hold.release()
    wait_job(client, jobs[1], {"cancelled"}, timeout_s=30)  # at its next step
    done = [wait_job(client, j, {"succeeded"}) for j in (jobs[0], jobs[2])]
    assert all(batch_of(j) == 3 for j in done)
    cancelled = client.get(f"/v1/jobs/{jobs[1]}").json()
    assert cancelled["output"] is None and cancelled["progress"]["step"] < cancelled["steps"]


def test_a_member_whose_fencing_token_went_stale_changes_nothing(client, batching, settings, hold):
    jobs = [submit(client, seed=i)["id"] for i in range(2)]
    sent(settings, jobs)
    hold.on()
    start(batching)
    for j in jobs:
        wait_job(client, j, {"running"})
    wait_job(client, jobs[0], {"running"}, min_step=1)  # the loop holds at its first step
    # Another attempt owns the first job now (as if the sweeper had handed it over): this worker's token is stale.
    with session_scope(settings) as session:
        session.execute(update(Job).where(Job.id == uuid.UUID(jobs[0])).values(attempt=Job.attempt + 1))
    stale_attempt = db_job(settings, jobs[0]).attempt
    hold.release()
    other = wait_job(client, jobs[1], {"succeeded"})
    assert batch_of(other) == 2
    row = db_job(settings, jobs[0])
    assert row.status == "running" and row.attempt == stale_attempt and row.output_key is None  # untouched


def test_a_sigkill_mid_batch_loses_no_member(client, batching, settings, hold):
    jobs = [submit(client, seed=i)["id"] for i in range(3)]
    sent(settings, jobs)
    hold.on()
    worker = start(batching)
    for j in jobs:
        wait_job(client, j, {"running"})
    wait_job(client, jobs[0], {"running"}, min_step=1)  # the loop holds at its first step
    batching.kill(worker)  # mid-batch: every member's lease stops being renewed
    hold.release()
    sw = sweeper(settings)

    def all_requeued() -> bool:
        sw.sweep_once()
        return all(db_job(settings, j).status == "queued" for j in jobs)

    wait_until(all_requeued, timeout_s=60, what="every member handed back by the sweeper", interval_s=0.5)
    start(batching)
    done = [wait_job(client, j, {"succeeded"}, timeout_s=120) for j in jobs]
    assert all(j["attempt"] == 2 for j in done)  # each retried once, none lost, none rendered twice
