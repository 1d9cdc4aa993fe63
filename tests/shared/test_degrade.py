"""Degraded rendering's table and records (shared/render/degrade.py), the request field that allows it, and how
the job body shows a degraded result (shared/jobs/presenters.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from shared.infra.config import Settings
from shared.jobs.presenters import degraded_from
from shared.jobs.schemas import JobCreate
from shared.render.degrade import Degradation, lower_tier
from shared.spec import GenerationSpec

SPEC = GenerationSpec(
    model="tiny-wan",
    prompt="a boat",
    negative_prompt="",
    width=832,
    height=480,
    num_frames=17,
    fps=16,
    steps=20,
    guidance_scale=5.0,
    seed=1,
)


def test_the_lower_tier_halves_steps_and_each_side_to_a_multiple_of_16() -> None:
    lower = lower_tier(SPEC, Settings())
    assert lower is not None
    assert (lower.steps, lower.width, lower.height) == (10, 416, 240)
    # everything else as asked
    assert lower.model_dump(exclude={"steps", "width", "height"}) == SPEC.model_dump(
        exclude={"steps", "width", "height"}
    )


def test_sides_round_down_to_the_multiple_and_nothing_goes_under_its_floor() -> None:
    odd = SPEC.model_copy(update={"width": 272, "height": 16, "steps": 3})  # 136 → 128; 16 stays; 3 → 1
    lower = lower_tier(odd, Settings())
    assert lower is not None and (lower.steps, lower.width, lower.height) == (1, 128, 16)
    assert lower_tier(SPEC.model_copy(update={"width": 16, "height": 16, "steps": 1}), Settings()) is None


def test_the_factors_are_settings() -> None:
    lower = lower_tier(SPEC, Settings(degrade_steps_factor=0.25, degrade_side_factor=0.75))
    assert lower is not None and (lower.steps, lower.width, lower.height) == (5, 624, 352)


def test_a_degraded_record_reads_back_as_the_job_body_shows_it() -> None:
    lower = lower_tier(SPEC, Settings())
    assert lower is not None
    record = Degradation("out_of_memory", SPEC, lower).record()
    assert record == {
        "reason": "out_of_memory",
        "from": {"steps": 20, "width": 832, "height": 480},
        "to": {"steps": 10, "width": 416, "height": 240},
    }
    shown, rendered = degraded_from({"encode": 0.1, "degraded": record})
    assert shown is not None and shown.model_dump() == {"reason": "out_of_memory", **record["from"]}
    assert rendered == record["to"]
    assert degraded_from({"encode": 0.1}) == (None, {})


def test_allow_degraded_is_stored_and_keyed_only_when_true() -> None:
    settings = Settings()
    plain = JobCreate(prompt="a boat", seed=1).to_spec(settings)
    allowing = JobCreate(prompt="a boat", seed=1, allow_degraded=True).to_spec(settings)
    assert "allow_degraded" not in plain.to_dict() and allowing.to_dict()["allow_degraded"] is True
    assert GenerationSpec.from_dict(plain.to_dict()).allow_degraded is False
    assert GenerationSpec.from_dict(allowing.to_dict()).allow_degraded is True
    # a degraded render may not serve a job that did not allow one
    assert plain.result_key() != allowing.result_key()
    # idempotency: false is the body as before the field existed; true is another request
    assert JobCreate(prompt="a", allow_degraded=False).fingerprint() == JobCreate(prompt="a").fingerprint()
    assert JobCreate(prompt="a", allow_degraded=True).fingerprint() != JobCreate(prompt="a").fingerprint()


@pytest.mark.parametrize("value", ["maybe", 2, [True], {"on": True}, None])
def test_allow_degraded_must_be_a_boolean(value: object) -> None:
    with pytest.raises(ValidationError) as refused:
        JobCreate.model_validate({"prompt": "a boat", "allow_degraded": value})
    assert refused.value.errors()[0]["loc"] == ("allow_degraded",)
