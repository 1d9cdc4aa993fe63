"""Queue names and task names: the only contract between the API and the workers (tasks are sent by name)."""

from __future__ import annotations

import enum


class PriorityClass(enum.StrEnum):
    HIGH = "high"
    MEDIUM = "medium"
    LOW = "low"

    @property
    def queue(self) -> Queue:
        return Queue(f"video.{self.value}")

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


def class_of_queue(queue: str | None) -> PriorityClass | None:
    """The class whose video queue is ``queue``; None for any other name (or none)."""
    for klass in PriorityClass:
        if klass.queue.value == queue:
            return klass
    return None


# Task names (dotted constants; the only argument of each is an id).
TASK_GENERATE = "vidq.video.generate"
TASK_DELIVER_WEBHOOK = "vidq.webhooks.deliver"
