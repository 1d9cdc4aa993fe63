"""What a worker tells the scheduler: how busy its GPU is (the admission watermark, shared/scheduling/watermark.py),
how many jobs it finished (the service rate), and what each render cost (the ETA quotes, shared/scheduling/costs.py).

A daemon thread of the pool process samples every ``scheduling_sample_s``: the GPU's utilisation from NVML when the
process renders on a GPU NVML can see, otherwise (a CPU worker) whether a render is running right then (``busy``).
It smooths the samples (EWMA, ``scheduling_util_alpha``) and publishes the result to Redis under this worker's id.
``job_done`` counts each finished job there, for the fleet's service rate, and ``render_cost`` records each render's
stage seconds. All are best effort, with short timeouts: the scheduling Redis being down never touches a render.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import redis

from shared.infra.config import Settings
from shared.infra.redis_clients import broker_client
from shared.messaging.celery_app import VidqCelery
from shared.scheduling import costs
from shared.scheduling.watermark import count_done, publish_utilization
from shared.spec import GenerationSpec

log = logging.getLogger("vidq.worker.utilization")

_rendering = 0
_lock = threading.Lock()


@contextlib.contextmanager
def busy() -> Iterator[None]:
    """Around a render: the CPU worker's utilisation sample is 1 while one runs."""
    global _rendering
    with _lock:
        _rendering += 1
    try:
        yield
    finally:
        with _lock:
            _rendering -= 1


def _busy_sample() -> float:
    return 1.0 if _rendering > 0 else 0.0


def _nvml_sampler(settings: Settings) -> Callable[[], float] | None:
    """The utilisation of the GPU this process renders on (the first one it sees), or None where NVML cannot say
    (no driver, a CPU worker)."""
    if settings.device == "cpu":
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
        handle: Any = (
            pynvml.nvmlDeviceGetHandleByIndex(int(visible))
            if visible.isdigit()
            else pynvml.nvmlDeviceGetHandleByUUID(visible)
        )
        pynvml.nvmlDeviceGetUtilizationRates(handle)
    except Exception:  # no NVIDIA driver or device: the busy fraction instead
        return None
    return lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu) / 100.0


def start_sampler(settings: Settings, *, worker: str) -> None:
    """In a pool process whose models are built: sample, smooth and publish from a daemon thread."""
    sample = _nvml_sampler(settings) or _busy_sample
    client = broker_client(settings, timeout_s=settings.scheduling_redis_timeout_s, retries=0)
    alpha = settings.scheduling_util_alpha

    def run() -> None:
        smoothed: float | None = None
        failing = False
        while True:
            value = sample()
            smoothed = value if smoothed is None else alpha * value + (1 - alpha) * smoothed
            try:
                publish_utilization(client, settings, worker=worker, utilization=smoothed, pool=settings.worker_pool)
                failing = False
            except (redis.RedisError, OSError) as exc:
                if not failing:  # once per outage
                    log.warning("utilisation not published", extra={"error": repr(exc)[:200]})
                failing = True
            time.sleep(settings.scheduling_sample_s)

    threading.Thread(target=run, name="vidq-utilization", daemon=True).start()


def job_done(celery: VidqCelery) -> None:
    """Count one finished job for the service rate; never raises."""
    try:
        count_done(scheduling_client(celery), celery.settings)
    except (redis.RedisError, OSError) as exc:
        log.debug("finished job not counted", extra={"error": repr(exc)[:200]})


def render_cost(celery: VidqCelery, spec: GenerationSpec, stages_s: dict[str, float]) -> None:
    """Record what a render of ``spec`` cost (its stage seconds); never raises."""
    try:
        costs.record(scheduling_client(celery), celery.settings, spec, stages_s)
    except (redis.RedisError, OSError) as exc:
        log.debug("render cost not recorded", extra={"error": repr(exc)[:200]})


def scheduling_client(celery: VidqCelery) -> redis.Redis:
    """This process's client of the scheduling Redis: short timeouts, no retries."""
    settings = celery.settings
    return celery.resource(
        "scheduling-redis", lambda: broker_client(settings, timeout_s=settings.scheduling_redis_timeout_s, retries=0)
    )
