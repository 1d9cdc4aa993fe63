"""Keyframe embeddings from the pipeline's own VAE latents: no second model, nothing to download.

Every 8th frame of the video is a keyframe. Its latent frame (Wan's VAE keeps frame 0 and packs every 4 frames
after it into one latent frame, so frame 8k is latent frame 2k) is pooled to an 8×8 grid per latent channel; the
pooled values are centred per channel (the layout of the frame) and joined by the channel means (its tones) less
the encoder's answer to a plain grey clip of the same length (``reference_tones``: what the encoder says of every
video alike, which would otherwise make all tones look the same); a fixed projection maps them to 512 dimensions
and each keyframe's vector is L2-normalised. The video's embedding is the normalised mean of its keyframes'
vectors.

The projection is versioned (``EMBEDDING_VERSION``): it is drawn from a generator seeded by the version and the
feature width, with orthonormal columns, so cosine similarity between two videos' embeddings is exactly the cosine
of their pooled latents, on every machine and in every process. Vectors of different versions or of different
models' latent spaces are never compared: ``space()`` names both and is stored with each vector. With random
weights (tiny-wan, the benchmark models) the latents carry only what a random encoder keeps of the pixels; with a
trained checkpoint they carry its semantics."""

from __future__ import annotations

import hashlib
import math
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the worker has torch; the API and the refit never import this module's torch paths
    import torch

EMBEDDING_VERSION = "kf1"
DIMENSIONS = 512
KEYFRAME_EVERY = 8  # frames
GRID = 8  # pooled cells per side: with Wan's VAE, 4 lost a recoloured copy among 100 clips 9 times, 8 once
# The channel means count as much as the layout of each keyframe: a recoloured copy keeps its layout, a different
# scene differs in both.
_TONE_WEIGHT = 1.0


def space(model: str) -> str:
    """The embedding space of ``model``'s videos: vectors are compared only within one space."""
    return f"{EMBEDDING_VERSION}/{model}"


def keyframe_indices(num_frames: int, *, temporal_ratio: int) -> list[int]:
    """The latent frames of frames 0, 8, 16, …: latent frame ``ceil(f / ratio)`` holds frame ``f``."""
    latent_frames = (num_frames - 1) // temporal_ratio + 1
    picked = [math.ceil(frame / temporal_ratio) for frame in range(0, num_frames, KEYFRAME_EVERY)]
    return sorted({min(index, latent_frames - 1) for index in picked})


def keyframe_features(
    latents: torch.Tensor, *, num_frames: int, temporal_ratio: int, reference: torch.Tensor | None = None
) -> np.ndarray:
    """(keyframes, channels × (GRID² + 1)) float32 on the host, from one video's latents (channels, latent
    frames, height, width) or (1, …), wherever they are (the pooling runs on their device). ``reference``
    (channels, latent frames): ``reference_tones`` of the same frame count, subtracted from the tones."""
    import torch
    import torch.nn.functional as F

    if latents.dim() == 5:
        latents = latents[0]
    indices = keyframe_indices(num_frames, temporal_ratio=temporal_ratio)
    picked = latents[:, indices].float()  # (C, K, h, w)
    frames = picked.permute(1, 0, 2, 3)  # (K, C, h, w)
    with torch.no_grad():
        grid = F.adaptive_avg_pool2d(frames, GRID).flatten(2)  # (K, C, GRID²)
        tones = grid.mean(dim=2, keepdim=True)  # (K, C, 1)
        layout = (grid - tones).flatten(1)
        if reference is not None:
            tones = tones - reference[:, indices].T.to(tones.device, tones.dtype).unsqueeze(2)
        features = torch.cat([layout, _TONE_WEIGHT * tones.flatten(1)], dim=1)
    return features.cpu().numpy().astype(np.float32)


@lru_cache(maxsize=8)
def projection(width: int, *, version: str = EMBEDDING_VERSION) -> np.ndarray:
    """The fixed (DIMENSIONS, width) projection of ``version``: orthonormal columns (rows when width > 512)."""
    seed = int.from_bytes(hashlib.sha256(f"vidq-keyframes/{version}/{width}".encode()).digest()[:8], "big")
    gaussian = np.random.Generator(np.random.PCG64(seed)).standard_normal((DIMENSIONS, width))
    if width <= DIMENSIONS:
        q, r = np.linalg.qr(gaussian)  # (512, width), orthonormal columns
    else:
        qt, r = np.linalg.qr(gaussian.T)
        q = qt.T
    # QR is unique only up to the signs of R's diagonal: fixed here so every LAPACK gives the same matrix.
    signs = np.sign(np.diag(r))
    signs[signs == 0] = 1.0
    fixed = q * signs if width <= DIMENSIONS else q * signs[:, None]
    return fixed.astype(np.float32)


def _normalised(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
    return np.asarray(vectors / np.maximum(norms, 1e-12), dtype=np.float32)


def embed(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(keyframe vectors (K, 512), the video's vector (512,)), each L2-normalised."""
    keyframes = _normalised(features @ projection(features.shape[1]).T)
    return keyframes, _normalised(keyframes.mean(axis=0))


def encode_frames(vae: object, frames: np.ndarray) -> torch.Tensor:
    """The normalised latents the transformer works in, of uint8 RGB frames (T, H, W, 3) encoded by ``vae`` (a
    Wan-family ``AutoencoderKLWan``): what a video that did not come out of the pipeline (an upload, a re-encoded
    copy) is embedded from. T is 4k + 1; H and W multiples of 8."""
    import torch

    module: torch.nn.Module = vae  # type: ignore[assignment]
    config = vae.config  # type: ignore[attr-defined]
    parameter = next(module.parameters())
    pixels = torch.from_numpy(frames).to(parameter.device).permute(3, 0, 1, 2)[None].float() / 127.5 - 1.0
    with torch.no_grad():
        moments = vae.encode(pixels.to(parameter.dtype)).latent_dist.mode().float()  # type: ignore[attr-defined]
    shape = (1, config.z_dim, 1, 1, 1)
    mean = torch.tensor(config.latents_mean, device=moments.device).view(shape)
    std = torch.tensor(config.latents_std, device=moments.device).view(shape)
    latents: torch.Tensor = (moments - mean) / std
    return latents


def reference_tones(vae: object, num_frames: int) -> torch.Tensor:
    """(channels, latent frames): the mean normalised latent of a plain mid-grey clip of ``num_frames`` frames
    (64×64 pixels: a uniform picture's latents are uniform too, away from the borders), per latent frame."""
    grey = np.full((num_frames, 64, 64, 3), 128, np.uint8)
    tones: torch.Tensor = encode_frames(vae, grey)[0].mean(dim=(2, 3))
    return tones
