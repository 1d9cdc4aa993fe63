"""A job's generation parameters, defined once.

``GenerationSpec`` is what a worker needs to render one video; it is stored with the job (``jobs.spec``) and the
API's job body extends it (shared/schemas.py ``JobOut``). The request (``JobCreate``) builds its optional fields
from the same annotated types below, so each rule of the pipeline (H, W multiples of 16; frames 4k+1; steps ≥ 1;
…) is written once. Caps that an operator sets (``VIDQ_MAX_*``) are checked in ``JobCreate.to_spec``.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field


def _no_nul(text: str) -> str:
    if "\x00" in text:  # Postgres text cannot hold NUL
        raise ValueError("text must not contain NUL characters")
    return text


def _multiple_of_16(size: int) -> int:
    if size % 16:  # Wan's VAE downsamples by 8 and its transformer patches 2×2
        raise ValueError("width and height must be multiples of 16")
    return size


def _four_k_plus_one(frames: int) -> int:
    if (frames - 1) % 4:  # Wan's VAE compresses time 4× after the first frame
        raise ValueError("num_frames must be 4k+1")
    return frames


Text = Annotated[str, AfterValidator(_no_nul)]
Prompt = Annotated[Text, Field(min_length=1)]
Dimension = Annotated[int, Field(ge=16), AfterValidator(_multiple_of_16)]
NumFrames = Annotated[int, Field(ge=1), AfterValidator(_four_k_plus_one)]
Fps = Annotated[int, Field(ge=1)]
Steps = Annotated[int, Field(ge=1)]
GuidanceScale = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Seed = Annotated[int, Field(ge=0, le=2**32 - 1)]


def frames_for(duration_s: float, fps: int) -> int:
    """Frames for a clip: the smallest 4k+1 that covers ``duration_s`` at ``fps`` (Wan's VAE needs 4k+1)."""
    wanted = max(1, math.ceil(duration_s * fps))
    return 4 * math.ceil((wanted - 1) / 4) + 1


class GenerationSpec(BaseModel):
    """What a worker needs to render one video: every value resolved (no defaults left to the worker)."""

    model_config = ConfigDict(frozen=True)

    model: str
    prompt: Prompt
    negative_prompt: Text
    width: Dimension
    height: Dimension
    num_frames: NumFrames
    fps: Fps
    steps: Steps
    guidance_scale: GuidanceScale
    seed: Seed

    def to_dict(self) -> dict[str, Any]:
        """The stored form (``jobs.spec``, JSON)."""
        return self.model_dump(mode="json")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GenerationSpec:
        return cls.model_validate({name: data[name] for name in cls.model_fields})
