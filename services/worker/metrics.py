"""Worker metrics (Prometheus) and the liveness signal.

Celery's prefork pool does the work in child processes, so metrics use prometheus_client's multiprocess mode:
children write to files under ``PROMETHEUS_MULTIPROC_DIR`` (set by ``vidq worker`` before anything imports
prometheus_client) and the main process serves them, with live GPU readings from NVML, on
``VIDQ_WORKER_METRICS_PORT``. NVML is not CUDA: reading it in the parent never initialises CUDA there.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from celery import bootsteps
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

from shared.infra.config import Settings
from shared.infra.liveness import mark_pool, pool_path, touch

log = logging.getLogger("vidq.worker.metrics")

_STAGE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640, 1800)
STAGE_SECONDS = Histogram("vidq_worker_stage_seconds", "Seconds per job stage", ["stage"], buckets=_STAGE_BUCKETS)
# Per worker pool (shared/pools), so a canary and stable show side by side; a worker's pool is its process's.
QUEUE_WAIT = Histogram(
    "vidq_worker_queue_wait_seconds", "From submit to claim", ["priority_class", "pool"], buckets=_STAGE_BUCKETS
)
JOBS = Counter("vidq_worker_jobs_total", "Jobs handled, by outcome", ["outcome", "pool"])
FAILURES = Counter("vidq_worker_failures_total", "Failed jobs, by error code", ["code", "pool"])
_STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32)
RENDER_STEP_SECONDS = Histogram(
    "vidq_worker_render_step_seconds",
    "Denoising seconds per step of a rendered job, by pool, model and shape (WxHxF)",
    ["pool", "model", "shape"],
    buckets=_STEP_BUCKETS,
)
BUSY = Gauge("vidq_worker_busy", "1 while rendering", multiprocess_mode="livesum")


GPU_METRICS = (
    "vidq_worker_gpu_memory_used_bytes",
    "vidq_worker_gpu_memory_total_bytes",
    "vidq_worker_gpu_utilization_ratio",
)


class GpuCollector:
    """Memory and utilisation of every GPU this process can see, read at scrape time."""

    def __init__(self) -> None:
        self._nvml: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
        except Exception:  # no NVIDIA driver (CPU workers): no GPU series
            self._nvml = None

    def collect(self) -> Iterator[Metric]:
        if self._nvml is None:
            return
        nv = self._nvml
        used_name, total_name, util_name = GPU_METRICS
        used = GaugeMetricFamily(used_name, "GPU memory in use", labels=["gpu"])
        total = GaugeMetricFamily(total_name, "GPU memory", labels=["gpu"])
        util = GaugeMetricFamily(util_name, "GPU busy fraction (NVML)", labels=["gpu"])
        for i in range(nv.nvmlDeviceGetCount()):
            handle = nv.nvmlDeviceGetHandleByIndex(i)
            mem = nv.nvmlDeviceGetMemoryInfo(handle)
            used.add_metric([str(i)], float(mem.used))
            total.add_metric([str(i)], float(mem.total))
            util.add_metric([str(i)], nv.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0)
        yield from (used, total, util)


def serve_metrics(settings: Settings, *, gpus: bool = True) -> None:
    """In a worker's main process: one HTTP endpoint with every pool child's metrics, and the GPU readings unless
    ``gpus`` is False (the webhook worker, which renders nothing)."""
    if not settings.worker_metrics_port:
        return
    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    if gpus:
        registry.register(GpuCollector())
    try:
        start_http_server(settings.worker_metrics_port, registry=registry)
    except OSError as exc:  # a second worker on the same host: keep working, say why there are no metrics
        log.warning("metrics port unavailable", extra={"port": settings.worker_metrics_port, "error": str(exc)})
        return
    log.info("metrics served", extra={"port": settings.worker_metrics_port})


class LivenessFile(bootsteps.StartStopStep):  # type: ignore[misc]  # celery ships no types
    """Touches the liveness file from the consumer's event loop: if the loop stalls, the file goes stale and the
    orchestrator's probe (``vidq worker-alive``) fails."""

    requires = {"celery.worker.consumer.tasks:Tasks"}

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        settings = parent.app.settings  # the VidqCelery app this worker runs
        self.path = Path(settings.worker_liveness_file)
        self.interval = liveness_interval(settings)
        self.tref: Any = None

    def start(self, parent: Any) -> None:
        touch(self.path)
        self.tref = parent.timer.call_repeatedly(self.interval, touch, (self.path,))

    def stop(self, parent: Any) -> None:
        if self.tref is not None:
            self.tref.cancel()
        self.path.unlink(missing_ok=True)
        pool_path(self.path).unlink(missing_ok=True)  # a stopped worker's pool must not look ready to the next one


def liveness_interval(settings: Settings) -> float:
    return max(1.0, settings.worker_liveness_max_age_s / 4)


def start_pool_heartbeat(settings: Settings) -> None:
    """In a pool process whose models are built: rewrite the pool file as ``ready`` from a daemon thread, so it goes
    stale when this process dies and no replacement gets its models built (the consumer loop alone would go on)."""
    path = pool_path(Path(settings.worker_liveness_file))
    interval = liveness_interval(settings)

    def beat() -> None:
        while True:
            try:
                mark_pool(path, "ready")
            except OSError as exc:  # a full or read-only disk: the probe will say so; the job goes on
                log.warning("pool liveness file not written", extra={"error": str(exc)})
            time.sleep(interval)

    threading.Thread(target=beat, name="vidq-pool-heartbeat", daemon=True).start()
