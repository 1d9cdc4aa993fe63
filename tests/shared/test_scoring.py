from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.infra.config import Settings
from shared.jobs.scoring import complexity, duration_factor, node_count, resolution_factor, score_job
from shared.queues import PriorityClass
from shared.spec import frames_for


def test_node_count_is_documented_and_deterministic():
    # 3 words, 1 clause (+2), 0 modifiers
    assert node_count("a red boat") == 3 + 2 + 1  # "red" is a modifier word
    # words 6, clauses 2 ("a fox runs", "then jumps quickly"), modifiers 1 ("quickly")
    assert node_count("a fox runs, then jumps quickly") == 6 + 4 + 1
    assert node_count("  ") == 0 + 2 + 0


# words 13; clauses 3 ("A Bright golden dragon", "flying slowly over misty mountains", "a quiet lake", split at the
# comma and at "and"); modifiers 4 (bright, golden, misty from the list; slowly by -ly)
RICH = "A Bright golden dragon, flying slowly over misty mountains and a quiet lake"
RICH_NODES = 13 + 2 * 3 + 4


def test_node_count_ignores_spacing_and_case():
    # Words are runs of letters, so spacing cannot count; connectives and modifier words match in any case.
    assert node_count(RICH) == RICH_NODES
    spaced = "  A   Bright golden\tdragon ,flying slowly over\nmisty mountains AND a quiet lake "
    assert node_count(spaced) == RICH_NODES
    assert node_count(RICH.upper()) == node_count(RICH.lower()) == RICH_NODES


def test_node_count_is_the_same_in_another_interpreter():
    # The score picks the queue, so every API replica must count alike: a fresh interpreter with another hash seed
    # (set and str iteration orders change with it) gives the documented count too.
    seed = "1" if os.environ.get("PYTHONHASHSEED") != "1" else "2"
    code = f"from shared.jobs.scoring import node_count; print(node_count({RICH!r}))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONHASHSEED": seed},
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert int(out.stdout) == RICH_NODES


def test_complexity_saturates_at_one():
    assert complexity("boat " * 500, node_norm=200) == 1.0
    assert 0 < complexity("boat", node_norm=200) < 0.05


@pytest.mark.parametrize(("w", "h", "expected"), [(16, 16, 0.3), (2048, 2048, 1.0), (4096, 4096, 1.0)])
def test_resolution_factor_bounds(w, h, expected):
    assert resolution_factor(w, h) == pytest.approx(expected, abs=1e-3)


def test_resolution_factor_grows_with_pixels():
    sizes = [(64, 64), (416, 240), (832, 480), (1280, 720), (1920, 1088)]
    values = [resolution_factor(w, h) for w, h in sizes]
    assert values == sorted(values) and all(0.3 <= v <= 1.0 for v in values)


@pytest.mark.parametrize(("s", "d"), [(0.05, 1.0), (0.1, 1.0), (1.0, 1.0), (2.0, 0.5), (10.0, 0.1), (60, 1 / 60)])
def test_duration_factor(s, d):
    assert duration_factor(s) == pytest.approx(d)


def test_score_weights_and_classes_follow_settings():
    s = Settings()
    sc = score_job(s, prompt="boat", width=64, height=64, duration_s=3.0)
    assert sc.value == pytest.approx(0.4 * sc.complexity + 0.35 * sc.resolution + 0.25 * sc.duration, abs=1e-3)
    assert sc.priority_class is PriorityClass.LOW
    lenient = Settings(score_high=0.1, score_medium=0.05)
    assert score_job(lenient, prompt="boat", width=64, height=64, duration_s=3.0).priority_class is PriorityClass.HIGH
    busy = ", ".join(["a bright golden red dragon slowly flying over misty blue mountains"] * 12)
    assert score_job(s, prompt=busy, width=448, height=448, duration_s=0.25).priority_class is PriorityClass.HIGH


def test_class_maps_to_queue_and_promotes():
    assert PriorityClass.LOW.queue == "video.low"
    assert PriorityClass.LOW.promoted() is PriorityClass.MEDIUM
    assert PriorityClass.HIGH.promoted() is PriorityClass.HIGH


@pytest.mark.parametrize(
    ("dur", "fps", "frames"), [(1.0, 8, 9), (2.0, 16, 33), (0.25, 4, 1), (5.0, 16, 81), (1.0, 10, 13)]
)
def test_frames_are_4k_plus_1_and_cover_the_duration(dur, fps, frames):
    assert frames_for(dur, fps) == frames
    assert (frames - 1) % 4 == 0 and frames >= dur * fps
