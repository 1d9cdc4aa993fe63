"""Circuit breakers on a fake clock (shared/infra/breakers.py): when they open, how long they stay open, the one
probe of half-open, and what its outcome does."""

from __future__ import annotations

import pytest

from shared.infra.breakers import STATE, BreakerRule, BreakerSet, CircuitBreaker, CircuitOpen, State
from shared.infra.config import Settings


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


RULE = BreakerRule(failure_ratio=0.5, min_calls=20, window_s=60.0, open_s=60.0)


def breaker(clock: Clock, name: str = "dep") -> CircuitBreaker:
    return CircuitBreaker(name, RULE, clock=clock)


def gauge(dependency: str) -> float:
    return STATE.labels(dependency)._value.get()  # type: ignore[attr-defined, no-any-return]


def test_the_rule_comes_from_settings() -> None:
    assert BreakerRule.from_settings(Settings()) == RULE
    custom = Settings(breaker_failure_ratio=0.25, breaker_min_calls=4, breaker_window_s=10, breaker_open_s=5)
    assert BreakerRule.from_settings(custom) == BreakerRule(0.25, 4, 10.0, 5.0)


def test_never_opens_before_min_calls_however_many_failed() -> None:
    clock = Clock()
    b = breaker(clock)
    for _ in range(19):
        b.failure()
    assert b.state is State.CLOSED and b.allow()


def test_opens_at_half_failed_of_twenty_calls() -> None:
    clock = Clock()
    b = breaker(clock, "half")
    for _ in range(10):
        b.success()
    for _ in range(9):
        b.failure()
    assert b.state is State.CLOSED  # 9 failed of 19: too few calls
    b.failure()
    assert b.state is State.OPEN  # 10 failed of 20: half
    assert not b.allow() and gauge("half") == 1
    with pytest.raises(CircuitOpen) as refused:
        b.check()
    assert refused.value.dependency == "half" and refused.value.retry_after_s == 60.0


def test_under_half_failed_stays_closed() -> None:
    clock = Clock()
    b = breaker(clock)
    for _ in range(11):
        b.success()
    for _ in range(10):
        b.failure()
    assert b.state is State.CLOSED  # 10 failed of 21


def test_outcomes_older_than_the_window_leave_it() -> None:
    clock = Clock()
    b = breaker(clock)
    for _ in range(19):
        b.failure()
    clock.now += 61  # those 19 are out of the window
    b.failure()
    assert b.state is State.CLOSED
    for _ in range(18):
        b.failure()
    assert b.state is State.CLOSED  # 19 in the window
    b.failure()
    assert b.state is State.OPEN  # 20 in the window, all failed


def open_breaker(clock: Clock, name: str) -> CircuitBreaker:
    b = breaker(clock, name)
    for _ in range(20):
        b.failure()
    assert b.state is State.OPEN
    return b


def test_stays_open_for_open_s_then_admits_exactly_one_probe() -> None:
    clock = Clock()
    b = open_breaker(clock, "probe")
    clock.now += 59.9
    assert b.state is State.OPEN and not b.allow()
    assert b.retry_after_s() == pytest.approx(0.1)
    clock.now += 0.1
    assert b.state is State.HALF_OPEN and gauge("probe") == 2
    assert b.allow()  # the probe
    assert not b.allow() and not b.allow()  # everyone else waits for its outcome
    assert b.state is State.HALF_OPEN


def test_a_successful_probe_closes_it_with_an_empty_window() -> None:
    clock = Clock()
    b = open_breaker(clock, "closes")
    clock.now += 60
    assert b.allow()
    b.success()
    assert b.state is State.CLOSED and b.allow() and gauge("closes") == 0
    for _ in range(19):  # the failures before it are forgotten: 19 new ones do not reopen it
        b.failure()
    assert b.state is State.CLOSED


def test_a_failed_probe_opens_it_again_for_open_s() -> None:
    clock = Clock()
    b = open_breaker(clock, "reopens")
    clock.now += 60
    assert b.allow()
    b.failure()
    assert b.state is State.OPEN and not b.allow() and gauge("reopens") == 1
    clock.now += 59
    assert not b.allow()
    clock.now += 1
    assert b.allow()  # the next probe


def test_a_probe_that_says_nothing_frees_the_slot() -> None:
    clock = Clock()
    b = open_breaker(clock, "released")
    clock.now += 60
    assert b.allow()
    b.release()
    assert b.state is State.HALF_OPEN
    assert b.allow() and not b.allow()


def test_outcomes_of_calls_that_began_before_it_opened_change_nothing() -> None:
    clock = Clock()
    b = open_breaker(clock, "late")
    b.success()
    b.failure()
    assert b.state is State.OPEN and b.retry_after_s() == 60.0


def test_a_breaker_set_keeps_one_per_key_and_drops_the_least_recently_used() -> None:
    clock = Clock()
    hosts = BreakerSet("webhook", RULE, max_keys=2, clock=clock)
    a = hosts.get("a:443")
    assert a.dependency == "webhook:a:443" and hosts.get("a:443") is a
    hosts.get("b:443")
    hosts.get("a:443")  # a used last: b goes first
    hosts.get("c:443")
    assert hosts.get("a:443") is a
    assert hosts.get("b:443") is not None  # made anew, closed
