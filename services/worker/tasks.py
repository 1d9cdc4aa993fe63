"""The video task: thin, like a web view. The only argument is the job id; Postgres holds everything else."""

from __future__ import annotations

import uuid

from celery import Task, shared_task

from services.worker.runner import run_job
from shared.queues import TASK_GENERATE


@shared_task(name=TASK_GENERATE, bind=True, acks_late=True, ignore_result=True)
def generate(self: Task, job_id: str) -> str:
    app = self.app
    return run_job(uuid.UUID(job_id), settings=app.settings, celery=app, storage=app.storage, progress=app.progress)
