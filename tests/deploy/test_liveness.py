"""The liveness probes the deployments run (`vidq worker-alive`, `vidq sweep-alive`) against the loops that feed
them: a file touched each time round, whose age the probe checks. In this process; no service is needed."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from services.sweeper.sweeper import Sweeper
from shared.infra.config import Settings, get_settings
from shared.infra.liveness import is_alive, touch
from tools.cli import app


def age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_a_file_is_alive_while_it_is_recent(tmp_path: Path) -> None:
    path = tmp_path / "made" / "alive"
    assert not is_alive(path, max_age_s=60)
    touch(path)  # creates the folder too
    assert is_alive(path, max_age_s=60)
    age(path, 120)
    assert not is_alive(path, max_age_s=60)


def test_the_sweepers_max_age_follows_its_interval_unless_set() -> None:
    assert Settings(_env_file=None).sweeper_liveness_max_age == 60.0  # type: ignore[call-arg]
    assert Settings(_env_file=None, sweep_interval_s=30).sweeper_liveness_max_age == 180.0  # type: ignore[call-arg]
    explicit = Settings(_env_file=None, sweep_interval_s=30, sweeper_liveness_max_age_s=45)  # type: ignore[call-arg]
    assert explicit.sweeper_liveness_max_age == 45.0


def test_the_sweeper_touches_its_file_after_a_failed_tick_and_removes_it_on_stop(tmp_path: Path) -> None:
    """A Postgres outage fails every tick: the loop still goes round, so the probe must not restart it."""
    path = tmp_path / "alive"
    settings = Settings(_env_file=None, sweeper_liveness_file=str(path), sweep_interval_s=0.01)  # type: ignore[call-arg]
    stop = threading.Event()
    seen_before_tick: list[bool] = []

    def sessions() -> Any:
        seen_before_tick.append(path.exists())
        if len(seen_before_tick) == 2:
            stop.set()
        raise ConnectionRefusedError("postgres is down")

    Sweeper(settings, celery=None, sessions=sessions).run_forever(stop)  # type: ignore[arg-type]
    assert seen_before_tick == [False, True], "the failed first tick should have touched the file"
    assert not path.exists(), "a clean stop removes the file, so the probe fails at once"


@pytest.fixture
def fresh_settings() -> Iterator[None]:
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


@pytest.mark.parametrize(
    ("command", "file_setting", "max_age_setting"),
    [
        ("sweep-alive", "VIDQ_SWEEPER_LIVENESS_FILE", "VIDQ_SWEEPER_LIVENESS_MAX_AGE_S"),
        ("worker-alive", "VIDQ_WORKER_LIVENESS_FILE", "VIDQ_WORKER_LIVENESS_MAX_AGE_S"),
    ],
)
def test_probe_commands_exit_0_only_for_a_recent_file(
    command: str,
    file_setting: str,
    max_age_setting: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fresh_settings: None,
) -> None:
    path = tmp_path / "alive"
    monkeypatch.setenv(file_setting, str(path))
    monkeypatch.setenv(max_age_setting, "30")
    runner = CliRunner()

    def probe() -> int:
        get_settings.cache_clear()
        return runner.invoke(app, [command]).exit_code

    assert probe() == 1  # missing
    touch(path)
    assert probe() == 0
    age(path, 31)
    assert probe() == 1  # stale
