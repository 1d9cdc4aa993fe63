"""Request and response bodies, derived from the one definition of a job's parameters (shared/spec.py).

Requests enforce the pipeline's own rules through the types in shared/spec.py; ``JobCreate.to_spec`` resolves the
defaults and checks the operator's caps, so the GPU never sees a request it would reject.
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
import uuid
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from shared.errors import InvalidRequest
from shared.infra.config import Settings
from shared.infra.urls import validate_webhook_url
from shared.spec import (
    ALLOW_DEGRADED_DESCRIPTION,
    PRECISION_DESCRIPTION,
    PRECISIONS,
    STEP_CACHE_DESCRIPTION,
    STEP_CACHES,
    Dimension,
    Fps,
    GenerationSpec,
    GuidanceScale,
    Precision,
    Prompt,
    Seed,
    StepCache,
    Steps,
    Text,
    frames_for,
)

# Presets are landscape; 1080p is 1088 high because Wan needs multiples of 16.
RESOLUTION_PRESETS: dict[str, tuple[int, int]] = {
    "240p": (416, 240),
    "480p": (832, 480),
    "720p": (1280, 720),
    "1080p": (1920, 1088),
}

MetadataValue = str | int | float | bool | None


def _compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class JobCreate(BaseModel):
    """``POST /v1/jobs``: the spec's fields, with a duration instead of a frame count, a resolution preset as an
    alternative to width/height, and defaults (``precision`` left out: the worker's); plus where to send the webhook
    and the caller's metadata."""

    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)

    prompt: Prompt
    negative_prompt: Text = ""
    duration_s: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    fps: Fps = 16
    width: Dimension | None = None
    height: Dimension | None = None
    resolution: Literal["240p", "480p", "720p", "1080p"] | None = None
    steps: Steps = 20
    guidance_scale: GuidanceScale = 5.0
    seed: Seed | None = None
    model: str | None = None
    precision: Precision | None = Field(default=None, description=PRECISION_DESCRIPTION)
    allow_degraded: bool = Field(default=False, description=ALLOW_DEGRADED_DESCRIPTION)
    step_cache: StepCache = Field(default="off", description=STEP_CACHE_DESCRIPTION)
    webhook_url: str | None = None
    metadata: dict[str, MetadataValue] = Field(default_factory=dict)
    cache: bool = Field(
        default=True,
        description="false: always render, never reuse a stored result. true (the default): a job whose resolved "
        "parameters equal those of one of this tenant's succeeded jobs finishes at once with that job's video",
    )

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, MetadataValue]) -> dict[str, MetadataValue]:
        for key, value in v.items():
            if not 1 <= len(key) <= 64 or "\x00" in key:
                raise ValueError("metadata keys must be 1..64 characters without NUL")
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"metadata[{key!r}] must be a finite number (JSON has no NaN or Infinity)")
            if isinstance(value, str) and "\x00" in value:
                raise ValueError(f"metadata[{key!r}] must not contain NUL characters")
        return v

    @field_validator("precision", mode="before")
    @classmethod
    def _precision(cls, v: object) -> object:
        if v is not None and v not in PRECISIONS:  # checked before the type, for a message that names the field
            allowed = " or ".join(repr(p) for p in PRECISIONS)
            raise ValueError(f"precision must be {allowed}, or left out for the worker's default")
        return v

    @field_validator("step_cache", mode="before")
    @classmethod
    def _step_cache(cls, v: object) -> object:
        if v not in STEP_CACHES:  # checked before the type, for a message that names the choices
            allowed = ", ".join(repr(name) for name in STEP_CACHES)
            raise ValueError(f"step_cache must be one of {allowed}")
        return v

    @field_validator("webhook_url")
    @classmethod
    def _webhook(cls, v: str | None) -> str | None:
        # The URL's shape here; whether its host may be private depends on settings (to_spec).
        return None if v is None else validate_webhook_url(v)

    def to_spec(self, settings: Settings) -> GenerationSpec:
        """Resolve defaults (resolution, model, seed) and check the operator's caps. Raises InvalidRequest
        (422) with the field of each problem."""
        problems = self._cap_violations(settings)
        if problems:
            raise InvalidRequest(
                "; ".join(m for _, m in problems),
                details=[{"msg": m} for _, m in problems],
                fields=[f for f, _ in problems],
            )
        width, height = self.size()
        return GenerationSpec(
            model=self.model or settings.default_model,
            prompt=self.prompt,
            negative_prompt=self.negative_prompt,
            width=width,
            height=height,
            num_frames=self.num_frames,
            fps=self.fps,
            steps=self.steps,
            guidance_scale=self.guidance_scale,
            seed=self.seed if self.seed is not None else secrets.randbelow(2**32),
            precision=self.precision,
            allow_degraded=self.allow_degraded,
            step_cache=self.step_cache,
        )

    def size(self) -> tuple[int, int]:
        if self.width is not None and self.height is not None:
            return self.width, self.height
        return RESOLUTION_PRESETS[self.resolution or "480p"]

    @property
    def num_frames(self) -> int:
        return frames_for(self.duration_s, self.fps)

    def _cap_violations(self, s: Settings) -> list[tuple[str | None, str]]:
        """(the field it is about, or None for a combination of fields; the message) of each cap broken."""
        if self.resolution is not None and (self.width is not None or self.height is not None):
            return [(None, "give either resolution or width/height, not both")]
        if (self.width is None) != (self.height is None):
            return [(None, "width and height go together")]
        timing: list[tuple[str | None, str]] = [
            (field, message)
            for failed, field, message in (
                (self.duration_s > s.max_duration_s, "duration_s", f"duration_s must be at most {s.max_duration_s}"),
                (not s.min_fps <= self.fps <= s.max_fps, "fps", f"fps must be between {s.min_fps} and {s.max_fps}"),
            )
            if failed
        ]
        if timing:  # the frame count is only computed from a duration and a rate within their caps (no overflow)
            return timing
        width, height = self.size()
        model = self.model or s.default_model
        checks: list[tuple[bool, str | None, str]] = [
            (
                len(self.prompt) > s.max_prompt_chars,
                "prompt",
                f"prompt is longer than {s.max_prompt_chars} characters",
            ),
            (
                len(self.negative_prompt) > s.max_prompt_chars,
                "negative_prompt",
                f"negative_prompt is longer than {s.max_prompt_chars} characters",
            ),
            (
                not (width <= s.max_width and height <= s.max_height),
                "width",
                f"width must be 16..{s.max_width} and height 16..{s.max_height}",
            ),
            (width * height > s.max_pixels, "width", f"width × height must be at most {s.max_pixels} pixels"),
            (
                self.num_frames > s.max_frames,
                "duration_s",
                f"duration_s × fps gives {self.num_frames} frames; at most {s.max_frames}",
            ),
            (self.steps > s.max_steps, "steps", f"steps must be at most {s.max_steps}"),
            (
                self.guidance_scale > s.max_guidance_scale,
                "guidance_scale",
                f"guidance_scale must be at most {s.max_guidance_scale}",
            ),
            (model not in s.models_allowed, "model", f"model must be one of {s.models_allowed}"),
            (
                len(_compact_json(self.metadata).encode()) > s.max_metadata_bytes,
                "metadata",
                f"metadata must be at most {s.max_metadata_bytes} bytes of JSON (UTF-8, compact)",
            ),
        ]
        problems = [(field, message) for failed, field, message in checks if failed]
        if self.webhook_url is not None:
            try:
                validate_webhook_url(self.webhook_url, allow_private=s.webhook_allow_private)
            except ValueError as exc:
                problems.append(("webhook_url", str(exc)))
        return problems

    def fingerprint(self) -> str:
        """What makes two submissions 'the same request' for Idempotency-Key (the body as sent, canonical).
        ``cache``, ``precision``, ``allow_degraded`` and ``step_cache`` are part of the body (``cache: false``, a
        precision named, ``allow_degraded: true``, a step cache is another request), but left out at their defaults
        so that keys stored before the fields existed still match their retries."""
        unchanged = {"cache"} if self.cache else set()
        if self.precision is None:
            unchanged.add("precision")
        if not self.allow_degraded:
            unchanged.add("allow_degraded")
        if self.step_cache == "off":
            unchanged.add("step_cache")
        body = self.model_dump(mode="json", exclude_none=False, exclude=unchanged)
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


class ScoreOut(BaseModel):
    value: float
    complexity: float
    resolution: float
    duration: float


class ProgressOut(BaseModel):
    step: int
    total: int
    percent: float


class ErrorOut(BaseModel):
    code: str
    message: str


class DegradedFromOut(BaseModel):
    """What a degraded job asked for, and why it was rendered at a lower tier."""

    reason: str = Field(
        description="model_unavailable (its model and shape were failing on the worker) or out_of_memory"
    )
    steps: int
    width: int
    height: int


class MotionOut(BaseModel):
    """How the camera and the subjects move: a readable label, and the video's motion prototype (``m3.17``) and
    variant within its label (``m3.pan_left.2``) in the newest prototype set (null before the first refit)."""

    label: str = Field(
        description="static, pan_left, pan_right, tilt_up, tilt_down, zoom_in, zoom_out, "
        "rotate_cw, rotate_ccw or mixed (the camera's motion, as an editor names it)"
    )
    prototype: str | None = None
    variant: str | None = None


class ContextOut(BaseModel):
    """What the video is about, described by the worker after the job succeeded (absent until then, or when that
    step failed: the video itself is unaffected)."""

    embedding_version: str = Field(description="the keyframe embedding's version; similar videos share it")
    space: str = Field(description="embedding version and model: videos are compared within one space")
    keyframes: int = Field(description="frames embedded: every 8th frame")
    motion: MotionOut


class OutputOut(BaseModel):
    url: str
    expires_at: datetime
    poster_url: str | None
    bytes: int
    sha256: str
    frames: int
    fps: int
    width: int
    height: int
    context: ContextOut | None = None


class EstimateOut(BaseModel):
    """When a waiting or running job is expected to start and finish, quoted from the render times the workers
    measured and the work ahead of it in the queues (higher classes, its share of its own class, what is running)."""

    start_at: datetime
    finish_at: datetime
    gpu_seconds: float = Field(description="seconds of a worker's GPU the job itself is expected to take")
    work_ahead_s: float = Field(description="GPU seconds of work expected to start before this job")
    workers: int = Field(description="workers the quote counts on")


class JobOut(GenerationSpec):
    """A job as the API shows it: its spec's fields, then its state."""

    id: uuid.UUID
    status: str
    duration_s: float
    score: ScoreOut
    priority_class: str
    queue: str
    pool: str = Field(description="the worker pool that renders the job (stable unless a routing rule chose another)")
    routed_by: str = Field(
        description="what chose the pool: default, header (X-Vidq-Pool), tenant (its assignment), split, fallback "
        "(the chosen pool could not take it: stable), rerouted (moved to stable while queued)"
    )
    attempt: int
    cancel_requested: bool
    progress: ProgressOut
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    timings: dict[str, Any]
    error: ErrorOut | None
    output: OutputOut | None
    webhook_url: str | None
    metadata: dict[str, Any]
    result_of: uuid.UUID | None = Field(
        description="the job whose stored video this job reuses (result cache); null when rendered"
    )
    degraded: bool = Field(
        default=False,
        description="true: rendered at a lower tier than asked (allow_degraded); output has the size rendered",
    )
    degraded_from: DegradedFromOut | None = Field(
        default=None, description="for a degraded job: the steps, width and height asked for, and the reason"
    )
    estimate: EstimateOut | None = Field(
        default=None,
        description="the ETA quote of a queued or running job; null once it finished, or while no render of its "
        "model was measured or no worker is alive",
    )
    links: dict[str, str]


class JobPage(BaseModel):
    data: list[JobOut]
    next_cursor: str | None


class SimilarVideo(BaseModel):
    similarity: float = Field(description="cosine similarity of the two videos' keyframe embeddings, −1 to 1")
    job: JobOut


class SimilarPage(BaseModel):
    """The tenant's videos nearest to one video, most similar first (never another tenant's)."""

    job_id: uuid.UUID
    space: str
    data: list[SimilarVideo]
