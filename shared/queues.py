"""Queue names and task names: the only contract between the API and the workers (tasks are sent by name).

Video queues are per priority class and per worker pool (shared/pools): the ``stable`` pool's are ``video.high``,
``video.medium`` and ``video.low``; any other pool ``P`` has its own three, ``video.high.P`` … ``video.low.P``, which
only that pool's workers consume, in the same strict order."""

from __future__ import annotations

import enum
import re

STABLE_POOL = "stable"
# A pool name: it ends queue names and Prometheus label values, so short, lower case and without dots.
POOL_NAME = re.compile(r"^[a-z][a-z0-9-]{0,31}$")


class PriorityClass(enum.StrEnum):
    HIGH = "high"
    MEDIUM = "medium"
    LOW = "low"

    @property
    def queue(self) -> Queue:
        """The ``stable`` pool's queue of this class."""
        return Queue(f"video.{self.value}")

    def queue_of(self, pool: str) -> str:
        """This class's queue in ``pool``."""
        return video_queue(self, pool)

    def promoted(self) -> PriorityClass:
        return {self.LOW: self.MEDIUM, self.MEDIUM: self.HIGH, self.HIGH: self.HIGH}[self]


class Queue(enum.StrEnum):
    # Strict priority order: a worker always takes from the first non-empty queue in this order.
    HIGH = "video.high"
    MEDIUM = "video.medium"
    LOW = "video.low"
    WEBHOOKS = "vidq.webhooks"

    @classmethod
    def video(cls) -> list[Queue]:
        return [cls.HIGH, cls.MEDIUM, cls.LOW]


def video_queue(klass: PriorityClass, pool: str = STABLE_POOL) -> str:
    """The queue of ``klass`` in ``pool``."""
    return klass.queue.value if pool == STABLE_POOL else f"{klass.queue.value}.{pool}"


def video_queues(pool: str = STABLE_POOL) -> list[str]:
    """``pool``'s video queues, in the strict order its workers take them."""
    return [video_queue(klass, pool) for klass in PriorityClass]


def parse_video_queue(queue: str | None) -> tuple[PriorityClass, str] | None:
    """(class, pool) of a video queue's name; None for any other name (or none)."""
    if not queue or not queue.startswith("video."):
        return None
    head, _, pool = queue[len("video.") :].partition(".")
    try:
        klass = PriorityClass(head)
    except ValueError:
        return None
    if not pool:
        return klass, STABLE_POOL
    return (klass, pool) if POOL_NAME.match(pool) and pool != STABLE_POOL else None


def class_of_queue(queue: str | None) -> PriorityClass | None:
    """The class whose video queue (of any pool) is ``queue``; None for any other name (or none)."""
    parsed = parse_video_queue(queue)
    return None if parsed is None else parsed[0]


# Task names (dotted constants; the only argument of each is an id).
TASK_GENERATE = "vidq.video.generate"
TASK_DELIVER_WEBHOOK = "vidq.webhooks.deliver"
