"""Liveness files: a long-running loop touches a file each time round; a probe (``vidq worker-alive``,
``vidq sweep-alive``) checks that the file is recent. A loop that is stuck stops touching it, and the orchestrator
restarts the process. No port and no dependency: a Postgres or Redis outage never makes a loop look dead, as long
as it keeps going round (and failing fast).

A worker has a second file, ``<liveness file>.pool``, written by its pool process: the consumer loop can go round
for ever while no pool process can take a job (one that crashed and whose replacement cannot build its model). It
holds a state: ``starting`` (the main process, before any pool process exists), ``loading`` (a pool process builds
its models), ``ready`` (rewritten periodically by a pool process with its models built) or ``failed``.

Here, not in a service, because the worker (a Celery bootstep) and the sweeper (a plain loop) both use it and the
probes must stay cheap to import."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Literal

PoolState = Literal["starting", "loading", "ready", "failed"]


def touch(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()


def is_alive(path: Path, *, max_age_s: float) -> bool:
    """True if ``path`` exists and was touched at most ``max_age_s`` seconds ago."""
    try:
        return time.time() - path.stat().st_mtime <= max_age_s
    except FileNotFoundError:
        return False


def pool_path(liveness_file: Path) -> Path:
    return liveness_file.with_name(liveness_file.name + ".pool")


def mark_pool(path: Path, state: PoolState) -> None:
    """Write ``state`` and refresh the file's age; atomic, so a probe never reads half a word."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(state)
    os.replace(tmp, path)


def pool_problem(path: Path, *, max_age_s: float, load_timeout_s: float) -> str | None:
    """Why no pool process can take a job, or None. No file: a worker without pool signal (the webhook worker)."""
    try:
        age = time.time() - path.stat().st_mtime
        state = path.read_text().strip()
    except FileNotFoundError:
        return None
    if state == "failed":
        return "model load failed"
    if state in ("starting", "loading"):
        # The age of a load is the time since it began: it may take tens of seconds, but not for ever.
        return None if age <= load_timeout_s else f"no pool process ready {age:.0f} s after it was {state}"
    # ready, rewritten by a live pool process every max_age_s / 4: stale means it died and none replaced it.
    return None if age <= max_age_s else f"pool process silent for {age:.0f} s"
