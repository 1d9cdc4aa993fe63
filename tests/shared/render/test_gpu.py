"""The tiny Wan pipeline on CUDA in bf16. It renders noise: the point is the dtypes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from shared.render.attention import SDPA_PREFERENCE, flash4_unavailable, install_flash4
from shared.render.pipeline import VideoPipeline
from shared.render.precision import resolve_device
from shared.render.registry import TINY_WAN, build_pipeline
from shared.render.tiers import policy_for
from shared.spec import GenerationSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SPEC = GenerationSpec(
    model=TINY_WAN,
    prompt="a boat on a calm lake at sunrise",
    negative_prompt="blurry",
    width=64,
    height=64,
    num_frames=9,
    fps=8,
    steps=4,
    guidance_scale=5.0,
    seed=3,
)


class Cancelled(Exception):
    pass


@pytest.fixture(scope="module")
def tiny_cuda() -> VideoPipeline:
    device, dtype = resolve_device("cuda", cuda_dtype="bfloat16")
    assert dtype == torch.bfloat16  # every GPU vidq targets (Ampere and newer) has bf16
    pipe = build_pipeline(TINY_WAN, device=device, dtype=dtype)
    return VideoPipeline(pipe, model=TINY_WAN, device=device, dtype=dtype)


def test_tiny_wan_in_bf16_renders_finite_frames(tiny_cuda: VideoPipeline) -> None:
    pipe = tiny_cuda.pipe
    assert pipe.transformer.dtype == torch.bfloat16
    assert pipe.text_encoder.dtype == torch.bfloat16
    assert pipe.vae.dtype == torch.float32  # decoded in fp32 by design

    result = tiny_cuda.generate(SPEC)
    assert result.frames.shape == (9, 64, 64, 3)
    assert result.frames.dtype == np.uint8
    assert result.device.startswith("cuda") and result.dtype == "bfloat16"
    assert result.peak_vram_bytes is not None and result.peak_vram_bytes > 0

    # uint8 hides NaN (it casts to 0), so check the float frames of a plain call with the same seed.
    (video,) = pipe(
        prompt=SPEC.prompt,
        negative_prompt=SPEC.negative_prompt,
        height=SPEC.height,
        width=SPEC.width,
        num_frames=SPEC.num_frames,
        num_inference_steps=SPEC.steps,
        guidance_scale=SPEC.guidance_scale,
        generator=torch.Generator(device=tiny_cuda.device).manual_seed(SPEC.seed),
        output_type="np",
        return_dict=False,
    )
    assert np.isfinite(video).all()
    plain = np.clip(np.rint(video[0] * 255.0), 0, 255).astype(np.uint8)
    assert np.abs(plain.astype(np.int16) - result.frames).max() <= 1


def test_cancel_releases_device_memory(tiny_cuda: VideoPipeline) -> None:
    # Large enough that what one step holds (latents, mask, noise predictions: about 1.3 MiB) shows.
    spec = SPEC.model_copy(update={"width": 256, "height": 256, "num_frames": 17})
    tiny_cuda.generate(spec)  # warm: kernels, workspaces and scheduler state allocated once
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()

    def cancel(done: int, total: int) -> None:
        if done == 2:
            raise Cancelled

    with pytest.raises(Cancelled) as caught:
        tiny_cuda.generate(spec, on_step=cancel)
    # The exception is still held (by pytest here, by a task's error log in a worker); the memory is free.
    assert caught.value.__traceback__ is not None
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before < 256 * 1024


def test_flash_attention_4_computes_what_sdpa_computes() -> None:
    device = torch.device("cuda")
    reason = flash4_unavailable(device, head_dim=128, dtype=torch.bfloat16)
    if reason is not None:
        pytest.skip(f"FlashAttention 4 cannot run here: {reason}")
    install_flash4()
    generator = torch.Generator(device=device).manual_seed(0)
    # Wan 2.1 1.3B's heads (12 × 128), a batch of two as classifier-free guidance runs them, self and cross.
    q = torch.randn((2, 4096, 12, 128), device=device, dtype=torch.bfloat16, generator=generator)
    for kv_tokens in (4096, 512):
        shape = (2, kv_tokens, 12, 128)
        k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16, generator=generator) for _ in "kv")
        got = torch.ops.vidq.flash_attention_4(q, k, v, None, False)
        want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
        assert got.shape == want.shape and got.dtype == torch.bfloat16
        assert (got.float() - want.float()).abs().max() < 2e-2  # bf16 rounding of outputs of magnitude < 1


def test_a_model_whose_heads_flash_attention_4_has_no_kernel_for_runs_on_sdpa(tiny_cuda: VideoPipeline) -> None:
    exact = VideoPipeline(
        build_pipeline(TINY_WAN, device=tiny_cuda.device, dtype=torch.bfloat16),
        model=TINY_WAN,
        device=tiny_cuda.device,
        dtype=torch.bfloat16,
        policy=policy_for("exact", device=tiny_cuda.device, compile_mode="off"),
    )
    assert exact.pipe.transformer.config.attention_head_dim == 12 and not exact.flash4
    assert exact.generate(SPEC).precision.attention in SDPA_PREFERENCE


def test_the_fast_tier_renders_on_the_gpu_and_says_which_8_bit_format_ran(tiny_cuda: VideoPipeline) -> None:
    from shared.render.quantize import INT8_WEIGHT_ONLY

    device = tiny_cuda.device
    pipe = build_pipeline(TINY_WAN, device=device, dtype=torch.bfloat16)
    policy = policy_for("fast", device=device)
    fast = VideoPipeline(pipe, model=TINY_WAN, device=device, dtype=torch.bfloat16, policy=policy)
    result = fast.generate(SPEC)
    # tiny-wan's sides are not multiples of 16: on a GPU with fp8 its layers take int8 weights, and say why.
    (record,) = result.precision.linear
    assert record["runs"] == INT8_WEIGHT_ONLY and record["layers"] > 0 and record["reason"]
    assert np.isfinite(result.frames).all() and result.frames.shape == tiny_cuda.generate(SPEC).frames.shape


def test_an_fp8_layer_computes_its_linear_to_fp8_precision_eager_and_compiled() -> None:
    from shared.render.quantize import Fp8RowwiseLinear, unavailable

    device = torch.device("cuda")
    if unavailable("fp8_e4m3_rowwise", device) is not None:
        pytest.skip("no fp8 products on this GPU")
    linear = torch.nn.Linear(256, 128, device=device, dtype=torch.bfloat16)
    layer = Fp8RowwiseLinear(linear)
    x = torch.randn(4, 77, 256, device=device, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = linear(x).float()
        got = layer(x)
        compiled = torch.compile(layer, fullgraph=True)(x)
    assert ((got.float() - want).norm() / want.norm()) < 0.05
    assert ((compiled.float() - got.float()).norm() / want.norm()) < 0.01


def test_the_fp8_attention_kernel_computes_attention_to_fp8_precision() -> None:
    from shared.render.fp8_attention import fp8_attention, fp8_attention_unavailable

    device = torch.device("cuda")
    if fp8_attention_unavailable(device, head_dim=128, dtype=torch.bfloat16) is not None:
        pytest.skip("no fp8 on this GPU")
    generator = torch.Generator(device=device).manual_seed(0)
    for tokens_q, tokens_k in ((1000, 1000), (1000, 512), (4096, 4096)):
        q = torch.randn(2, tokens_q, 12, 128, device=device, dtype=torch.bfloat16, generator=generator)
        k, v = (
            torch.randn(2, tokens_k, 12, 128, device=device, dtype=torch.bfloat16, generator=generator) for _ in "kv"
        )
        want = F.scaled_dot_product_attention(
            q.transpose(1, 2).float(), k.transpose(1, 2).float(), v.transpose(1, 2).float()
        )
        got = fp8_attention(q, k, v).transpose(1, 2).float()
        assert ((got - want).norm() / want.norm()) < 0.08  # 0.054 at Wan's shapes on an H200


def test_cudnns_fp8_attention_computes_attention_to_fp8_precision_and_as_its_reference() -> None:
    from shared.render import fp8_attention_cudnn
    from shared.render.fp8_attention import CUDNN_FP8_ATTENTION, fp8_attention_unavailable

    device = torch.device("cuda")
    reason = fp8_attention_unavailable(device, head_dim=128, dtype=torch.bfloat16, kernel=CUDNN_FP8_ATTENTION)
    if reason is not None:
        pytest.skip(reason)
    generator = torch.Generator(device=device).manual_seed(0)
    # Tokens not a multiple of any tile; a cross-attention's 512 keys; a batch of one.
    for batch, tokens_q, tokens_k in ((2, 1000, 1000), (2, 1000, 512), (1, 4100, 4100)):
        q = torch.randn(batch, tokens_q, 12, 128, device=device, dtype=torch.bfloat16, generator=generator)
        k, v = (
            torch.randn(batch, tokens_k, 12, 128, device=device, dtype=torch.bfloat16, generator=generator)
            for _ in "kv"
        )
        k = k + 1.5  # a shared offset, which the smoothing takes out
        want = F.scaled_dot_product_attention(
            q.transpose(1, 2).float(), k.transpose(1, 2).float(), v.transpose(1, 2).float()
        ).transpose(1, 2)
        got = fp8_attention_cudnn.attention(q, k, v)
        assert got.shape == q.shape and got.dtype == torch.bfloat16
        assert ((got.float() - want).norm() / want.norm()) < 0.08  # 0.060 at Wan's shapes on an H200
        # The operator against its CPU reference, on the same fp8 inputs.
        q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k - k.mean(dim=1, keepdim=True), v))
        one = torch.ones((1, 1, 1, 1), device=device)
        args = (q8, k8, v8, one, one, one, one, 128**-0.5)
        on_gpu = torch.ops.vidq.cudnn_fp8_attention(*args).float()
        on_cpu = fp8_attention_cudnn.reference(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args))
        assert ((on_gpu.cpu() - on_cpu.float()).norm() / on_cpu.float().norm()) < 0.05


def test_the_fast_tier_runs_its_self_attention_on_cudnns_fp8_kernel_where_it_can(tiny_cuda: VideoPipeline) -> None:
    from shared.render.fp8_attention import CUDNN_FP8_ATTENTION, fp8_attention_unavailable

    device = tiny_cuda.device
    pipe = build_pipeline(TINY_WAN, device=device, dtype=torch.bfloat16)
    head_dim = pipe.transformer.config.attention_head_dim
    fast = VideoPipeline(
        pipe, model=TINY_WAN, device=device, dtype=torch.bfloat16, policy=policy_for("fast", device=device)
    )
    result = fast.generate(SPEC)
    reason = fp8_attention_unavailable(device, head_dim=head_dim, dtype=torch.bfloat16, kernel=CUDNN_FP8_ATTENTION)
    assert (result.precision.attention == CUDNN_FP8_ATTENTION) == (reason is None), reason
    assert np.isfinite(result.frames).all()
