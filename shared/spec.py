"""A job's generation parameters, defined once.

``GenerationSpec`` is what a worker needs to render one video; it is stored with the job (``jobs.spec``) and the
API's job body extends it (shared/jobs/schemas.py ``JobOut``). Every field is resolved at submit except ``precision``,
which a job may leave to the worker (``None``: the worker's ``VIDQ_WORKER_PRECISION``). The request (``JobCreate``)
builds its optional fields from the same annotated types below, so each rule of the pipeline (H, W multiples of 16;
frames 4k+1; steps ≥ 1; precision one of ``PRECISIONS``; …) is written once. Caps that an operator sets
(``VIDQ_MAX_*``) are checked in ``JobCreate.to_spec``.

``GenerationSpec.result_key`` is the result cache's match key (README, "Result cache"): two jobs of one tenant
with the same key would render the same video, so the second may reuse the first one's MP4.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field


def _no_nul(text: str) -> str:
    if "\x00" in text:  # Postgres text cannot hold NUL
        raise ValueError("text must not contain NUL characters")
    return text


# Wan's VAE downsamples by 8 and its transformer patches 2×2: width and height are multiples of this.
SIZE_MULTIPLE = 16


def _multiple_of_16(size: int) -> int:
    if size % SIZE_MULTIPLE:
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
# The GPU render's numeric tier (shared/render/tiers.py). exact: bf16 with kernels that keep the math. fast: the
# transformer's matrix products in 8 bits (fp8 where the GPU has it, int8 weights elsewhere), its self-attention in
# fp8 where the GPU has it.
Precision = Literal["exact", "fast"]
PRECISIONS: tuple[Precision, ...] = ("exact", "fast")
PRECISION_DESCRIPTION = (
    "the render's numeric tier: 'exact' (bf16 with kernels that keep the math) or 'fast' (8-bit matrix products in "
    "the transformer: fp8 on GPUs that have it, int8 weights on others; self-attention in fp8 where the GPU has it; "
    "the result names what ran). Null or left "
    "out: the worker's default (VIDQ_WORKER_PRECISION, 'exact' unless the operator changes it)"
)
# Step caching (shared/render/step_cache.py): "off", or a preset that skips the transformer on some denoising steps
# and extrapolates its output there instead.
StepCache = Literal["off", "taylor2", "taylor3", "taylor4"]
STEP_CACHES: tuple[StepCache, ...] = ("off", "taylor2", "taylor3", "taylor4")
STEP_CACHE_DESCRIPTION = (
    "skip the transformer on some denoising steps and predict its output there from the steps computed before "
    "(first-order Taylor extrapolation): 'off' (the default), 'taylor2' (the transformer runs on every 2nd step after "
    "the first four, and on the last), 'taylor3' (every 3rd), 'taylor4' (every 4th). Faster by about the share of "
    "steps skipped; it changes the video, and by how much depends on the model's trained weights"
)
ALLOW_DEGRADED_DESCRIPTION = (
    "true: when this job's model and shape are failing on the worker (their circuit breaker is open) or the GPU runs "
    "out of memory even in low_vram mode, render it at the next lower tier instead of failing (half the steps, each "
    "side halved to a multiple of 16); the result then says degraded: true and degraded_from. false (the default): "
    "such a job fails with model_unavailable or out_of_memory"
)

# Part of every result key (GenerationSpec.result_key): bumping it retires every stored key at once. 2: the fast tier
# renders in 8 bits (under 1, a fast job was rendered as exact, so its stored key names an exact video).
RESULT_KEY_VERSION = 2


def parse_shape(text: str) -> tuple[int, int, int]:
    """``"480x832x33"`` (HEIGHTxWIDTHxFRAMES, as warm-up settings name shapes) → (height, width, frames), checked by
    the same rules as a job's."""
    parts = text.strip().lower().split("x")
    if len(parts) != 3 or not all(part.isdigit() for part in parts):
        raise ValueError(f"a shape is HEIGHTxWIDTHxFRAMES, e.g. 480x832x33; got {text!r}")
    height, width, frames = (int(part) for part in parts)
    if min(height, width) < 16 or frames < 1:
        raise ValueError(f"shape {text!r}: height and width are at least 16, frames at least 1")
    return _multiple_of_16(height), _multiple_of_16(width), _four_k_plus_one(frames)


def frames_for(duration_s: float, fps: int) -> int:
    """Frames for a clip: the smallest 4k+1 that covers ``duration_s`` at ``fps`` (Wan's VAE needs 4k+1)."""
    wanted = max(1, math.ceil(duration_s * fps))
    return 4 * math.ceil((wanted - 1) / 4) + 1


# The fields a batch's videos share (``GenerationSpec.batch_key``).
BATCH_FIELDS = ("model", "precision", "step_cache", "num_frames", "height", "width", "steps", "guidance_scale")


class GenerationSpec(BaseModel):
    """What a worker needs to render one video: every value resolved at submit, except ``precision``, which may be
    left to the worker (``None``: the worker renders in its ``VIDQ_WORKER_PRECISION``).

    Optional fields (those with a default: ``precision`` None, ``allow_degraded`` false) are left out of the stored
    form while at their default and read back as it when a stored spec lacks them: a field added that way changes
    neither the stored spec nor the result key of a job that does not use it (jobs stored before it existed
    included)."""

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
    precision: Precision | None = Field(default=None, description=PRECISION_DESCRIPTION)
    allow_degraded: bool = Field(default=False, description=ALLOW_DEGRADED_DESCRIPTION)
    step_cache: StepCache = Field(default="off", description=STEP_CACHE_DESCRIPTION)

    def to_dict(self) -> dict[str, Any]:
        """The stored form (``jobs.spec``, JSON): every field, except an optional one (one with a default) at its
        default (a job that names no precision, does not allow degrading or uses no step cache is stored, and keyed,
        as before the field existed)."""
        unset = {name for name in type(self).model_fields if self.left_out(name, getattr(self, name))}
        return self.model_dump(mode="json", exclude=unset)

    @classmethod
    def left_out(cls, name: str, value: object) -> bool:
        """Whether the stored form leaves field ``name`` out at ``value``: an optional field at its default."""
        field = cls.model_fields[name]
        return not field.is_required() and value == field.default

    def batch_key(self) -> dict[str, Any]:
        """What videos must share to render in one batch: the model, the precision tier asked for, the step cache, the
        shape, the steps and the guidance (prompts, negative prompts and seeds may differ)."""
        return {name: getattr(self, name) for name in BATCH_FIELDS}

    def result_key(self) -> str:
        """The result cache's match key: sha256 (hex) of the canonical JSON (sorted keys, compact) of EVERY field
        of the spec (an optional one only when set), under a version tag.

        Every field is in it because every field is a render parameter: the spec is exactly what the worker is
        given, so equal specs ask for the same video, and a spec that differs in anything (the model, either
        prompt, the seed, size, frames, fps, steps, guidance, a precision named) may not reuse it. It hashes
        ``to_dict()`` rather than a list of names, so a render parameter added to this class later is in the key
        without anyone remembering to add it; an optional one is in it only when set (``to_dict`` leaves it out at
        its default), so keys made before it existed still match. A job that names no precision is keyed without
        one, so it may reuse a video rendered in whichever tier was the workers' default when that video was made.
        ``step_cache`` is in the key when set: a step-cached video is another video.
        ``allow_degraded`` is in the key when true: such a job may be rendered at a lower tier, so its video never
        serves a job that did not allow that (and a degraded result is never reused at all: the worker clears its
        key, services/worker/runner.py).
        What is not a render parameter (webhook URL, metadata, the request's ``cache`` flag) is not in the spec, so
        not in the key. A request without a seed is given a random one when it is resolved (``JobCreate.to_spec``),
        so it practically never matches: a different seed is a different video. ``RESULT_KEY_VERSION`` is bumped
        when the same spec would render differently (new weights behind a model name, a changed encoder, a tier's
        numbers changed): keys made before then stop matching."""
        document = {"v": RESULT_KEY_VERSION, "spec": self.to_dict()}
        canonical = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(canonical.encode()).hexdigest()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GenerationSpec:
        """A stored spec (``jobs.spec``); a field with a default that the stored form lacks (an optional field left
        out at ``None``, or a spec stored before the field existed) takes its default. A missing required field is
        a KeyError."""
        return cls.model_validate(
            {name: data[name] for name, field in cls.model_fields.items() if name in data or field.is_required()}
        )
