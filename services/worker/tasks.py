"""The video task: thin, like a web view. The only argument is the job id; Postgres holds everything else."""

from __future__ import annotations

import time
import uuid

from celery import Task, shared_task
from celery.exceptions import Reject

from services.worker.app import wait_for_models
from services.worker.handback import hand_back
from services.worker.runner import ClaimDeferred, run_job
from shared.queues import TASK_GENERATE, parse_video_queue


@shared_task(name=TASK_GENERATE, bind=True, acks_late=True, ignore_result=True)
def generate(self: Task, job_id: str) -> str:
    started = time.monotonic()
    # The models are built in a background thread of this pool process: no job starts before they are ready.
    if not wait_for_models():
        # Unclaimed, so the message goes back whole; the liveness probe is failing and the process will be replaced.
        raise Reject("models not ready", requeue=True)
    app = self.app
    # The queue the message came from: its class, in this worker's pool.
    lane = parse_video_queue((self.request.delivery_info or {}).get("routing_key"))
    try:
        return run_job(
            uuid.UUID(job_id),
            klass=None if lane is None else lane[0],
            pool=app.settings.worker_pool if lane is None else lane[1],
            settings=app.settings,
            celery=app,
            storage=app.storage,
            progress=app.progress,
        )
    except ClaimDeferred as exc:
        # Postgres has been down for worker_claim_wait_s: put the message back on its queue (a new copy, published
        # before this one is acked) rather than wait into the task's time limit. A job is never given up for an
        # outage, however long; with the broker down too, this message is kept until a copy is out, or requeued
        # (services/worker/handback.py). The next worker to take it waits for the claim again.
        hand_back(self, exc, until=started + app.settings.task_soft_time_limit_s)
