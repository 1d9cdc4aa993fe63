"""OpenAI's create parameters → vidq's job request, on their own (no services): sizes, durations, models and
vidq's own parameters, and the OpenAI parameter each refusal names."""

from __future__ import annotations

from typing import Any

import pytest

from services.api.videos.service import job_request, param_of_cap
from shared.errors import InvalidRequest
from shared.infra.config import Settings

SETTINGS = Settings(env="test")


def test_openais_defaults_and_names_map_to_vidqs_spec() -> None:
    spec = job_request({"prompt": "a heron", "model": "sora-2"}).to_spec(SETTINGS)
    # 720x1280 and 4 s (OpenAI's defaults) at 16 fps: the smallest 4k+1 covering 64 frames.
    assert (spec.width, spec.height, spec.num_frames, spec.fps, spec.model) == (720, 1280, 65, 16, "tiny-wan")
    for name in ("sora-2-pro", "sora-2-2025-12-08", "sora-2-pro-2025-10-06"):
        assert job_request({"prompt": "p", "model": name}).to_spec(SETTINGS).model == "tiny-wan"
    assert job_request({"prompt": "p", "model": "wan2.1-1.3b-arch"}).model == "wan2.1-1.3b-arch"


def test_form_fields_arrive_as_strings_and_become_typed_parameters() -> None:
    fields = {"prompt": "p", "size": "64x48", "seconds": "1.5", "steps": "4", "seed": "7", "fps": "8"}
    body = job_request({**fields, "guidance_scale": "3.5", "cache": "false", "metadata": {"order": "42"}})
    spec = body.to_spec(SETTINGS)
    assert (spec.width, spec.height, spec.num_frames, spec.steps, spec.seed, spec.guidance_scale) == (
        64,
        48,
        13,
        4,
        7,
        3.5,
    )
    assert body.cache is False and body.metadata == {"order": "42"} and body.duration_s == 1.5


@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_precision_passes_through_into_the_spec(precision: str) -> None:
    body = job_request({"prompt": "p", "size": "64x64", "precision": precision})
    assert body.precision == precision and body.to_spec(SETTINGS).precision == precision
    assert job_request({"prompt": "p"}).to_spec(SETTINGS).precision is None  # not sent: the worker's default


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"size": "64x50"}, "size"),  # not a multiple of 16
        ({"size": "64"}, "size"),
        ({"size": 64}, "size"),
        ({"seconds": "0"}, "seconds"),
        ({"seconds": "four"}, "seconds"),
        ({"seconds": True}, "seconds"),
        ({"seconds": "inf"}, "seconds"),
        ({"steps": "many"}, "steps"),
        ({"seed": -1}, "seed"),
        ({"negative_prompt": ["a"]}, "negative_prompt"),
        ({"duration_s": 1}, "duration_s"),  # vidq's name for seconds: not a parameter of this API
        ({"input_reference": None}, "input_reference"),
        ({"prompt": ""}, "prompt"),
        ({"precision": "turbo"}, "precision"),
        ({"precision": "Fast"}, "precision"),
    ],
)
def test_refusals_name_the_openai_parameter(params: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        job_request({"prompt": "p", **params})
    assert exc.value.details == {"param": param}


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"size": "1920x1920"}, "size"),  # over VIDQ_MAX_PIXELS
        ({"seconds": "60"}, "seconds"),  # over VIDQ_MAX_DURATION_S
        ({"seconds": "10", "fps": "30"}, "seconds"),  # over VIDQ_MAX_FRAMES
        ({"model": "dall-e-3"}, "model"),  # not in VIDQ_MODELS_ALLOWED
        ({"steps": "1000"}, "steps"),
    ],
)
def test_the_operators_caps_name_the_openai_parameter(params: dict[str, Any], param: str) -> None:
    body = job_request({"prompt": "p", **params})
    with pytest.raises(InvalidRequest) as exc:
        body.to_spec(SETTINGS)
    assert param_of_cap(exc.value).details == {"param": param}
