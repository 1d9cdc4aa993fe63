"""MP4 and poster output with PyAV (FFmpeg in the wheel; there is no ffmpeg or ffprobe binary to call)."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from PIL import Image

CRF = 18  # visually lossless for x264; the size cost is small next to a render's GPU cost
POSTER_QUALITY = 90


@dataclass(frozen=True, slots=True)
class VideoInfo:
    codec: str
    frames: int  # counted by decoding, not read from the header
    width: int
    height: int
    fps: float
    pix_fmt: str


def _check_frames(frames: np.ndarray) -> None:
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] == 0:
        raise ValueError(f"expected uint8 frames of shape (F, H, W, 3), got {frames.dtype} {frames.shape}")


def encode_mp4(frames: np.ndarray, *, fps: int, path: Path) -> None:
    """Write ``frames`` (uint8 RGB, (F, H, W, 3)) as H.264 in yuv420p, playable in browsers while streaming.

    yuv420p is what every browser and phone decodes; ``+faststart`` moves the index to the front so a player
    can start before the whole file has downloaded from S3.
    """
    _check_frames(frames)
    _, height, width, _ = frames.shape
    if height % 2 or width % 2:
        raise ValueError(f"yuv420p needs an even width and height, got {width}x{height}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), mode="w", format="mp4", options={"movflags": "+faststart"}) as container:
        stream = container.add_stream("libx264", rate=Fraction(fps))
        stream.width = width
        stream.height = height
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": str(CRF)}
        for rgb in frames:
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))  # flush the frames x264 holds back for lookahead


def write_poster(frames: np.ndarray, path: Path) -> None:
    """Save the middle frame as a JPEG: the first frame of a diffusion video is often the least settled."""
    _check_frames(frames)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(frames[len(frames) // 2]).save(path, format="JPEG", quality=POSTER_QUALITY)


def probe(path: Path) -> VideoInfo:
    """Read a video file back and describe its first video stream."""
    with av.open(str(path), mode="r") as container:
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        count = sum(1 for _ in container.decode(stream))
        return VideoInfo(
            codec=stream.codec_context.name,
            frames=count,
            width=stream.codec_context.width,
            height=stream.codec_context.height,
            fps=float(rate) if rate else 0.0,
            pix_fmt=stream.codec_context.pix_fmt or "",
        )
