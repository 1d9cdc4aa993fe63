"""Liveness files: a long-running loop touches a file each time round; a probe (``vidq worker-alive``,
``vidq sweep-alive``) checks that the file is recent. A loop that is stuck stops touching it, and the orchestrator
restarts the process. No port and no dependency: a Postgres or Redis outage never makes a loop look dead, as long
as it keeps going round (and failing fast).

Here, not in a service, because the worker (a Celery bootstep) and the sweeper (a plain loop) both use it and the
probes must stay cheap to import."""

from __future__ import annotations

import time
from pathlib import Path


def touch(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()


def is_alive(path: Path, *, max_age_s: float) -> bool:
    """True if ``path`` exists and was touched at most ``max_age_s`` seconds ago."""
    try:
        return time.time() - path.stat().st_mtime <= max_age_s
    except FileNotFoundError:
        return False
