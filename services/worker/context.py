"""The context step: what a finished video is about, described after its job has succeeded — its keyframe
embedding (from the render's pooled latents) and its motion (optical flow of its frames), stored with its motion
prototype in the newest set. The job's MP4 and webhook are out before this runs; a failure here is logged and
counted (``vidq_worker_context_total{outcome="failed"}``) and leaves the job succeeded, without a context."""

from __future__ import annotations

import logging
import time
import uuid

import numpy as np
from prometheus_client import Counter, Histogram

from shared.context import embedding, motion
from shared.context.repository import assign_latest, store_context
from shared.infra.config import Settings
from shared.infra.db import session_scope

log = logging.getLogger("vidq.worker.context")

CONTEXT = Counter("vidq_worker_context_total", "Finished videos described (or not), by outcome", ["outcome"])
CONTEXT_SECONDS = Histogram(
    "vidq_worker_context_seconds",
    "Seconds of the context step per video (motion, embedding, storing)",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)


def describe(
    settings: Settings,
    *,
    job_id: uuid.UUID,
    tenant_id: uuid.UUID,
    model: str,
    frames: np.ndarray,
    keyframes: np.ndarray | None,
) -> str:
    """Describe one succeeded job's video; returns the outcome ("described", "skipped" or "failed"), never raises
    (bar BaseExceptions such as a shutdown)."""
    if not settings.context_enabled:
        return "skipped"
    ctx = {"job_id": str(job_id)}
    started = time.perf_counter()
    try:
        if settings.worker_fault_context:
            raise RuntimeError("context step failed (VIDQ_WORKER_FAULT_CONTEXT test knob)")
        if keyframes is None:
            raise RuntimeError("the render handed over no pooled keyframes")
        moved = motion.analyse(frames)
        _, vector = embedding.embed(keyframes)
        with session_scope(settings) as session:
            store_context(
                session,
                job_id=job_id,
                tenant_id=tenant_id,
                space=embedding.space(model),
                vector=vector,
                keyframes=int(keyframes.shape[0]),
                motion=moved,
            )
            assigned = assign_latest(session, job_id=job_id, motion=moved)
        outcome = "described"
        log.info(
            "video described",
            extra={**ctx, "motion": moved.label, "prototype": str(assigned[1]) if assigned else "none"},
        )
    except Exception as exc:  # the job has succeeded; what describes it is extra
        outcome = "failed"
        log.warning("context step failed; the job stays succeeded without a context", extra={**ctx, "error": repr(exc)})
    CONTEXT.labels(outcome).inc()
    CONTEXT_SECONDS.observe(time.perf_counter() - started)
    return outcome
