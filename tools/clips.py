"""Synthetic clips with known content and camera motion, for the context step's tests and benchmarks.

A clip is a camera window moving over a large smooth random texture (its own seed): panning, tilting, zooming or
rolling at a chosen speed, or standing still. Copies of a clip (recoloured, slightly cropped, re-encoded) are what
similar-video search must still find."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

MOTIONS = ("static", "pan_left", "pan_right", "tilt_up", "tilt_down", "zoom_in", "zoom_out", "rotate_cw", "rotate_ccw")


def texture(seed: int, size: int = 512) -> np.ndarray:
    """A smooth colour texture (size, size, 3) uint8: blobs at several scales, plus edges for the flow to follow."""
    import cv2

    rng = np.random.default_rng(seed)
    field = np.zeros((size, size, 3), np.float32)
    for scale, weight in ((64, 1.0), (16, 0.6), (4, 0.35)):
        noise = rng.standard_normal((size // scale + 2, size // scale + 2, 3)).astype(np.float32)
        field += weight * cv2.resize(noise, (size, size), interpolation=cv2.INTER_CUBIC)
    for _ in range(24):  # a few hard-edged shapes
        centre = tuple(int(v) for v in rng.integers(0, size, 2))
        colour = tuple(float(v) for v in rng.uniform(-2, 2, 3))
        cv2.circle(field, centre, int(rng.integers(8, 48)), colour, -1)
    field = (field - field.min()) / (np.ptp(field) + 1e-6)
    return np.asarray(field * 255, dtype=np.uint8)


def clip(
    seed: int,
    motion: str = "static",
    *,
    frames: int = 17,
    height: int = 64,
    width: int = 64,
    speed: float = 1.0,
) -> np.ndarray:
    """(frames, height, width, 3) uint8: the camera over ``texture(seed)`` doing ``motion``. ``speed`` 1 moves
    content ≈ 2.5% of the width per frame (pan, tilt), zooms 2.5% per frame, rolls 1.5° per frame."""
    import cv2

    if motion not in MOTIONS:
        raise ValueError(f"unknown motion {motion!r}")
    tex = texture(seed)
    size = tex.shape[0]
    out = np.empty((frames, height, width, 3), np.uint8)
    shift = 0.025 * width * speed  # texture pixels per frame at scale 1
    for t in range(frames):
        cx = cy = size / 2.0
        scale, angle = 1.5, 0.0  # texture pixels per frame pixel; the window's roll, radians (clockwise on screen)
        if motion == "pan_left":
            cx -= shift * t * scale
        elif motion == "pan_right":
            cx += shift * t * scale
        elif motion == "tilt_up":
            cy -= shift * t * scale
        elif motion == "tilt_down":
            cy += shift * t * scale
        elif motion == "zoom_in":
            scale *= (1 - 0.025 * speed) ** t
        elif motion == "zoom_out":
            scale *= (1 + 0.025 * speed) ** t
        elif motion == "rotate_cw":
            angle = math.radians(1.5 * speed * t)
        elif motion == "rotate_ccw":
            angle = -math.radians(1.5 * speed * t)
        c, s = math.cos(angle) * scale, math.sin(angle) * scale
        # frame pixel p → texture pixel centre + S·R·(p − frame centre)
        matrix = np.array(
            [[c, -s, cx - c * width / 2 + s * height / 2], [s, c, cy - s * width / 2 - c * height / 2]], np.float32
        )
        out[t] = cv2.warpAffine(
            tex, matrix, (width, height), flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP, borderMode=cv2.BORDER_REFLECT
        )
    return out


def recoloured(frames: np.ndarray, *, seed: int) -> np.ndarray:
    """A copy with its colours shifted: a gain and an offset per channel, within ±15%."""
    rng = np.random.default_rng(seed)
    gain = rng.uniform(0.85, 1.15, 3)
    offset = rng.uniform(-0.1, 0.1, 3) * 255
    return np.clip(frames.astype(np.float32) * gain + offset, 0, 255).astype(np.uint8)


def cropped(frames: np.ndarray, *, fraction: float = 0.06) -> np.ndarray:
    """A copy cropped by ``fraction`` of each side's length (split between both sides) and scaled back up."""
    import cv2

    _, height, width, _ = frames.shape
    dy, dx = round(height * fraction / 2), round(width * fraction / 2)
    return np.stack(
        [
            cv2.resize(f[dy : height - dy, dx : width - dx], (width, height), interpolation=cv2.INTER_LINEAR)
            for f in frames
        ]
    )


def reencoded(frames: np.ndarray, directory: Path, *, crf: int = 32) -> np.ndarray:
    """A copy through H.264 at ``crf`` (PyAV), read back."""
    import av

    path = directory / "copy.mp4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=16)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        stream.options = {"crf": str(crf)}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
