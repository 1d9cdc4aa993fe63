"""The built-in architectures, built from configs with seeded random weights: no download (docs/architecture.md,
"Rendering").

* ``build_tiny_wan``: a real ``WanPipeline`` from tiny configs (the sizes of diffusers' own Wan pipeline tests).
  It renders noise, not video; it exists so tests, CI and the CPU demo run the real pipeline code end to end in
  well under a second.
* ``build_wan21_13b_arch``: the Wan2.1-T2V-1.3B architecture at full size. It renders noise too, but its compute
  and memory cost are the real model's, which is what benchmarks need.
"""

from __future__ import annotations

import torch

# From their own modules: to a type checker the package root re-exports placeholder classes.
from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan
from diffusers.models.transformers.transformer_wan import WanTransformer3DModel
from diffusers.pipelines.wan.pipeline_wan import WanPipeline
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
from diffusers.schedulers.scheduling_unipc_multistep import UniPCMultistepScheduler
from diffusers.schedulers.scheduling_utils import SchedulerMixin
from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

from shared.render.precision import cast_like_from_pretrained, materialise_on, text_encoder_fp32_modules
from shared.render.tokenizer import build_tokenizer

TINY_WAN = "tiny-wan"
WAN21_13B_ARCH = "wan2.1-1.3b-arch"
# The origin of each built-in model's weights (seeded random initialisation): part of its embeddings' cache
# identity (shared/render/text.py). Change it whenever a builder's seeding or initialisation changes.
TINY_WAN_BUILD = "vidq/tiny-wan/seed0/v1"
WAN21_BUILD = "vidq/wan2.1-1.3b-arch/seed0/v1"


def tiny_wan_text_config(vocab_size: int) -> UMT5Config:
    return UMT5Config(
        vocab_size=vocab_size,
        d_model=32,  # must equal the transformer's text_dim
        d_kv=8,
        d_ff=37,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        dropout_rate=0.0,
    )


def wan21_text_config() -> UMT5Config:
    """UMT5-XXL as Wan2.1 ships it (5.7B parameters, ≈ 11 GiB in bf16)."""
    return UMT5Config(
        vocab_size=256384,
        d_model=4096,
        d_kv=64,
        d_ff=10240,
        num_layers=24,
        num_heads=64,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu",
        dropout_rate=0.0,
    )


def build_tiny_wan_text_encoder(*, device: torch.device, dtype: torch.dtype) -> UMT5EncoderModel:
    """Tiny Wan's text encoder alone: the same weights ``build_tiny_wan`` gives its pipeline."""
    with materialise_on(torch.device("cpu"), torch.float32):
        torch.manual_seed(0)
        encoder = UMT5EncoderModel(tiny_wan_text_config(len(build_tokenizer())))
    cast_like_from_pretrained(encoder, dtype, keep_fp32=text_encoder_fp32_modules(encoder, dtype))
    encoder.to(device)  # type: ignore[arg-type]  # transformers types .to() for its own arguments only
    encoder.eval()
    return encoder


def build_wan21_text_encoder(*, device: torch.device, dtype: torch.dtype) -> UMT5EncoderModel:
    """Wan2.1's UMT5-XXL alone, materialised straight on ``device`` in ``dtype``: the same weights
    ``build_wan21_13b_arch`` gives its pipeline."""
    with materialise_on(device, dtype):
        torch.manual_seed(0)
        encoder = UMT5EncoderModel(wan21_text_config())
    cast_like_from_pretrained(encoder, dtype, keep_fp32=text_encoder_fp32_modules(encoder, dtype))
    encoder.eval()
    return encoder


def build_tiny_wan(*, device: torch.device, dtype: torch.dtype, text_encoder: bool = True) -> WanPipeline:
    """Tiny Wan with seeded random weights (sizes of diffusers' own Wan pipeline tests). It renders noise.
    ``text_encoder=False`` leaves the encoder out: the pipeline then takes prompt embeddings only."""
    tokenizer = build_tokenizer()
    # Built on the CPU in fp32 with a seed before each module, so the weights are the same on every machine.
    with materialise_on(torch.device("cpu"), torch.float32):
        torch.manual_seed(0)
        vae = AutoencoderKLWan(
            base_dim=3,
            z_dim=16,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
        )
        torch.manual_seed(0)
        encoder = UMT5EncoderModel(tiny_wan_text_config(len(tokenizer))) if text_encoder else None
        torch.manual_seed(0)
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=12,
            in_channels=16,
            out_channels=16,
            text_dim=32,
            freq_dim=256,
            ffn_dim=32,
            num_layers=2,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            # Positions per latent axis (diffusers' default). Its tests use 32, which caps a video at 512 pixels a
            # side (32 patches of 16): 480p, the API's default size, failed at the first step. RoPE holds no
            # weights, and the value at each position does not depend on this: smaller videos are unchanged.
            rope_max_seq_len=1024,
        )
    scheduler = FlowMatchEulerDiscreteScheduler(shift=7.0)
    return _assemble(tokenizer, encoder, transformer, vae, scheduler, device=device, dtype=dtype)


def build_wan21_13b_arch(*, device: torch.device, dtype: torch.dtype, text_encoder: bool = True) -> WanPipeline:
    """Wan2.1-T2V-1.3B at full size with random weights: the real model's cost, noise for output.
    ``text_encoder=False`` leaves out UMT5-XXL (≈ 11 GiB in bf16): the pipeline then takes prompt embeddings only."""
    # Materialise straight on the target device in the target dtype: the 5.7B-parameter UMT5-XXL encoder would
    # need 23 GB of host RAM in fp32 first, and a host-to-device copy of it costs more than the GPU init does.
    encoder = build_wan21_text_encoder(device=device, dtype=dtype) if text_encoder else None
    with materialise_on(device, dtype):
        torch.manual_seed(0)
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=12,
            attention_head_dim=128,
            in_channels=16,
            out_channels=16,
            text_dim=4096,
            freq_dim=256,
            ffn_dim=8960,
            num_layers=30,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            eps=1e-6,
        )
    with materialise_on(device, torch.float32):
        torch.manual_seed(0)
        vae = AutoencoderKLWan()
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=3.0
    )
    return _assemble(build_tokenizer(), encoder, transformer, vae, scheduler, device=device, dtype=dtype)


def _assemble(
    tokenizer: PreTrainedTokenizerFast,
    text_encoder: UMT5EncoderModel | None,
    transformer: WanTransformer3DModel,
    vae: AutoencoderKLWan,
    scheduler: SchedulerMixin,
    *,
    device: torch.device,
    dtype: torch.dtype,
) -> WanPipeline:
    # The precision from_pretrained(dtype=...) would give a real checkpoint: dtype, except the modules each
    # library lists as fp32-only. The VAE is left in the fp32 it was built in (see registry.build_pipeline).
    cast_like_from_pretrained(transformer, dtype, keep_fp32=WanTransformer3DModel._keep_in_fp32_modules or ())
    if text_encoder is not None:
        cast_like_from_pretrained(text_encoder, dtype, keep_fp32=text_encoder_fp32_modules(text_encoder, dtype))
    pipe = WanPipeline(
        tokenizer=tokenizer,  # type: ignore[arg-type]  # annotated AutoTokenizer, takes any tokenizer
        text_encoder=text_encoder,  # type: ignore[arg-type]  # None: the pipeline takes embeddings only
        vae=vae,
        scheduler=scheduler,  # type: ignore[arg-type]  # annotated FlowMatchEuler, takes any scheduler
        transformer=transformer,
    )
    pipe.to(device)
    for module in (text_encoder, transformer, vae):
        if module is not None:
            module.eval()  # modules built by hand start in training mode (dropout on); from_pretrained ones don't
    pipe.set_progress_bar_config(disable=True)  # progress goes through on_step
    return pipe
