"""Rendering several compatible videos in one denoising loop (``VideoPipeline.generate_batch``) with tiny-wan on the
CPU: each member is the video it would be alone, a member whose callback raises is dropped while the rest finish,
and only compatible specs batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.errors import JobCancelled
from shared.render.pipeline import RenderResult, VideoPipeline
from shared.render.registry import TINY_WAN, build_pipeline
from shared.render.tiers import policy_for
from tests.shared.render.test_registry import make_spec

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def exact() -> VideoPipeline:
    pipe = build_pipeline(TINY_WAN, device=CPU, dtype=torch.float32)
    return VideoPipeline(pipe, model=TINY_WAN, device=CPU, dtype=torch.float32, policy=policy_for("exact", device=CPU))


def test_each_member_is_the_video_it_would_be_alone(exact: VideoPipeline) -> None:
    specs = [make_spec(seed=1), make_spec(seed=2, prompt="a green field"), make_spec(seed=3)]
    steps: list[list[int]] = [[], [], []]
    results = exact.generate_batch(specs, on_steps=[lambda d, t, i=i: steps[i].append(d) for i in range(3)])
    for spec, result, seen in zip(specs, results, steps, strict=True):
        assert isinstance(result, RenderResult)
        alone = exact.generate(spec)
        # The same math for each member; float32 GEMMs of another batch size may round differently in the last bit.
        assert np.abs(result.frames.astype(np.int16) - alone.frames).max() <= 1
        assert seen == list(range(1, spec.steps + 1))  # every member reported every step
        assert result.timings_s["batch"] == 3.0 and result.timings_s["total"] > 0
    assert not np.array_equal(results[0].frames, results[2].frames)  # its own seed: its own noise


def test_a_member_whose_callback_raises_is_dropped_and_the_rest_finish(exact: VideoPipeline) -> None:
    def cancel_at_two(done: int, total: int) -> None:
        if done == 2:
            raise JobCancelled("job cancelled")

    results = exact.generate_batch([make_spec(seed=1), make_spec(seed=2)], on_steps=[cancel_at_two, lambda d, t: None])
    assert isinstance(results[0], JobCancelled)
    assert isinstance(results[1], RenderResult)
    everyone = exact.generate_batch([make_spec(seed=1)], on_steps=[cancel_at_two])
    assert isinstance(everyone[0], JobCancelled)


def test_only_specs_of_one_batch_key_render_together(exact: VideoPipeline) -> None:
    assert make_spec(seed=1, prompt="a").batch_key() == make_spec(seed=9, prompt="b").batch_key()
    assert make_spec(steps=2).batch_key() != make_spec(steps=3).batch_key()
    with pytest.raises(ValueError):
        exact.generate_batch([make_spec(steps=2), make_spec(steps=3)], on_steps=[lambda d, t: None] * 2)
