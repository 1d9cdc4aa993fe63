"""tiny-wan, the default model, denoises every size the API admits by default (it once stopped at 512 pixels a side:
480p, the API's default size, failed at its first step)."""

from __future__ import annotations

import pytest
import torch

from shared.infra.config import Settings
from shared.jobs.schemas import RESOLUTION_PRESETS
from shared.render.architectures import build_tiny_wan


@pytest.mark.parametrize("preset", ["480p", "720p"])
def test_tiny_wan_denoises_each_preset_the_default_caps_admit(preset: str) -> None:
    width, height = RESOLUTION_PRESETS[preset]
    assert width * height <= Settings().max_pixels
    pipe = build_tiny_wan(device=torch.device("cpu"), dtype=torch.float32)
    latents = pipe(
        prompt="a lighthouse in a storm",
        width=width,
        height=height,
        num_frames=5,
        num_inference_steps=1,
        generator=torch.Generator().manual_seed(0),
        output_type="latent",
    ).frames
    # (batch, z_dim, latent frames, H/8, W/8): the VAE's scale factors, temporal 4 and spatial 8.
    assert tuple(latents.shape) == (1, 16, 2, height // 8, width // 8)
    assert torch.isfinite(latents).all()


def test_the_longer_rope_table_leaves_smaller_videos_unchanged() -> None:
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    pipe = build_tiny_wan(device=torch.device("cpu"), dtype=torch.float32)
    rope = pipe.transformer.rope
    short = WanRotaryPosEmbed(rope.attention_head_dim, rope.patch_size, 32)  # the length diffusers' tests use
    assert rope.max_seq_len > 32
    assert torch.equal(rope.freqs_cos[:32], short.freqs_cos) and torch.equal(rope.freqs_sin[:32], short.freqs_sin)
    # and nothing of it is stored with the weights
    assert not any("freqs" in key for key in pipe.transformer.state_dict())
