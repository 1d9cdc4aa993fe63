"""The video task: thin, like a web view. The only argument is the job id; Postgres holds everything else."""

from __future__ import annotations

import uuid
from functools import cache

from services.worker.app import celery, settings
from services.worker.runner import run_job
from shared.queues import TASK_GENERATE
from shared.storage import Storage


@cache
def _storage() -> Storage:
    return Storage(settings)


@celery.task(name=TASK_GENERATE, acks_late=True, ignore_result=True)
def generate(job_id: str) -> str:
    return run_job(uuid.UUID(job_id), settings=settings, celery=celery, storage=_storage())
