"""Degraded rendering: the one table of what a lower tier changes, and how a degraded result is recorded.

A job that allows it (``allow_degraded``) and cannot be rendered as asked — its model and shape are failing on the
worker (their circuit breaker is open: ``model_unavailable``), or the GPU runs out of memory even after the
``low_vram`` retry (``out_of_memory``) — is rendered once at the next lower tier instead of failing. Each lever
below is the asked value × its factor (a setting), rounded down to its multiple, never under its floor: with the
defaults, half the denoising steps (at least 1) and each side halved to a multiple of 16 (at least 16), so a
quarter of the pixels. Frames, fps, prompts, seed, guidance and the model stay as asked. There is one lower tier,
not a ladder: a job that fails there fails with the same code.

The job's result says so: ``timings.degraded`` holds the reason and the steps, width and height asked and rendered;
the API shows ``degraded: true`` and ``degraded_from`` (shared/jobs/presenters.py), and ``output`` has the size
rendered. Pure Python: the API reads what this module writes without importing the render code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from shared.infra.config import Settings
from shared.spec import SIZE_MULTIPLE, GenerationSpec

Reason = Literal["model_unavailable", "out_of_memory"]
LEVERS_RECORDED = ("steps", "width", "height")


@dataclass(frozen=True, slots=True)
class Lever:
    field: Literal["steps", "width", "height"]
    factor_setting: Literal["degrade_steps_factor", "degrade_side_factor"]
    multiple: int
    floor: int


# The lower tier, lever by lever.
LOWER_TIER: tuple[Lever, ...] = (
    Lever("steps", "degrade_steps_factor", multiple=1, floor=1),
    Lever("width", "degrade_side_factor", multiple=SIZE_MULTIPLE, floor=SIZE_MULTIPLE),
    Lever("height", "degrade_side_factor", multiple=SIZE_MULTIPLE, floor=SIZE_MULTIPLE),
)


def lower_tier(spec: GenerationSpec, settings: Settings) -> GenerationSpec | None:
    """``spec`` at the next lower tier, or None when no lever can go lower (1 step at 16×16)."""
    changes: dict[str, int] = {}
    for lever in LOWER_TIER:
        asked: int = getattr(spec, lever.field)
        scaled = int(asked * float(getattr(settings, lever.factor_setting)))
        lowered = max(lever.floor, scaled // lever.multiple * lever.multiple)
        if lowered < asked:
            changes[lever.field] = lowered
    return spec.model_copy(update=changes) if changes else None


@dataclass(frozen=True, slots=True)
class Degradation:
    """A job rendered at a lower tier: why, what it asked for, and what rendered."""

    reason: Reason
    asked: GenerationSpec
    rendered: GenerationSpec

    def record(self) -> dict[str, Any]:
        """What ``timings.degraded`` holds (JSON)."""
        return {
            "reason": self.reason,
            "from": {name: getattr(self.asked, name) for name in LEVERS_RECORDED},
            "to": {name: getattr(self.rendered, name) for name in LEVERS_RECORDED},
        }
