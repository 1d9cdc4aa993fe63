"""The result cache's match key (shared/spec.py ``GenerationSpec.result_key``) and the request's ``cache`` flag,
without services: the key covers every render parameter and nothing else."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from shared.config import Settings
from shared.schemas import JobCreate
from shared.spec import GenerationSpec

SETTINGS = Settings(env="test")
BODY: dict[str, Any] = {"prompt": "a small red boat", "width": 64, "height": 64, "fps": 8, "steps": 4, "seed": 1}
SPEC = JobCreate(**BODY).to_spec(SETTINGS)

# One valid change of each spec field. A field added to GenerationSpec must be added here (the test below says so).
CHANGED: dict[str, Any] = {
    "model": "another-model",
    "prompt": "a small blue boat",
    "negative_prompt": "blurry",
    "width": 80,
    "height": 80,
    "num_frames": 13,
    "fps": 9,
    "steps": 5,
    "guidance_scale": 5.5,
    "seed": 2,
}


def test_every_spec_field_is_covered_here() -> None:
    assert set(CHANGED) == set(GenerationSpec.model_fields)


@pytest.mark.parametrize("field", sorted(CHANGED))
def test_the_key_changes_with_every_spec_field(field: str) -> None:
    changed = SPEC.model_copy(update={field: CHANGED[field]})
    assert getattr(changed, field) != getattr(SPEC, field)
    assert changed.result_key() != SPEC.result_key()


def test_the_key_is_a_sha256_hex_stable_across_orderings_and_storage() -> None:
    key = SPEC.result_key()
    assert len(key) == 64 and int(key, 16) >= 0
    stored = SPEC.to_dict()
    reversed_order = dict(reversed(list(stored.items())))
    assert GenerationSpec.from_dict(reversed_order).result_key() == key
    assert GenerationSpec.from_dict(json.loads(json.dumps(stored))).result_key() == key  # jobs.spec round trip
    body_reversed = dict(reversed(list(BODY.items())))
    assert JobCreate(**body_reversed).to_spec(SETTINGS).result_key() == key
    assert JobCreate(**BODY, guidance_scale=5).to_spec(SETTINGS).result_key() == key  # 5 and 5.0: one value


def test_the_key_hashes_the_whole_spec_under_a_version() -> None:
    canonical = json.dumps({"spec": SPEC.to_dict(), "v": 1}, sort_keys=True, separators=(",", ":"))
    assert SPEC.result_key() == hashlib.sha256(canonical.encode()).hexdigest()


def test_what_is_not_a_render_parameter_is_not_in_the_key() -> None:
    key = SPEC.result_key()
    for extra in ({"cache": False}, {"cache": True}, {"webhook_url": "https://example.com/h"}, {"metadata": {"a": 1}}):
        assert JobCreate(**BODY, **extra).to_spec(SETTINGS).result_key() == key, extra
    # The same video asked for in other words (a preset, a duration) is the same key.
    by_preset = JobCreate(**{**BODY, "width": None, "height": None}, resolution="480p").to_spec(SETTINGS)
    by_size = JobCreate(**{**BODY, "width": 832, "height": 480}).to_spec(SETTINGS)
    assert by_preset.result_key() == by_size.result_key()


def test_a_request_without_a_seed_gets_its_own_key() -> None:
    unseeded = {k: v for k, v in BODY.items() if k != "seed"}
    keys = {JobCreate(**unseeded).to_spec(SETTINGS).result_key() for _ in range(5)}
    assert len(keys) == 5


def test_cache_is_part_of_the_idempotency_fingerprint() -> None:
    default, on, off = JobCreate(**BODY), JobCreate(**BODY, cache=True), JobCreate(**BODY, cache=False)
    assert default.fingerprint() == on.fingerprint() != off.fingerprint()
    # At its default the flag is left out: a key stored before the field existed still matches its retry.
    before = default.model_dump(mode="json", exclude={"cache"})
    assert default.fingerprint() == hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()
