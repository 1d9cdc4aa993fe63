"""Motion tokens: how the camera and the subjects move, from dense optical flow of the decoded frames.

OpenCV's Farneback flow (no weights) runs on grey frames downscaled to ``FLOW_WIDTH`` pixels wide. Each flow
field is fitted by least squares with the motion of a camera — translation (tx, ty), zoom (a) and roll (b):

    u = tx + a·x − b·y        v = ty + b·x + a·y

in coordinates centred on the frame and measured in half-widths (so a clip's tokens do not depend on its
resolution), per frame. ``a`` is half the flow's divergence, ``b`` half its curl; what the fit leaves (the
residual) is motion of the subjects rather than of the camera. A clip's frame pairs are cut into up to ``SEGMENTS``
stretches of time, and each stretch's mean is one token: direction (a unit vector), magnitude, divergence, curl,
residual. The clip's descriptor, what the prototypes cluster, is the mean of its pairs (tx, ty, divergence, curl,
residual).

Labels speak of the camera, as an editor would: content sliding right in the frame is the camera panning left,
content sliding down is the camera tilting up, content growing is a zoom in, content turning clockwise on screen is
the camera rolling counter-clockwise. A clip whose every component stays under ``STATIC_BELOW`` is ``static``; one
where no component leads the next by ``LEAD`` is ``mixed``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.context.ids import LABELS  # noqa: F401  (the labels this module gives)

FLOW_WIDTH = 160  # pixels: Farneback's cost grows with the area, and camera motion needs no more
MAX_PAIRS = 32  # frame pairs per clip, spread over its length
SEGMENTS = 4
_MARGIN = 0.1  # of each side: flow at the borders sees content entering or leaving the frame
_STEP = 2  # every 2nd flow vector in each direction enters the fit
STATIC_BELOW = 0.003  # half-widths per frame, ≈ 0.24 px per frame at FLOW_WIDTH
LEAD = 1.6  # the leading component is at least this many times the next one
SUBJECT_BELOW = 0.01  # residual (half-widths per frame) under which a still camera's clip is static
RADIUS = 0.5  # half-widths: the mean distance from the centre of the points a 16:9 to 1:1 frame's fit uses

DESCRIPTOR = ("tx", "ty", "divergence", "curl", "residual")


@dataclass(frozen=True, slots=True)
class Motion:
    tokens: np.ndarray  # (segments, 6): direction x, direction y, magnitude, divergence, curl, residual
    descriptor: np.ndarray  # (5,): DESCRIPTOR, the clip's mean per frame
    label: str

    def tokens_list(self) -> list[list[float]]:
        return [[round(float(v), 6) for v in token] for token in self.tokens]


def _grey(frames: np.ndarray) -> list[np.ndarray]:
    import cv2

    height, width = frames.shape[1:3]
    size = (FLOW_WIDTH, max(16, round(height * FLOW_WIDTH / width))) if width > FLOW_WIDTH else (width, height)
    out = []
    for frame in frames:
        grey = cv2.cvtColor(np.ascontiguousarray(frame), cv2.COLOR_RGB2GRAY)
        out.append(cv2.resize(grey, size, interpolation=cv2.INTER_AREA) if size != (width, height) else grey)
    return out


def _camera_fit(flow: np.ndarray) -> np.ndarray:
    """(tx, ty, a, b, residual rms) of one flow field, in half-widths per frame."""
    height, width = flow.shape[:2]
    half = width / 2.0
    ys = np.arange(int(height * _MARGIN), height - int(height * _MARGIN), _STEP)
    xs = np.arange(int(width * _MARGIN), width - int(width * _MARGIN), _STEP)
    grid_y, grid_x = np.meshgrid(ys, xs, indexing="ij")
    x = ((grid_x + 0.5 - width / 2.0) / half).ravel()
    y = ((grid_y + 0.5 - height / 2.0) / half).ravel()
    u = (flow[grid_y, grid_x, 0] / half).ravel()
    v = (flow[grid_y, grid_x, 1] / half).ravel()
    ones, zeros = np.ones_like(x), np.zeros_like(x)
    # Rows for u, then rows for v; unknowns (tx, ty, a, b).
    design = np.concatenate([np.stack([ones, zeros, x, -y], 1), np.stack([zeros, ones, y, x], 1)])
    target = np.concatenate([u, v])
    params, *_ = np.linalg.lstsq(design, target, rcond=None)
    residual = float(np.sqrt(np.mean((design @ params - target) ** 2)))
    return np.array([*params, residual], dtype=np.float64)


def label(descriptor: np.ndarray) -> str:
    """The readable label of a clip's (or a prototype's) descriptor (``DESCRIPTOR``)."""
    tx, ty, divergence, curl, residual = (float(v) for v in descriptor[:5])
    a, b = divergence / 2, curl / 2
    # A zoom or roll of ``a`` moves the fitted points by ``a`` times their distance from the centre: on average
    # RADIUS half-widths, so it compares with a translation in the same unit.
    strengths = {"pan": abs(tx), "tilt": abs(ty), "zoom": abs(a) * RADIUS, "rotate": abs(b) * RADIUS}
    ranked = sorted(strengths.items(), key=lambda item: item[1], reverse=True)
    (kind, top), (_, second) = ranked[0], ranked[1]
    if top < STATIC_BELOW:
        return "static" if residual < SUBJECT_BELOW else "mixed"
    if top < LEAD * second:
        return "mixed"
    if kind == "pan":
        return "pan_left" if tx > 0 else "pan_right"
    if kind == "tilt":
        return "tilt_up" if ty > 0 else "tilt_down"
    if kind == "zoom":
        return "zoom_in" if a > 0 else "zoom_out"
    return "rotate_ccw" if b > 0 else "rotate_cw"


def analyse(frames: np.ndarray) -> Motion:
    """The motion of uint8 RGB frames (T, H, W, 3), T ≥ 2."""
    import cv2

    if frames.shape[0] < 2:
        raise ValueError("motion needs at least two frames")
    grey = _grey(frames)
    starts = np.unique(np.linspace(0, len(grey) - 2, min(MAX_PAIRS, len(grey) - 1)).round().astype(int))
    fits = []
    for t in starts:
        flow = cv2.calcOpticalFlowFarneback(grey[t], grey[t + 1], None, 0.5, 3, 15, 3, 5, 1.2, 0)
        fits.append(_camera_fit(flow))
    per_pair = np.stack(fits)  # (pairs, 5): tx, ty, a, b, residual
    tokens = []
    for stretch in np.array_split(per_pair, min(SEGMENTS, len(per_pair))):
        tx, ty, a, b, residual = stretch.mean(axis=0)
        magnitude = float(np.hypot(tx, ty))
        direction = (tx / magnitude, ty / magnitude) if magnitude > 1e-9 else (0.0, 0.0)
        tokens.append([*direction, magnitude, 2 * a, 2 * b, residual])
    mean = per_pair.mean(axis=0)
    descriptor = np.array([mean[0], mean[1], 2 * mean[2], 2 * mean[3], mean[4]], dtype=np.float64)
    return Motion(tokens=np.array(tokens, dtype=np.float64), descriptor=descriptor, label=label(descriptor))
