"""Reading the video queues without taking from them: which jobs come next, and the texts they will need.

The broker keeps each queue as a Redis list: the API pushes on the left (LPUSH), workers pop from the right
(BRPOP), so the right end is the next job and the left end the newest. Each element is kombu's JSON envelope of a
Celery protocol-2 message whose body's first argument is the job id (shared/messaging/broker.py reads it).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import redis
from sqlalchemy import select

from shared.infra.config import Settings
from shared.infra.db import session_scope
from shared.jobs.status import JobStatus
from shared.messaging.broker import job_id_of
from shared.models import Job
from shared.render.text import texts_of
from shared.spec import GenerationSpec


@dataclass(frozen=True, slots=True)
class QueuedPrompts:
    job_id: uuid.UUID
    model: str
    texts: tuple[str, ...]  # the prompt, and the negative prompt when guidance is on (as the pipeline encodes)


def peek_job_ids(
    client: redis.Redis,
    *,
    prefix: str,
    queues: Sequence[str],
    limit: int,
    order: Literal["next", "newest"],
) -> list[uuid.UUID]:
    """Up to ``limit`` job ids, queue by queue in the order given (the order workers take them): within a queue the
    next to be taken first (``next``) or the newest submission first (``newest``)."""
    ids: list[uuid.UUID] = []
    for queue in queues:
        if len(ids) >= limit:
            break
        want = limit - len(ids)
        if order == "next":
            raw = list(reversed(client.lrange(f"{prefix}{queue}", -want, -1)))
        else:
            raw = client.lrange(f"{prefix}{queue}", 0, want - 1)
        ids.extend(j for j in map(job_id_of, raw) if j is not None)
    return ids[:limit]


def queued_prompts(settings: Settings, job_ids: Sequence[uuid.UUID]) -> list[QueuedPrompts]:
    """The texts of those of ``job_ids`` that are still queued, in the order given (one indexed query)."""
    if not job_ids:
        return []
    with session_scope(settings) as session:
        rows = session.execute(
            select(Job.id, Job.spec).where(Job.id.in_(list(job_ids)), Job.status == JobStatus.QUEUED.value)
        ).all()
    specs = {job_id: GenerationSpec.from_dict(spec) for job_id, spec in rows}
    return [
        QueuedPrompts(j, s.model, texts_of(s.prompt, s.negative_prompt, s.guidance_scale))
        for j in job_ids
        if (s := specs.get(j)) is not None
    ]
