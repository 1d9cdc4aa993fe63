"""The finisher: a rendered job's end — MP4 and poster encoded, uploaded, the job finalized, its webhook sent, the
video described — on a thread of its own, while the task goes on to the next job and the GPU renders it.

Without it the GPU waits between two jobs for everything that is not denoising: on an H200 the MP4 encode alone is
about a second of a six-second render. With it, the task hands the rendered frames over and returns; Celery gives
the pool process its next message at once, and the next claim and render run beside this job's encode and upload.

What keeps that safe:

- Each job keeps its lease (a heartbeat thread) and its fencing token until its finish ends, exactly as inline: a
  cancel still stops its upload, a stale attempt still cannot finalize. A SIGKILL while a job is being finished
  leaves it running under a lease nobody renews; the sweeper hands it back when the lease expires, and it renders
  again. Nothing is lost, only the rendered frames.
- Jobs are finished one at a time in the order they were rendered, so finalize order follows render order.
- At most ``worker_overlap_depth`` rendered jobs wait behind the one being finished: a task that would exceed it
  waits before handing over (an S3 outage slows rendering down instead of piling frames up in memory).
- A warm shutdown finishes what was handed over before the pool process exits (``drain``, from the process's
  shutdown hook), within the shutdown grace.
"""

from __future__ import annotations

import contextvars
import logging
import os
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("vidq.worker.finisher")


class Finisher:
    """A daemon thread running handed-over finishes one at a time, in order, with a bounded wait line."""

    def __init__(self, depth: int) -> None:
        self.pid = os.getpid()
        self._work: queue.Queue[Callable[[], object]] = queue.Queue(maxsize=max(1, depth))
        self._pending = 0  # handed over and not yet done (waiting or running)
        self._idle = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="vidq-finish", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            fn = self._work.get()
            try:
                fn()
            except BaseException:  # a finish handles its job's errors itself; this is a bug, never the thread's end
                log.exception("a finish raised; the job's lease brings it back")
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def alive(self) -> bool:
        return self.pid == os.getpid() and self._thread.is_alive()

    def submit(self, fn: Callable[[], object]) -> None:
        """Queue ``fn`` (run in the caller's context: its trace span); blocks while the wait line is full."""
        context = contextvars.copy_context()
        with self._idle:
            self._pending += 1
        try:
            self._work.put(lambda: context.run(fn))
        except BaseException:
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()
            raise

    def pending(self) -> int:
        with self._idle:
            return self._pending

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every handed-over finish has ended; False if some are still running after ``timeout_s``."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout=timeout_s)


_finisher: Finisher | None = None
_lock = threading.Lock()


def finisher(depth: int) -> Finisher:
    """This process's finisher, started on first use (a forked child starts its own)."""
    global _finisher
    with _lock:
        if _finisher is None or not _finisher.alive():
            _finisher = Finisher(depth)
        return _finisher


def drain_current(timeout_s: float) -> bool:
    """At a pool process's exit: finish what was handed over (True when nothing is left)."""
    current = _finisher
    if current is None or not current.alive():
        return True
    left = current.pending()
    if left:
        log.info("finishing rendered jobs before exit", extra={"jobs": left})
    return current.drain(timeout_s)
