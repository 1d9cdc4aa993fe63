"""The one definition of a job: request → spec → response, each rule in one place (no services needed)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from shared.errors import InvalidRequest
from shared.infra.config import Settings
from shared.jobs.schemas import JobCreate, JobOut
from shared.spec import GenerationSpec

SETTINGS = Settings(env="test")


def test_to_spec_resolves_preset_default_model_and_frames() -> None:
    spec = JobCreate(prompt="a red boat", resolution="240p", duration_s=1.0, fps=16, seed=3).to_spec(SETTINGS)
    assert (spec.width, spec.height, spec.num_frames, spec.model, spec.seed) == (416, 240, 17, "tiny-wan", 3)


def test_seed_is_drawn_when_absent() -> None:
    seeds = {JobCreate(prompt="x").to_spec(SETTINGS).seed for _ in range(5)}
    assert len(seeds) > 1 and all(0 <= s < 2**32 for s in seeds)


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "x", "width": 100, "height": 64},  # not a multiple of 16
        {"prompt": "x", "steps": 0},
        {"prompt": "x\x00"},
        {"prompt": "x", "duration_s": float("inf")},
        {"prompt": "x", "guidance_scale": float("nan")},
    ],
)
def test_pipeline_rules_refuse_at_parse(body: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        JobCreate.model_validate(body)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"prompt": "x", "duration_s": 1e308}, "duration_s must be at most"),  # no OverflowError on frames
        ({"prompt": "x", "fps": 10**30}, "fps must be between"),
        ({"prompt": "x", "steps": 1000}, "steps must be at most"),
        ({"prompt": "x", "model": "nope"}, "model must be one of"),
        ({"prompt": "x", "resolution": "480p", "width": 64, "height": 64}, "not both"),
        ({"prompt": "x", "width": 64}, "go together"),
        ({"prompt": "x", "webhook_url": "http://127.0.0.1/hook"}, "loopback"),
    ],
)
def test_operator_caps_are_a_422(body: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message) as caught:
        JobCreate.model_validate(body).to_spec(SETTINGS)
    assert caught.value.status_code == 422


def test_private_webhook_allowed_only_when_the_setting_says_so() -> None:
    body = JobCreate(prompt="x", webhook_url="http://127.0.0.1/hook")
    assert body.to_spec(Settings(env="test", webhook_allow_private=True)).prompt == "x"


def test_the_spec_rules_hold_for_stored_specs_too() -> None:
    spec = JobCreate(prompt="x").to_spec(SETTINGS)
    assert GenerationSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ValidationError, match="4k\\+1"):
        GenerationSpec.from_dict({**spec.to_dict(), "num_frames": 8})


def test_response_extends_the_spec() -> None:
    assert set(GenerationSpec.model_fields) <= set(JobOut.model_fields)


@pytest.mark.parametrize("precision", ["exact", "fast", None])
def test_a_requested_precision_goes_into_the_spec_as_asked(precision: str | None) -> None:
    body = JobCreate.model_validate({"prompt": "x", "precision": precision})
    assert body.precision == precision and body.to_spec(SETTINGS).precision == precision
    assert JobCreate(prompt="x").to_spec(SETTINGS).precision is None  # left out: the worker's default


@pytest.mark.parametrize("precision", ["turbo", "FAST", " fast", "", "int8", 8, True, ["fast"]])
def test_an_unknown_precision_is_refused_at_parse_naming_the_field(precision: object) -> None:
    with pytest.raises(ValidationError) as caught:
        JobCreate.model_validate({"prompt": "x", "precision": precision})
    (error,) = caught.value.errors()
    assert error["loc"] == ("precision",)
    assert "precision must be 'exact' or 'fast'" in error["msg"]


@pytest.mark.parametrize("step_cache", ["taylor9", "TAYLOR2", "on", "", None, 2, True, ["taylor2"]])
def test_an_unknown_step_cache_is_refused_at_parse_naming_the_field_and_the_presets(step_cache: object) -> None:
    with pytest.raises(ValidationError) as caught:
        JobCreate.model_validate({"prompt": "x", "step_cache": step_cache})
    (error,) = caught.value.errors()
    assert error["loc"] == ("step_cache",)
    assert "step_cache must be one of 'off', 'taylor2', 'taylor3', 'taylor4'" in error["msg"]


@pytest.mark.parametrize("step_cache", ["off", "taylor2", "taylor3", "taylor4"])
def test_a_step_cache_goes_into_the_spec_as_asked(step_cache: str) -> None:
    body = JobCreate.model_validate({"prompt": "x", "step_cache": step_cache})
    assert body.to_spec(SETTINGS).step_cache == step_cache
    assert JobCreate(prompt="x").to_spec(SETTINGS).step_cache == "off"  # left out: off


def test_a_stored_spec_without_precision_reads_back_as_naming_none() -> None:
    stored = JobCreate(prompt="x", seed=5).to_spec(SETTINGS).to_dict()
    assert "precision" not in stored  # what every job stored before the field existed looks like
    spec = GenerationSpec.from_dict(stored)
    assert spec.precision is None and spec.seed == 5
    assert GenerationSpec.from_dict({**stored, "precision": "fast"}).precision == "fast"
    with pytest.raises(ValidationError):
        GenerationSpec.from_dict({**stored, "precision": "turbo"})
    with pytest.raises(KeyError):  # a required field is still required
        GenerationSpec.from_dict({k: v for k, v in stored.items() if k != "seed"})
