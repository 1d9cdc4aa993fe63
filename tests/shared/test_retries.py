"""The two retry policies (shared/infra/retries.py): how many tries each makes, what they retry, and the
backoff's bounds."""

from __future__ import annotations

import pytest
from tenacity import RetryCallState, retry_if_exception, retry_if_result

from shared.infra.config import Settings
from shared.infra.retries import RetryPolicy, backoff, idempotent, non_idempotent


class Flaky:
    def __init__(self, failures: int) -> None:
        self.failures, self.calls = failures, 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise ConnectionError("down")
        return "ok"


def no_sleep(_: float) -> None:
    pass


def test_the_policies_come_from_settings() -> None:
    settings = Settings()
    assert idempotent(settings) == RetryPolicy(retries=3, base_s=0.1, max_s=1.0)
    assert non_idempotent(settings) == RetryPolicy(retries=2, base_s=0.1, max_s=1.0)


@pytest.mark.parametrize(("policy", "tries"), [(idempotent(Settings()), 4), (non_idempotent(Settings()), 3)])
def test_at_most_the_policys_retries_then_the_last_error(policy: RetryPolicy, tries: int) -> None:
    call = Flaky(failures=10)
    with pytest.raises(ConnectionError):
        policy.retrying(retry=retry_if_exception(lambda e: isinstance(e, ConnectionError)), sleep=no_sleep)(call)
    assert call.calls == tries


def test_a_call_that_recovers_within_the_retries_returns_its_result() -> None:
    call = Flaky(failures=3)
    retrying = idempotent(Settings()).retrying(retry=retry_if_exception(lambda e: True), sleep=no_sleep)
    assert retrying(call) == "ok" and call.calls == 4


def test_errors_not_worth_retrying_are_raised_at_once() -> None:
    call = Flaky(failures=10)
    with pytest.raises(ConnectionError):
        idempotent(Settings()).retrying(retry=retry_if_exception(lambda e: False), sleep=no_sleep)(call)
    assert call.calls == 1


def test_a_result_still_failing_after_the_retries_is_returned_not_raised() -> None:
    calls: list[int] = []

    def answer() -> int:
        calls.append(1)
        return 503

    retrying = non_idempotent(Settings()).retrying(retry=retry_if_result(lambda r: r == 503), sleep=no_sleep)
    assert retrying(answer) == 503 and len(calls) == 3


def test_backoff_doubles_from_100_ms_up_to_1_s_with_jitter() -> None:
    wait = backoff(0.1, 1.0)
    for attempt, bound in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.0), (9, 1.0)]:
        state = RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]
        state.attempt_number = attempt
        waits = [wait(state) for _ in range(200)]
        assert all(0 <= w <= bound + 1e-9 for w in waits)
        assert len(set(waits)) > 1  # jittered, not a fixed delay
