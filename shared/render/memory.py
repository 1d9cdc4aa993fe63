"""Whether a ``low_vram`` render's VAE decodes its latents whole or in tiles.

Tiling bounds the decode's memory by the tile, not the frame, but decodes overlapping tiles and blends them: on an
H200 it doubled the decode's time (480×832×33: 2.19 s against 1.14 s). So a ``low_vram`` pipeline on CUDA decides per
decode: whole when the estimated peak of a whole decode fits the memory budget, in tiles when it does not. A wrong
estimate costs time, never the job: a whole decode that runs out of memory is decoded again in tiles
(shared/render/pipeline.py ``VideoPipeline._decode``).

The memory model (``untiled_decode_bytes``). The Wan VAE decodes one latent frame at a time, carrying a cache of the
last two frames' features of each causal convolution from one latent frame to the next, so its peak does not grow
with the video's length but with the frame size. Per decoded pixel, its peak is a few times its widest tensor: the
channels × frames of the widest upsampling stage at the decoded frame size (``DecoderGeometry.widest``: the last
spatial upsampler's input, upsampled to the full size, 192 channels × 4 frames = 768 values per pixel in
Wan 2.1's VAE). Two phases, the larger counts:

* the decoder: ``ACTIVATION_FACTOR`` × the widest values per pixel (the stage's resblocks, their causal pads and the
  cached frames of every stage), plus ``OUTPUT_COPIES`` copies of the video decoded so far (it grows by a
  concatenation per latent frame), in the VAE's dtype;
* the post-processing (``VideoPipeline._decode``): ``POSTPROCESS_COPIES`` float32 copies of the decoded video.

Calibration. Live tensors counted op by op on the CPU (every op's outputs, until their storage is freed) over a
whole decode with the Wan2.1 VAE (wan2.1-1.3b-arch's, in float32 at 64×64 and 64×128 pixels and 9 to 81 frames):
4,925 values per pixel at 9 frames, 4,998 at 33, 5,145 at 81: 6.4 × 768, plus 3 values per pixel and frame (one
copy of the decoded video). In bfloat16 (64×64×9): 5,088 values at 2 bytes, nearly the same count (its norms compute in
float32). Tiny Wan's VAE (3 channels: widest 12): 132 values per pixel at 9 frames, where the video copies weigh
more. On an H200 the resident render's peak less its weights (13.70 GiB: text encoder 10.58, transformer 2.65,
VAE 0.47) is its decode: 8.62 GiB at 480×832×33 and 19.80 GiB at 720×1280×33, both 5,780 float32 values per pixel,
7.27 × 768 plus two copies of the video (benchmarks/results/gpu_memory_modes_h200_20261130.md): the GPU's share above
the CPU's count is cuDNN's workspace and the allocator's rounding. ``ACTIVATION_FACTOR`` = 7.5 covers the GPU's
figure by 3%; post-processing copies: 3 float32 copies of the video counted on the CPU, plus the video itself.
Checked on an H200 (benchmarks/results/gpu_memory_modes_h200_20261204*.md, the decode's peak above its start): the
estimate was 3–4% over it in float32 (8.86 GiB against 8.54 at 480×832×33, 20.46 against 19.70 at 720×1280×33) and
in bfloat16 (4.43 against 4.27, 10.23 against 9.85).
The model is Wan 2.1's decoder; another decoder's (Wan 2.2's residual one) is estimated from its own geometry with
the same constants.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

MIB = 1024**2
GIB = 1024**3

ACTIVATION_FACTOR = 7.5  # peak bytes of the decoder per byte of its widest stage (calibration above)
OUTPUT_COPIES = 2  # copies of the decoded video while the decoder runs: the video so far and its next concatenation
POSTPROCESS_COPIES = 4  # float32 copies of the decoded video while it becomes frames in [0, 1]
# Kept free below the device's free memory: the allocator's segment rounding and fragmentation, and the CUDA
# context's growth on a first decode (cuDNN handles, kernels loaded).
DECODE_MARGIN_BYTES = 1 * GIB


@dataclass(frozen=True, slots=True)
class DecoderGeometry:
    """What the memory model reads of a Wan VAE's decoder."""

    widest: float  # values per decoded pixel of its widest stage: channels × frames decoded per latent frame
    upscale: int  # decoded pixels per latent pixel along a side (the decoder's own; a patched VAE unpatches after)
    frames_per_latent: int  # frames decoded per latent frame after the first (which decodes to one)
    out_channels: int  # the decoder's output channels

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> DecoderGeometry:
        """The geometry of the decoder diffusers' ``AutoencoderKLWan`` builds from ``config`` (its
        ``WanDecoder3d``): stage by stage, each resblock stage's widest tensor and each upsampler's upsampled one."""
        base = config.get("decoder_base_dim") or config.get("base_dim", 96)
        mult = list(config.get("dim_mult", [1, 2, 4, 4]))
        residual = bool(config.get("is_residual", False))
        temporal = list(config.get("temperal_downsample", [False, True, True]))[::-1]
        dims = [base * m for m in [mult[-1], *mult[::-1]]]
        stages = len(mult)
        side, frames, widest = 2 ** (stages - 1), 1, 0.0  # side: the stage's downscale against the decoded frame
        for i in range(stages):
            in_dim = dims[i] // 2 if i > 0 and not residual else dims[i]  # Wan 2.1's upsamplers halve the channels
            out_dim = dims[i + 1]
            widest = max(widest, max(in_dim, out_dim) * frames / side**2)
            if i != stages - 1:  # an upsampler: in time first (where it does), then in space
                frames *= 2 if i < len(temporal) and temporal[i] else 1
                side //= 2
                widest = max(widest, out_dim * frames / side**2)
        return cls(
            widest=widest,
            upscale=2 ** (stages - 1),
            frames_per_latent=frames,
            out_channels=int(config.get("out_channels", 3)) * int(config.get("patch_size") or 1) ** 2,
        )


def untiled_decode_bytes(latent_shape: Sequence[int], geometry: DecoderGeometry, *, element_bytes: int) -> int:
    """The estimated peak device bytes a whole (untiled) decode of latents of ``latent_shape`` (batch, channels,
    frames, height, width) allocates above what is allocated before it, the VAE computing in ``element_bytes``-byte
    values (module docstring)."""
    batch, _channels, latent_frames, height, width = latent_shape
    pixels = height * geometry.upscale * width * geometry.upscale
    frames = 1 + (latent_frames - 1) * geometry.frames_per_latent
    video = geometry.out_channels * frames  # values per pixel of the decoded video
    decoder = element_bytes * (ACTIVATION_FACTOR * geometry.widest + OUTPUT_COPIES * video)
    postprocess = 4 * POSTPROCESS_COPIES * video
    return math.ceil(batch * pixels * max(decoder, postprocess))


def decode_tiled(latent_shape: Sequence[int], geometry: DecoderGeometry, *, element_bytes: int, budget: int) -> bool:
    """Whether latents of ``latent_shape`` decode in tiles: only when a whole decode's estimated peak exceeds
    ``budget`` bytes (equal fits)."""
    return untiled_decode_bytes(latent_shape, geometry, element_bytes=element_bytes) > budget


def chooses_decode_tiling(memory_mode: str, device: torch.device) -> bool:
    """Whether a pipeline decides per decode between whole and tiled: ``low_vram`` on CUDA only. ``resident``
    decodes whole; the CPU's memory is the host's, and it decodes as it always has."""
    return memory_mode == "low_vram" and device.type == "cuda"


def free_device_bytes(device: torch.device) -> int:
    """Bytes a decode on ``device`` can allocate now: the device's free memory and the blocks this process's
    allocator holds cached but unused (it hands those out first)."""
    free, _total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + cached)


@dataclass(frozen=True, slots=True)
class DecodeBudget:
    """A decode's memory budget, read at decode time: ``free_bytes()`` less ``margin_bytes``, and at most
    ``cap_bytes`` where that is set (``worker_low_vram_decode_budget_mb``; 0: no cap). ``free_bytes`` is a function
    so that a test can stand in for a device."""

    free_bytes: Callable[[], int]
    cap_bytes: int = 0
    margin_bytes: int = DECODE_MARGIN_BYTES

    @classmethod
    def on(cls, device: torch.device, *, cap_mb: int = 0) -> DecodeBudget:
        """The budget of decodes on the CUDA device ``device``."""
        return cls(functools.partial(free_device_bytes, device), cap_bytes=cap_mb * MIB)

    def __call__(self) -> int:
        budget = self.free_bytes() - self.margin_bytes
        return min(budget, self.cap_bytes) if self.cap_bytes > 0 else budget
