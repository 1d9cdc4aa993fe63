"""Step caching: run the transformer on some denoising steps only, and predict its output on the others.

From one denoising step to the next a diffusion transformer's output changes smoothly. A preset runs the transformer
on the first steps (where the output changes fastest), then on every n-th step, and on the last one; on each step in
between it predicts the guided noise from the last two computed steps by first-order Taylor extrapolation in the
timestep (TaylorSeer's idea, applied to the transformer's whole output):

    predicted(t) = F(t_k) + (F(t_k) − F(t_j)) / (t_k − t_j) · (t − t_k)

where t_k is the last computed step and t_j the one before it. The scheduler steps as usual on the prediction.

It lives in vidq's own denoising loop, not as hooks inside the transformer: the compiled blocks stay whole graphs
(diffusers' block-level caches break them into pieces or need its own pipeline loop), and one job's cache never
touches the pipeline another job shares. How much a preset changes a video depends on the trained weights'
activations: the speed is measured, the quality cost is the model's to show, which is why no job gets it by default.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shared.spec import STEP_CACHES, StepCache


@dataclass(frozen=True, slots=True)
class StepCachePreset:
    """Which denoising steps run the transformer: the first ``warmup``, then one in every ``interval``, and the last
    ``tail``."""

    name: StepCache
    warmup: int
    interval: int
    tail: int

    def computes(self, index: int, total: int) -> bool:
        """Whether step ``index`` (0-based) of ``total`` runs the transformer."""
        if index < self.warmup or index >= total - self.tail:
            return True
        return (index - self.warmup) % self.interval == 0

    def computed_steps(self, total: int) -> int:
        return sum(self.computes(index, total) for index in range(total))


PRESETS: dict[StepCache, StepCachePreset] = {
    "taylor2": StepCachePreset("taylor2", warmup=4, interval=2, tail=1),  # 13 of 20 steps computed
    "taylor3": StepCachePreset("taylor3", warmup=4, interval=3, tail=1),  # 10 of 20
    "taylor4": StepCachePreset("taylor4", warmup=4, interval=4, tail=1),  # 8 of 20
}
assert set(PRESETS) == set(STEP_CACHES) - {"off"}, "every step cache a job may name has a preset"


def preset(name: StepCache) -> StepCachePreset | None:
    """The preset called ``name``; None for "off"."""
    if name == "off":
        return None
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown step cache {name!r}; expected one of {STEP_CACHES}") from None


class StepPredictor:
    """One render's computed outputs, and predictions for the steps its preset skips (no preset: every step runs)."""

    def __init__(self, chosen: StepCachePreset | None, total: int) -> None:
        self.preset, self.total = chosen, total
        self.computed = 0
        self._history: list[tuple[float, torch.Tensor]] = []  # (timestep, output), the latest first; at most two

    def output(self, index: int, timestep: float, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Step ``index``'s output: ``compute()`` on a computed step, else the extrapolation of the last two."""
        if self.preset is None:
            self.computed += 1
            return compute()
        if self.preset.computes(index, self.total) or len(self._history) < 2:
            out = compute()
            self.computed += 1
            self._history = [(timestep, out), *self._history[:1]]
            return out
        (t_k, f_k), (t_j, f_j) = self._history
        slope = (f_k.float() - f_j.float()) / (t_k - t_j)
        return (f_k.float() + slope * (timestep - t_k)).to(f_k.dtype)

    def record(self) -> dict[str, Any]:
        """What a result says about it: the preset and how many steps ran the transformer."""
        name = "off" if self.preset is None else self.preset.name
        return {"preset": name, "computed_steps": self.computed, "steps": self.total}
