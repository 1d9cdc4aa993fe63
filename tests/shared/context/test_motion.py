"""Motion labels from optical flow on synthetic clips whose camera motion is known (tools/clips.py), and the
label of a descriptor on its own."""

from __future__ import annotations

import numpy as np
import pytest

from shared.context import motion
from tools import clips


@pytest.mark.parametrize("name", clips.MOTIONS)
@pytest.mark.parametrize("speed", [0.5, 2.0])
def test_a_clip_gets_the_label_of_its_camera_motion(name: str, speed: float) -> None:
    for seed in (1, 2):
        moved = motion.analyse(clips.clip(seed, name, frames=17, height=64, width=96, speed=speed))
        assert moved.label == name, (seed, moved.descriptor)
        assert moved.tokens.shape == (motion.SEGMENTS, 6) and np.isfinite(moved.tokens).all()


def test_tokens_say_direction_and_speed() -> None:
    slow = motion.analyse(clips.clip(3, "pan_right", speed=0.5))
    fast = motion.analyse(clips.clip(3, "pan_right", speed=2.0))
    # Content slides left when the camera pans right: the direction's x is negative, the same in every token.
    assert (slow.tokens[:, 0] < -0.9).all() and (fast.tokens[:, 0] < -0.9).all()
    assert fast.tokens[:, 2].mean() > 3 * slow.tokens[:, 2].mean()  # magnitude grows with speed
    zoom = motion.analyse(clips.clip(3, "zoom_in"))
    assert (zoom.tokens[:, 3] > 0).all()  # divergence: content grows


@pytest.mark.parametrize(
    ("descriptor", "expected"),
    [
        ((0.0, 0.0, 0.0, 0.0, 0.0), "static"),
        ((0.0, 0.0, 0.0, 0.0, 0.05), "mixed"),  # a still camera, subjects moving
        ((0.02, 0.0, 0.0, 0.0, 0.0), "pan_left"),
        ((-0.02, 0.0, 0.0, 0.0, 0.0), "pan_right"),
        ((0.0, 0.02, 0.0, 0.0, 0.0), "tilt_up"),
        ((0.0, -0.02, 0.0, 0.0, 0.0), "tilt_down"),
        ((0.0, 0.0, 0.1, 0.0, 0.0), "zoom_in"),
        ((0.0, 0.0, -0.1, 0.0, 0.0), "zoom_out"),
        ((0.0, 0.0, 0.0, 0.1, 0.0), "rotate_ccw"),
        ((0.0, 0.0, 0.0, -0.1, 0.0), "rotate_cw"),
        ((0.02, 0.018, 0.0, 0.0, 0.0), "mixed"),  # a diagonal: no move leads
    ],
)
def test_a_descriptor_has_the_label_an_editor_would_give(descriptor: tuple[float, ...], expected: str) -> None:
    assert motion.label(np.array(descriptor)) == expected


def test_a_single_frame_has_no_motion() -> None:
    with pytest.raises(ValueError, match="two frames"):
        motion.analyse(clips.clip(1, "static", frames=1))
