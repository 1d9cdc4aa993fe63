"""The result cache's match key (shared/spec.py ``GenerationSpec.result_key``) and the request's ``cache`` flag,
without services: the key covers every render parameter and nothing else."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from shared.infra.config import Settings
from shared.jobs.schemas import JobCreate
from shared.spec import RESULT_KEY_VERSION, GenerationSpec

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
    "precision": "fast",
    "allow_degraded": True,
    "step_cache": "taylor2",
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
    canonical = json.dumps({"spec": SPEC.to_dict(), "v": 2}, sort_keys=True, separators=(",", ":"))
    assert SPEC.result_key() == hashlib.sha256(canonical.encode()).hexdigest()


# SPEC's key and BODY's Idempotency-Key fingerprint as the code made them before `precision` existed (computed with
# that commit's shared/spec.py and shared/jobs/schemas.py, under key version 1): jobs and keys stored then must keep
# matching. Version 2 (the fast tier renders in 8 bits) retired every key at once, by design; the stored spec stayed.
KEY_BEFORE_PRECISION = "525cfd814caf6b6ad250c3919f257e1cd2b4713e7d42a2ea11941f153f39cc1d"
KEY_NOW = "acf6d2307cc27ed4e968a106bd1741799aabd5f28ecf6c4c57e19b58a88a7ba4"  # the same spec under version 2
FINGERPRINT_BEFORE_PRECISION = "d15f42094e81fe3cf221df099b8a36254bed71b2ca0b31f1e46c8ab371421586"


def key_at(version: int, stored: dict[str, Any]) -> str:
    canonical = json.dumps({"spec": stored, "v": version}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def test_a_job_that_names_no_precision_keeps_todays_stored_spec_and_key() -> None:
    assert SPEC.precision is None and SPEC.step_cache == "off"
    stored = SPEC.to_dict()
    assert "precision" not in stored and "step_cache" not in stored  # the stored spec is what it was before
    assert key_at(1, stored) == KEY_BEFORE_PRECISION  # the same stored spec: under version 1, the same key
    assert RESULT_KEY_VERSION == 2 and SPEC.result_key() == key_at(2, stored) == KEY_NOW
    # A spec stored before the field existed reads back as naming none, with today's key.
    legacy = GenerationSpec.from_dict(stored)
    assert legacy.precision is None and legacy == SPEC and legacy.result_key() == KEY_NOW
    assert JobCreate(**BODY, precision=None, step_cache="off").to_spec(SETTINGS).result_key() == KEY_NOW


def test_a_step_cache_is_stored_and_keyed_only_when_set() -> None:
    cached = JobCreate(**BODY, step_cache="taylor3").to_spec(SETTINGS)
    assert cached.to_dict()["step_cache"] == "taylor3" and cached.result_key() != SPEC.result_key()
    assert GenerationSpec.from_dict(json.loads(json.dumps(cached.to_dict()))) == cached
    assert cached.batch_key()["step_cache"] == "taylor3" and SPEC.batch_key()["step_cache"] == "off"
    assert JobCreate(**BODY, step_cache="taylor3").fingerprint() != FINGERPRINT_BEFORE_PRECISION


def test_a_named_precision_is_stored_and_keyed() -> None:
    exact, fast = (JobCreate(**BODY, precision=p).to_spec(SETTINGS) for p in ("exact", "fast"))
    assert (exact.to_dict()["precision"], fast.to_dict()["precision"]) == ("exact", "fast")
    # exact and fast are different videos, and naming one is not the same request as leaving it to the worker.
    assert len({SPEC.result_key(), exact.result_key(), fast.result_key()}) == 3
    for spec in (exact, fast):
        assert GenerationSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec  # jobs.spec round trip


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


def test_precision_is_part_of_the_idempotency_fingerprint_only_when_named() -> None:
    assert JobCreate(**BODY).fingerprint() == FINGERPRINT_BEFORE_PRECISION  # keys stored before still match
    assert JobCreate(**BODY, precision=None).fingerprint() == FINGERPRINT_BEFORE_PRECISION
    named = {JobCreate(**BODY, precision=p).fingerprint() for p in ("exact", "fast")}
    assert len(named) == 2 and FINGERPRINT_BEFORE_PRECISION not in named


def test_cache_is_part_of_the_idempotency_fingerprint() -> None:
    default, on, off = JobCreate(**BODY), JobCreate(**BODY, cache=True), JobCreate(**BODY, cache=False)
    assert default.fingerprint() == on.fingerprint() != off.fingerprint()
    # At its default the flag is left out (as are an unnamed precision, allow_degraded false and step_cache off): a
    # key stored before the field existed still matches its retry.
    before = default.model_dump(mode="json", exclude={"cache", "precision", "allow_degraded", "step_cache"})
    assert default.fingerprint() == hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()
