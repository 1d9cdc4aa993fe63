"""The worker's Celery app: tasks registered on the shared app, per-process resources built in the pool child.

``build(settings)`` makes the app; services/worker/main.py runs it (``vidq worker``). CUDA is only touched in the
pool child (the model load thread ``worker_process_init`` starts), never in the parent. The signal handlers below
read the settings of the app that ``build`` made: one app per worker process.

Two faults shape this file:

- Celery kills a new pool process that has not reported ready within ``worker_proc_alive_timeout`` (4 s), so a
  model built inside ``worker_process_init`` that takes longer meant a crashed pool process was never replaced. The
  models are built (and warmed up) on the pool process's GPU thread instead (services/worker/gpu_thread.py: it also
  renders every job), where no start-up timeout applies; the task waits for it
  (``wait_for_models``) before it claims its job, and the pool file (shared/infra/liveness.py) tells the probe whether a
  pool process is loading, ready or stuck. Raising the timeout instead would tie it to a load time nobody knows.
- A SIGTERM to the whole process group (systemd, ``vidq up``) used to kill the pool child mid-job. The pool child
  now ignores SIGTERM, so only the main process reacts (Celery's warm shutdown: no new job, the running one
  finishes). Billiard's own kills of a child (hard time limit, cold shutdown) follow SIGTERM with SIGKILL or are
  preceded by ours (``_install_shutdown_escalation``: a second SIGTERM, SIGQUIT, or the grace period's end kills the
  pool at once).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from celery.signals import setup_logging, worker_init, worker_process_init, worker_process_shutdown, worker_ready

from shared.infra.config import Settings
from shared.infra.db import dispose_engines
from shared.infra.liveness import mark_pool, pool_path
from shared.infra.logs import configure_logging
from shared.infra.tracing import active as active_tracing
from shared.infra.tracing import setup_tracing
from shared.messaging.celery_app import VidqCelery, WorkerApp

log = logging.getLogger("vidq.worker")

# The webhook task is included too, so one worker can serve every queue (``vidq worker --role all``: demo, tests).
_worker = WorkerApp(include=["services.worker.tasks", "services.webhooks.tasks"])


def build(settings: Settings) -> VidqCelery:
    """The worker's Celery app for ``settings``, with its tasks and its liveness step."""
    from services.worker.metrics import LivenessFile

    celery = _worker.build(settings)
    celery.steps["consumer"].add(LivenessFile)
    return celery


@setup_logging.connect
def _logging(**_: Any) -> None:
    # Connecting here stops Celery from installing its own handlers: the worker logs JSON like every service.
    settings = _worker.settings
    configure_logging(level=settings.log_level, json_logs=settings.log_json)


@worker_init.connect
def _init_main(**_: Any) -> None:
    from services.worker.metrics import serve_metrics

    settings = _worker.settings
    # Before any pool process exists: the probe gives the first load its timeout, not the ready file's max age.
    mark_pool(pool_path(Path(settings.worker_liveness_file)), "starting")
    serve_metrics(settings)


# --- models, built in the pool child -------------------------------------------------------------------------------

_models_ready = threading.Event()
_models_failed = threading.Event()


def _load_models() -> None:
    from services.worker.metrics import start_pool_heartbeat
    from shared.render.registry import pipeline_for
    from shared.render.tiers import resolve_tier
    from shared.render.warmup import save_compile_cache, use_compile_cache, warm_up

    settings = _worker.settings
    try:
        if settings.worker_model_load_delay_s:  # test knob: a slow (or never-ending) model load
            time.sleep(settings.worker_model_load_delay_s)
        use_compile_cache(settings.worker_compile_cache_dir)
        tier, _ = resolve_tier(None, settings.worker_precision)
        for model in settings.worker_preload_models:
            pipeline = pipeline_for(model, settings, tier=tier)
            # Ready only once the warm-up shapes have rendered: the first job of such a shape pays no compile.
            warmed = warm_up(pipeline, settings.worker_warmup_shapes)
            log.info(
                "pipeline loaded",
                extra={"model": model, "text_encoder": settings.worker_text_encoder, "warmed_up_s": warmed},
            )
        if settings.worker_warmup_shapes and settings.worker_preload_models:
            save_compile_cache(settings.worker_compile_cache_dir)
    except Exception:
        log.exception("pipeline load failed")
        _models_failed.set()
        mark_pool(pool_path(Path(settings.worker_liveness_file)), "failed")
    else:
        from services.worker.runner import worker_id
        from services.worker.scheduling import start_sampler

        start_pool_heartbeat(settings)
        start_sampler(settings, worker=worker_id())  # how busy this GPU is, for the admission watermark
    finally:
        _models_ready.set()


def wait_for_models() -> bool:
    """In a task: block until this pool process's models are built. False if they never will be (failed, or still
    loading after VIDQ_WORKER_MODEL_LOAD_TIMEOUT_S); the caller gives its message back, unclaimed."""
    settings = _worker.settings
    if not _models_ready.wait(settings.worker_model_load_timeout_s):
        return False
    return not _models_failed.is_set()


@worker_process_init.connect
def _init_child(**_: Any) -> None:
    settings = _worker.settings
    # Only the main process reacts to SIGTERM (a warm shutdown waits for this process's job). Celery already ignores
    # SIGINT here; billiard's kills (hard time limit) escalate to SIGKILL, and so does ours on a hard stop.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    dispose_engines()  # never share a parent's sockets across fork
    setup_tracing("vidq-worker", settings, celery=True)  # here: the pool process runs the tasks (nothing when off)
    mark_pool(pool_path(Path(settings.worker_liveness_file)), "loading")
    # On the thread that renders every job of this process (services/worker/gpu_thread.py): what the warm-up builds
    # per thread in the CUDA libraries is then ready for the first job.
    from services.worker.gpu_thread import gpu_thread

    gpu_thread().submit(_load_models)


@worker_process_shutdown.connect
def _shutdown_child(**_: Any) -> None:
    from services.worker.finisher import drain_current

    # A warm shutdown: the jobs already rendered are finished first (the grace period's end kills the pool anyway).
    if not drain_current(_worker.settings.worker_shutdown_grace_s):
        log.warning("exiting with rendered jobs unfinished; their leases bring them back")
    dispose_engines()
    if (tracing := active_tracing()) is not None:  # a pool process ends without atexit hooks
        tracing.shutdown()


# --- shutdown, in the main process ---------------------------------------------------------------------------------

Handler = Callable[[int, FrameType | None], Any] | int | None


_hard_stopped = threading.Event()


def was_hard_stopped() -> bool:
    """After the worker returns: True if it was stopped hard (Celery then reports 0; ``vidq worker`` exits 1)."""
    return _hard_stopped.is_set()


def _kill_pool() -> None:
    from billiard.process import active_children

    for child in active_children():
        with contextlib.suppress(ProcessLookupError):  # exited meanwhile
            os.kill(child.pid, signal.SIGKILL)


@worker_ready.connect
def _install_shutdown_escalation(**_: Any) -> None:
    """Wrap Celery's handlers (installed by now): the first SIGTERM is Celery's warm shutdown plus a grace timer; a
    second SIGTERM, SIGQUIT or the timer kills the pool (its children ignore SIGTERM, so Celery's own terminate would
    wait for the job) and hands over to Celery's cold shutdown."""
    if threading.current_thread() is not threading.main_thread():
        return
    settings = _worker.settings
    warm: Handler = signal.getsignal(signal.SIGTERM)
    cold: Handler = signal.getsignal(signal.SIGQUIT)
    terms = 0

    def hard_stop(reason: str, frame: FrameType | None) -> None:
        log.warning("hard shutdown: killing the pool", extra={"reason": reason})
        _hard_stopped.set()
        _kill_pool()
        # Celery's teardown should end the process now; never let a stuck one outlive the hard stop.
        backstop = threading.Timer(30.0, os._exit, (1,))
        backstop.daemon = True
        backstop.start()
        if callable(cold):
            cold(signal.SIGQUIT, frame)
        else:
            os._exit(1)

    def on_term(signum: int, frame: FrameType | None) -> None:
        nonlocal terms
        terms += 1
        if terms > 1:
            hard_stop("second SIGTERM", frame)
            return
        log.info("warm shutdown: finishing the running job", extra={"grace_s": settings.worker_shutdown_grace_s})
        timer = threading.Timer(settings.worker_shutdown_grace_s, os.kill, (os.getpid(), signal.SIGQUIT))
        timer.daemon = True  # a worker that finishes in time exits without waiting for it
        timer.start()
        if callable(warm):
            warm(signum, frame)

    def on_quit(signum: int, frame: FrameType | None) -> None:
        hard_stop("SIGQUIT" if terms == 0 else "grace period over", frame)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGQUIT, on_quit)
