"""Keyframe embeddings: which latent frames are keyframes, the fixed projection, and the pipeline handing its pooled
keyframes over with every render (tiny-wan on the CPU), alone and in a batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.context import embedding
from shared.render.pipeline import RenderResult, VideoPipeline
from shared.render.registry import TINY_WAN, build_pipeline
from shared.render.tiers import policy_for
from tests.shared.render.test_registry import make_spec

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("frames", "expected"),
    [(1, [0]), (9, [0, 2]), (17, [0, 2, 4]), (33, [0, 2, 4, 6, 8]), (81, [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20])],
)
def test_keyframes_are_every_8th_frame_in_latent_frames(frames: int, expected: list[int]) -> None:
    assert embedding.keyframe_indices(frames, temporal_ratio=4) == expected


def test_the_projection_is_fixed_per_version_and_keeps_angles() -> None:
    narrow, wide = embedding.projection(400), embedding.projection(1040)
    assert narrow.shape == (512, 400) and wide.shape == (512, 1040)
    assert np.allclose(narrow.T @ narrow, np.eye(400), atol=1e-4)  # orthonormal columns: cosines unchanged
    assert np.allclose(wide @ wide.T, np.eye(512), atol=1e-4)  # orthonormal rows
    embedding.projection.cache_clear()
    assert np.array_equal(embedding.projection(400), narrow)  # drawn again, the same matrix
    assert not np.allclose(embedding.projection(400, version="kf0"), narrow)
    a, b = np.random.default_rng(0).standard_normal((2, 400)).astype(np.float32)
    cosine = a @ b / np.linalg.norm(a) / np.linalg.norm(b)
    pa, pb = narrow @ a, narrow @ b
    assert pa @ pb / np.linalg.norm(pa) / np.linalg.norm(pb) == pytest.approx(cosine, abs=1e-5)


def test_embed_normalises_keyframes_and_the_video() -> None:
    features = np.random.default_rng(1).standard_normal((3, 1040)).astype(np.float32)
    keyframes, video = embedding.embed(features)
    assert keyframes.shape == (3, 512) and video.shape == (512,)
    assert np.allclose(np.linalg.norm(keyframes, axis=1), 1, atol=1e-5)
    assert np.linalg.norm(video) == pytest.approx(1, abs=1e-5)
    assert embedding.space("tiny-wan") == f"{embedding.EMBEDDING_VERSION}/tiny-wan"


@pytest.fixture(scope="module")
def exact() -> VideoPipeline:
    pipe = build_pipeline(TINY_WAN, device=CPU, dtype=torch.float32)
    return VideoPipeline(pipe, model=TINY_WAN, device=CPU, dtype=torch.float32, policy=policy_for("exact", device=CPU))


def test_a_render_hands_over_its_pooled_keyframes(exact: VideoPipeline) -> None:
    spec = make_spec(seed=1)
    result = exact.generate(spec, keep_latents=True)
    assert result.keyframes is not None and result.latents is not None
    keyframes = len(embedding.keyframe_indices(spec.num_frames, temporal_ratio=4))
    channels = result.latents.shape[1]
    assert result.keyframes.shape == (keyframes, channels * (embedding.GRID**2 + 1))
    reference = embedding.reference_tones(exact.pipe.vae, spec.num_frames)
    again = embedding.keyframe_features(
        result.latents, num_frames=spec.num_frames, temporal_ratio=4, reference=reference
    )
    assert np.allclose(result.keyframes, again, atol=1e-6)
    # The same seed renders the same video and so the same embedding; another seed another one.
    assert np.allclose(exact.generate(spec).keyframes, result.keyframes, atol=1e-5)  # type: ignore[arg-type]
    other = exact.generate(make_spec(seed=2)).keyframes
    assert other is not None and not np.allclose(other, result.keyframes, atol=1e-5)


def test_a_batch_member_gets_the_keyframes_it_would_get_alone(exact: VideoPipeline) -> None:
    specs = [make_spec(seed=1), make_spec(seed=2)]
    results = exact.generate_batch(specs, on_steps=[lambda d, t: None] * 2)
    for spec, result in zip(specs, results, strict=True):
        assert isinstance(result, RenderResult) and result.keyframes is not None
        alone = exact.generate(spec).keyframes
        assert alone is not None and np.allclose(result.keyframes, alone, atol=1e-4)


def test_failed_pooling_leaves_the_render_whole(exact: VideoPipeline, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> np.ndarray:
        raise RuntimeError("pooling broke")

    monkeypatch.setattr(embedding, "keyframe_features", broken)
    result = exact.generate(make_spec(seed=1))
    assert result.keyframes is None and result.frames.shape[0] == make_spec(seed=1).num_frames
