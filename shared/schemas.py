"""Request and response bodies. Requests enforce the pipeline's own rules (H, W multiples of 16; frames 4k+1;
caps from settings) so the GPU never sees a request it would reject."""

from __future__ import annotations

import hashlib
import json
import math
import secrets
import uuid
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shared.config import get_settings
from shared.spec import frames_for
from shared.webhooks.urls import validate_webhook_url

# Presets are landscape; 1080p is 1088 high because Wan needs multiples of 16.
RESOLUTION_PRESETS: dict[str, tuple[int, int]] = {
    "240p": (416, 240),
    "480p": (832, 480),
    "720p": (1280, 720),
    "1080p": (1920, 1088),
}

MetadataValue = str | int | float | bool | None


class JobCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)

    prompt: Annotated[str, Field(min_length=1)]
    negative_prompt: str = ""
    duration_s: Annotated[float, Field(gt=0)] = 1.0
    fps: int = 16
    width: int | None = None
    height: int | None = None
    resolution: Literal["240p", "480p", "720p", "1080p"] | None = None
    steps: Annotated[int, Field(ge=1)] = 20
    guidance_scale: Annotated[float, Field(ge=0)] = 5.0
    seed: Annotated[int, Field(ge=0, le=2**32 - 1)] | None = None
    model: str | None = None
    webhook_url: str | None = None
    metadata: dict[str, MetadataValue] = Field(default_factory=dict)

    @field_validator("prompt", "negative_prompt")
    @classmethod
    def _text(cls, v: str) -> str:
        if "\x00" in v:  # Postgres text cannot hold NUL
            raise ValueError("text must not contain NUL characters")
        return v

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

    @field_validator("webhook_url")
    @classmethod
    def _webhook(cls, v: str | None) -> str | None:
        return None if v is None else validate_webhook_url(v, allow_private=get_settings().webhook_allow_private)

    @model_validator(mode="after")
    def _caps(self) -> JobCreate:
        s = get_settings()
        if len(self.prompt) > s.max_prompt_chars:
            raise ValueError(f"prompt is longer than {s.max_prompt_chars} characters")
        if len(self.negative_prompt) > s.max_prompt_chars:
            raise ValueError(f"negative_prompt is longer than {s.max_prompt_chars} characters")
        if self.duration_s > s.max_duration_s:
            raise ValueError(f"duration_s must be at most {s.max_duration_s}")
        if not s.min_fps <= self.fps <= s.max_fps:
            raise ValueError(f"fps must be between {s.min_fps} and {s.max_fps}")
        if self.resolution is not None and (self.width is not None or self.height is not None):
            raise ValueError("give either resolution or width/height, not both")
        if (self.width is None) != (self.height is None):
            raise ValueError("width and height go together")
        if self.width is None:
            self.width, self.height = RESOLUTION_PRESETS[self.resolution or "480p"]
        assert self.height is not None
        if self.width % 16 or self.height % 16:
            raise ValueError("width and height must be multiples of 16")
        if not (16 <= self.width <= s.max_width and 16 <= self.height <= s.max_height):
            raise ValueError(f"width must be 16..{s.max_width} and height 16..{s.max_height}")
        if self.width * self.height > s.max_pixels:
            raise ValueError(f"width × height must be at most {s.max_pixels} pixels")
        if self.num_frames > s.max_frames:
            raise ValueError(f"duration_s × fps gives {self.num_frames} frames; at most {s.max_frames}")
        if self.steps > s.max_steps:
            raise ValueError(f"steps must be at most {s.max_steps}")
        if self.guidance_scale > s.max_guidance_scale:
            raise ValueError(f"guidance_scale must be at most {s.max_guidance_scale}")
        model = self.model or s.default_model
        if model not in s.models_allowed:
            raise ValueError(f"model must be one of {s.models_allowed}")
        self.model = model
        if len(json.dumps(self.metadata)) > s.max_metadata_bytes:
            raise ValueError(f"metadata must be at most {s.max_metadata_bytes} bytes of JSON")
        return self

    @property
    def num_frames(self) -> int:
        return frames_for(self.duration_s, self.fps)

    def resolved_seed(self) -> int:
        return self.seed if self.seed is not None else secrets.randbelow(2**32)

    def fingerprint(self) -> str:
        """What makes two submissions 'the same request' for Idempotency-Key (the body as sent, canonical)."""
        body = self.model_dump(mode="json", exclude_none=False)
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


class ErrorDetail(BaseModel):
    code: str
    message: str
    details: Any = None


class ErrorBody(BaseModel):
    """Every error response: a stable code, a message for people, and details where they help."""

    error: ErrorDetail


# The error statuses of the /v1/jobs routes, for the OpenAPI schema (all share ErrorBody).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": text}
    for status, text in [
        (401, "missing or invalid API key"),
        (404, "no such job for this tenant"),
        (409, "the job's state does not allow this"),
        (422, "invalid request"),
    ]
}


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


class JobOut(BaseModel):
    id: uuid.UUID
    status: str
    model: str
    prompt: str
    negative_prompt: str
    width: int
    height: int
    num_frames: int
    fps: int
    duration_s: float
    steps: int
    guidance_scale: float
    seed: int
    score: ScoreOut
    priority_class: str
    queue: str
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
    links: dict[str, str]


class JobPage(BaseModel):
    data: list[JobOut]
    next_cursor: str | None


class WebhookDeliveryOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    event_type: str
    msg_id: str
    attempt: int
    url: str
    ok: bool
    status_code: int | None
    error: str | None
    duration_ms: int
    created_at: datetime
