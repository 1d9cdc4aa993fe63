"""One thread of a pool process does all of its GPU work: it builds the models, warms them up and renders every job.

The CUDA libraries keep state per thread: cuDNN's execution plans (and its autotuner's choices), cuBLAS's handles
and workspaces. Celery runs tasks on the pool process's main thread, while the models load on another (a load can
outlast Celery's start-up timeout). Were the job rendered on the task's thread, the first job would rebuild all of
that state that the warm-up had built on the loading thread — measured on an H200 at 480×832×33: 2.1 s more for the
first job than for the next. So the loading thread stays, and the task thread hands each render to it and waits.

A render handed over runs in the caller's context (its trace span, so a stage's span keeps its parent). If the
caller stops waiting (Celery's soft time limit is raised in the task's thread), the render is abandoned: it stops
at its next denoising step and the caller's exception goes on.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")

ABANDON_WAIT_S = 60.0  # how long a caller that stops waiting gives the render to reach its next step and end


class RenderAbandoned(Exception):
    """Raised inside a render whose caller has stopped waiting for it (soft time limit)."""


class GpuThread:
    """A daemon thread running the callables handed to it, one at a time, in order."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._work: queue.SimpleQueue[tuple[Callable[[], object], Future[object]]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="vidq-gpu", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            fn, future = self._work.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the caller whatever it is (a cancel, an OOM, a bug)
                future.set_exception(exc)

    def alive(self) -> bool:
        return self.pid == os.getpid() and self._thread.is_alive()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the thread, in the caller's context (contextvars: the current trace span)."""
        context = contextvars.copy_context()
        future: Future[T] = Future()
        self._work.put((lambda: context.run(fn), future))  # type: ignore[arg-type]
        return future

    def run(self, fn: Callable[[threading.Event], T]) -> T:
        """``fn(abandoned)`` on the thread; returns its result or raises its exception. ``abandoned`` is set when
        this caller stops waiting (an exception raised here, e.g. a soft time limit): ``fn`` should then stop at its
        next step (``RenderAbandoned``); the caller waits up to ``ABANDON_WAIT_S`` for that, so two renders never
        overlap, then re-raises."""
        abandoned = threading.Event()
        future = self.submit(lambda: fn(abandoned))
        try:
            return future.result()
        except BaseException:
            if not future.done():
                abandoned.set()
                future.cancel()  # not started yet: never starts
                # Its outcome is moot (the caller's exception goes on); only that it has ended matters.
                with contextlib.suppress(BaseException):
                    future.exception(timeout=ABANDON_WAIT_S)
            raise


_thread: GpuThread | None = None
_lock = threading.Lock()


def gpu_thread() -> GpuThread:
    """This process's GPU thread, started on first use (a forked child starts its own)."""
    global _thread
    with _lock:
        if _thread is None or not _thread.alive():
            _thread = GpuThread()
        return _thread
