"""Circuit breakers: a dependency that keeps failing is left alone for a while instead of being called again and
again, and one call then tests whether it is back.

The rule (every number a setting, ``VIDQ_BREAKER_*``):

- **closed** (calls go through): each call's outcome is counted in a sliding window of ``breaker_window_s`` (60 s).
  Once the window holds at least ``breaker_min_calls`` (20) outcomes and at least ``breaker_failure_ratio`` (50%)
  of them are failures, the breaker **opens**. Fewer calls than that never open it, however many failed.
- **open** (calls are refused at once, ``CircuitOpen``) for ``breaker_open_s`` (60 s); then
- **half-open**: exactly one call, the probe, is let through; every other call is refused while it runs. The probe
  succeeds → closed, with an empty window; it fails → open again for another ``breaker_open_s``. A probe whose
  outcome says nothing about the dependency (``release``: a cancelled job, say) frees the slot for the next probe.

What counts as a failure is the caller's decision (an S3 outage, not a refused request; a render that failed, not a
cancel), so callers record outcomes themselves: ``allow()`` before the call, then ``success()``, ``failure()`` or
``release()``.

**Breakers live in memory, one set per process.** Each worker process, each webhook worker pool process, learns
on its own that a dependency is down; nothing is shared through Redis or Postgres, so a breaker costs no call of
its own and works while those are down too. A restarted process starts with every breaker closed.

Each breaker's state is the gauge ``vidq_breaker_state{dependency}`` (0 closed, 1 open, 2 half-open), as of the
breaker's last use: an open breaker nobody asks stays 1 after its ``breaker_open_s``. In the worker's
multiprocess metrics every process reports its own (``liveall``: one series per live process).
"""

from __future__ import annotations

import contextlib
import enum
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import Gauge

from shared.infra.config import Settings

Clock = Callable[[], float]

STATE = Gauge(
    "vidq_breaker_state",
    "Circuit breaker state by dependency: 0 closed, 1 open, 2 half-open (per process)",
    ["dependency"],
    multiprocess_mode="liveall",
)


class State(enum.IntEnum):
    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


class CircuitOpen(Exception):
    """A call refused by an open (or probing) breaker: the dependency was not called."""

    def __init__(self, dependency: str, retry_after_s: float) -> None:
        super().__init__(f"circuit open for {dependency}; next probe in {retry_after_s:.1f} s")
        self.dependency = dependency
        self.retry_after_s = retry_after_s


@dataclass(frozen=True, slots=True)
class BreakerRule:
    """When a breaker opens and how long it stays open (see the module's docstring)."""

    failure_ratio: float = 0.5
    min_calls: int = 20
    window_s: float = 60.0
    open_s: float = 60.0

    @classmethod
    def from_settings(cls, settings: Settings) -> BreakerRule:
        return cls(
            failure_ratio=settings.breaker_failure_ratio,
            min_calls=settings.breaker_min_calls,
            window_s=settings.breaker_window_s,
            open_s=settings.breaker_open_s,
        )


class CircuitBreaker:
    """One dependency's breaker. Thread-safe; ``clock`` (monotonic seconds) is injectable for tests."""

    def __init__(self, dependency: str, rule: BreakerRule, *, clock: Clock = time.monotonic) -> None:
        self.dependency = dependency
        self.rule = rule
        self._clock = clock
        self._lock = threading.Lock()
        self._outcomes: deque[tuple[float, bool]] = deque()  # (when, failed), oldest first, within the window
        self._failures = 0
        self._opened_at: float | None = None  # set while open or half-open
        self._probing = False  # half-open: the one probe is out
        self._publish(State.CLOSED)

    # --- what callers ask ---------------------------------------------------------------------------------------

    @property
    def state(self) -> State:
        with self._lock:
            return self._state(self._clock())

    def allow(self) -> bool:
        """Whether a call may go now. Closed: yes. Open: no. Half-open: yes for the first caller (the probe), no
        for the others until its outcome is recorded."""
        with self._lock:
            state = self._state(self._clock())
            if state is State.CLOSED:
                return True
            if state is State.HALF_OPEN and not self._probing:
                self._probing = True
                return True
            return False

    def check(self) -> None:
        """``allow()``, raising ``CircuitOpen`` when the call may not go."""
        if not self.allow():
            raise CircuitOpen(self.dependency, self.retry_after_s())

    def retry_after_s(self) -> float:
        """Seconds until the breaker lets a probe through (0 when a call may go, or a probe is out now)."""
        with self._lock:
            if self._opened_at is None:
                return 0.0
            return max(0.0, self._opened_at + self.rule.open_s - self._clock())

    # --- what callers report ------------------------------------------------------------------------------------

    def success(self) -> None:
        with self._lock:
            now = self._clock()
            state = self._state(now)
            if state is State.HALF_OPEN:  # the probe answered: closed, the past forgotten
                self._close()
            elif state is State.CLOSED:
                self._count(now, failed=False)
            # open: a call that started before the breaker opened; it stays open for its open_s

    def failure(self) -> None:
        with self._lock:
            now = self._clock()
            state = self._state(now)
            if state is State.HALF_OPEN:  # the probe failed: open for another open_s
                self._open(now)
                return
            if state is State.OPEN:  # a call that started before the breaker opened: it changes nothing
                return
            self._count(now, failed=True)
            total = len(self._outcomes)
            if total >= self.rule.min_calls and self._failures >= self.rule.failure_ratio * total:
                self._open(now)

    def release(self) -> None:
        """A call that says nothing about the dependency: a probe's slot is free again, nothing is counted."""
        with self._lock:
            self._probing = False

    # --- inside the lock ----------------------------------------------------------------------------------------

    def _state(self, now: float) -> State:
        if self._opened_at is None:
            return State.CLOSED
        if now - self._opened_at < self.rule.open_s:
            return State.OPEN
        self._publish(State.HALF_OPEN)
        return State.HALF_OPEN

    def _count(self, now: float, *, failed: bool) -> None:
        self._outcomes.append((now, failed))
        self._failures += failed
        while self._outcomes and self._outcomes[0][0] <= now - self.rule.window_s:
            _, old = self._outcomes.popleft()
            self._failures -= old

    def _open(self, now: float) -> None:
        self._opened_at, self._probing = now, False
        self._outcomes.clear()
        self._failures = 0
        self._publish(State.OPEN)

    def _close(self) -> None:
        self._opened_at, self._probing = None, False
        self._outcomes.clear()
        self._failures = 0
        self._publish(State.CLOSED)

    def _publish(self, state: State) -> None:
        STATE.labels(self.dependency).set(int(state))


class BreakerSet:
    """One breaker per key (a webhook host, a model and shape) under a common prefix, made on first use. At most
    ``max_keys`` are kept, the least recently used dropped first (with its gauge series), so a stream of distinct
    hosts cannot grow the process or the metrics without bound."""

    def __init__(self, prefix: str, rule: BreakerRule, *, max_keys: int, clock: Clock = time.monotonic) -> None:
        self.prefix, self.rule, self.max_keys, self._clock = prefix, rule, max_keys, clock
        self._lock = threading.Lock()
        self._breakers: OrderedDict[str, CircuitBreaker] = OrderedDict()

    def get(self, key: str) -> CircuitBreaker:
        with self._lock:
            breaker = self._breakers.get(key)
            if breaker is not None:
                self._breakers.move_to_end(key)
                return breaker
            breaker = CircuitBreaker(f"{self.prefix}:{key}", self.rule, clock=self._clock)
            self._breakers[key] = breaker
            while len(self._breakers) > max(1, self.max_keys):
                _, dropped = self._breakers.popitem(last=False)
                with contextlib.suppress(KeyError):  # multiprocess mode keeps its series in files, not here
                    STATE.remove(dropped.dependency)
            return breaker
