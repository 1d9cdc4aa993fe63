"""Starting a worker: one Celery worker in this process (``run``), or one pinned video worker per GPU, supervised
(``run_gpus``). ``vidq worker`` parses its options and calls these; everything a worker needs comes in ``settings``.
"""

from __future__ import annotations

import enum
import os
import tempfile
from collections.abc import Callable

from shared.infra.config import Settings
from shared.queues import STABLE_POOL, Queue, video_queues


class Role(enum.StrEnum):
    VIDEO = "video"  # the video queues of the worker's pool, in strict priority order
    WEBHOOKS = "webhooks"  # webhook deliveries: CPU only, never imports the render code
    ALL = "all"  # every queue of the worker's pool in one worker (the demo, tests)

    def queues(self, pool: str = STABLE_POOL) -> list[str]:
        if self is Role.WEBHOOKS:
            return [Queue.WEBHOOKS.value]
        return video_queues(pool) + ([Queue.WEBHOOKS.value] if self is Role.ALL else [])


def run(settings: Settings, *, role: Role, concurrency: int, name: str, preload: bool) -> int:
    """Run a Celery worker until it stops; returns its exit status (1 when it was stopped hard, mid-job).
    ``preload``: build the default model when a pool process starts (unless ``worker_preload_models`` names the
    models already)."""
    # Pool processes write their metrics here; the main process serves them. prometheus_client takes its
    # multiprocess mode from this variable, read when it is first imported.
    os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="vidq-metrics-"))
    if settings.worker_cpu_affinity:
        from services.worker.gpus import apply_affinity

        apply_affinity([int(c) for c in settings.worker_cpu_affinity.split(",") if c.strip()])
    if role is Role.WEBHOOKS:
        from services.webhooks.app import build
    else:
        from services.worker.app import build

        if preload and not settings.worker_preload_models:  # the pool processes fork with these settings
            settings = settings.model_copy(update={"worker_preload_models": [settings.default_model]})
    celery = build(settings)
    celery.worker_main(
        [
            "worker",
            "--loglevel=INFO",
            f"--queues={','.join(role.queues(settings.worker_pool))}",
            f"--concurrency={concurrency}",
            "--pool=prefork",
            "--prefetch-multiplier=1",
            "--without-gossip",
            "--without-mingle",
            "-E",
            f"--hostname={name or role.value}@%h",
        ]
    )  # returns when the worker has stopped, whatever its exit code
    if role is not Role.WEBHOOKS:
        from services.worker.app import was_hard_stopped

        if was_hard_stopped():  # the pool was killed mid-job: that must not look like a clean stop
            return 1
    return 0


def run_gpus(settings: Settings, spec: str, *, name: str, preload: bool, vidq: Callable[..., list[str]]) -> int:
    """One pinned video worker per chosen GPU (``spec``: 'all' or indices such as '0,2'), each a ``vidq worker``
    process of its own (``vidq(*args)``: the argv of a vidq command), supervised until they stop
    (services/worker/gpus.py). Raises ValueError for a ``spec`` that names no GPU of this machine."""
    from services.worker.gpus import GpuWorkers, list_gpus, select, worker_env
    from shared.infra.logs import configure_logging

    configure_logging(level=settings.log_level, json_logs=settings.log_json)
    chosen = select(list_gpus(), spec)
    extra = [] if preload else ["--no-preload"]
    workers = GpuWorkers(
        chosen,
        argv=lambda gpu: vidq(
            "worker", "--role", "video", "--name", f"{name}-gpu{gpu.index}", "--pool", settings.worker_pool, *extra
        ),
        env=lambda gpu, i: worker_env(
            gpu,
            os.environ,
            ordinal=i,
            metrics_port=settings.worker_metrics_port,
            liveness_file=settings.worker_liveness_file,
        ),
    )
    return workers.run()
