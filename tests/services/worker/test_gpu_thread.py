"""The pool process's GPU thread: every render runs on the one thread that loaded the model, in the caller's context;
a caller that stops waiting (a soft time limit) abandons its render, which ends at its next step."""

from __future__ import annotations

import contextvars
import signal
import threading
import time
from collections.abc import Iterator

import pytest
from celery.exceptions import SoftTimeLimitExceeded

from services.worker.gpu_thread import RenderAbandoned, gpu_thread

current = contextvars.ContextVar("current", default="none")


def test_every_call_runs_on_the_same_thread_in_the_callers_context() -> None:
    current.set("job-1")
    seen = [gpu_thread().run(lambda _: (threading.current_thread().name, current.get())) for _ in range(3)]
    assert seen == [("vidq-gpu", "job-1")] * 3
    assert gpu_thread() is gpu_thread()


def test_an_exception_of_the_render_reaches_the_caller_unchanged() -> None:
    class Cancelled(Exception):
        pass

    def render(_: threading.Event) -> None:
        raise Cancelled("at step 3")

    with pytest.raises(Cancelled, match="at step 3"):
        gpu_thread().run(render)
    assert gpu_thread().run(lambda _: 42) == 42  # the thread goes on


@pytest.fixture
def soft_time_limit() -> Iterator[None]:
    """SIGALRM raises SoftTimeLimitExceeded in the main thread, as Celery's soft time limit does."""

    def expire(_signum: int, _frame: object) -> None:
        raise SoftTimeLimitExceeded()

    previous = signal.signal(signal.SIGALRM, expire)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_caller_that_stops_waiting_abandons_its_render_at_the_next_step(soft_time_limit: None) -> None:
    steps: list[int] = []
    ended: list[BaseException] = []
    started = threading.Event()

    def render(abandoned: threading.Event) -> None:
        try:
            for step in range(100_000):  # ends long before: at the first step after the caller gave up
                started.set()
                if abandoned.is_set():
                    raise RenderAbandoned("the task stopped waiting")
                steps.append(step)
                time.sleep(0.01)
        except BaseException as exc:
            ended.append(exc)
            raise

    signal.setitimer(signal.ITIMER_REAL, 0.3)
    with pytest.raises(SoftTimeLimitExceeded):
        gpu_thread().run(render)
    # The render had ended by the time the caller's exception went on: two renders never overlap.
    assert started.is_set() and len(ended) == 1 and isinstance(ended[0], RenderAbandoned)
    assert 0 < len(steps) < 100_000
    assert gpu_thread().run(lambda abandoned: abandoned.is_set()) is False  # the next render starts afresh
