"""MP4 and poster output, checked by reading the files back with PyAV and Pillow."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from shared.render.video import encode_mp4, probe, write_poster


@pytest.fixture
def frames() -> np.ndarray:
    # A moving gradient rather than noise: closer to real video, and it shows the frames arrive in order.
    f, h, w = 9, 48, 80
    x = np.linspace(0, 255, w, dtype=np.float32)[None, None, :]
    t = np.arange(f, dtype=np.float32)[:, None, None] * 20
    red = np.broadcast_to((x + t) % 256, (f, h, w))
    rgb = np.stack([red, np.full((f, h, w), 80.0), np.full((f, h, w), 160.0)], axis=-1)
    return rgb.astype(np.uint8)


def test_encode_then_probe(frames: np.ndarray, tmp_path: Path) -> None:
    path = tmp_path / "out" / "video.mp4"
    encode_mp4(frames, fps=12, path=path)
    info = probe(path)
    assert info.codec == "h264"
    assert info.frames == 9
    assert (info.width, info.height) == (80, 48)
    assert info.pix_fmt == "yuv420p"
    assert info.fps == pytest.approx(12.0)


def test_faststart_puts_the_index_before_the_media(frames: np.ndarray, tmp_path: Path) -> None:
    path = tmp_path / "video.mp4"
    encode_mp4(frames, fps=8, path=path)
    data = path.read_bytes()
    assert data[4:8] == b"ftyp"
    assert 0 <= data.find(b"moov") < data.find(b"mdat")


def test_poster_is_a_jpeg_of_the_middle_frame(frames: np.ndarray, tmp_path: Path) -> None:
    path = tmp_path / "poster.jpg"
    write_poster(frames, path)
    with Image.open(path) as image:
        assert image.format == "JPEG"
        assert image.size == (80, 48)
        pixels = np.asarray(image.convert("RGB"), dtype=np.int16)
    assert np.abs(pixels - frames[4]).mean() < 4  # JPEG is lossy, but it is this frame


def test_rejects_what_yuv420p_cannot_hold(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="even"):
        encode_mp4(np.zeros((3, 15, 16, 3), np.uint8), fps=8, path=tmp_path / "odd.mp4")
    with pytest.raises(ValueError, match="uint8"):
        encode_mp4(np.zeros((3, 16, 16, 3), np.float32), fps=8, path=tmp_path / "float.mp4")
