"""What a worker needs to render one video: a plain, validated value object (no I/O, no torch)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


def frames_for(duration_s: float, fps: int) -> int:
    """Frames for a clip: the smallest 4k+1 that covers ``duration_s`` at ``fps`` (Wan's VAE needs 4k+1)."""
    wanted = max(1, math.ceil(duration_s * fps))
    return 4 * math.ceil((wanted - 1) / 4) + 1


@dataclass(frozen=True, slots=True)
class GenerationSpec:
    model: str
    prompt: str
    negative_prompt: str
    width: int
    height: int
    num_frames: int
    fps: int
    steps: int
    guidance_scale: float
    seed: int

    def __post_init__(self) -> None:
        if self.width % 16 or self.height % 16:
            raise ValueError("width and height must be multiples of 16")
        if (self.num_frames - 1) % 4:
            raise ValueError("num_frames must be 4k+1")
        if self.steps < 1:
            raise ValueError("steps must be >= 1")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GenerationSpec:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__})
