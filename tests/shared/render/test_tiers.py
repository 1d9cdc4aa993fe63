"""Precision tiers on the CPU: the policy's levers, its module table against the weights a build really holds, the
attention kernel's fall-backs and its route through diffusers, the compiled VAE decoder against the eager one, the
batched guidance loop against diffusers' own, warm-up and the compile cache's archive. (The GPU figures are the
benchmark's: benchmarks/gpu_exact.py.)"""

from __future__ import annotations

import copy
import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend

from shared.infra.config import Settings
from shared.render import attention, vae
from shared.render.attention import FLASH_ATTENTION_4, SDPA_PREFERENCE, flash4_unavailable, use_flash4
from shared.render.pipeline import RenderResult, VideoPipeline
from shared.render.registry import TINY_WAN, build_pipeline
from shared.render.tiers import (
    ATTENTION_PREFERENCE,
    MODULE_TABLE,
    eager_policy,
    policy_for,
    resolve_tier,
    tensor_format,
)
from shared.render.warmup import warm_up
from shared.spec import parse_shape
from tests.shared.render.test_registry import make_spec

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def reference() -> RenderResult:
    """diffusers' own loop, every lever off."""
    pipe = build_pipeline(TINY_WAN, device=CPU, dtype=torch.float32)
    return VideoPipeline(pipe, model=TINY_WAN, device=CPU, dtype=torch.float32).generate(make_spec())


def exact_on_cpu(**levers: object) -> VideoPipeline:
    pipe = build_pipeline(TINY_WAN, device=CPU, dtype=torch.float32)
    policy = replace(policy_for("exact", device=CPU), **levers)  # type: ignore[arg-type]
    return VideoPipeline(pipe, model=TINY_WAN, device=CPU, dtype=torch.float32, policy=policy)


def test_a_job_renders_in_the_tier_it_asks_for_or_the_workers_default() -> None:
    assert resolve_tier(None, "exact") == ("exact", None)
    assert resolve_tier("exact", "fast") == ("exact", None)
    assert resolve_tier("fast", "exact") == ("fast", None)
    assert resolve_tier(None, "fast") == ("fast", None)
    with pytest.raises(ValueError, match="unknown precision"):
        resolve_tier("int4", "exact")  # type: ignore[arg-type]


def test_the_levers_follow_the_device_the_compile_setting_and_the_memory_mode() -> None:
    cuda = torch.device("cuda")  # a device object needs no GPU
    on_gpu = policy_for("exact", device=cuda)
    assert on_gpu.compile_blocks and on_gpu.fused_qkv and on_gpu.cfg_batch and on_gpu.vae_dtype == "bfloat16"
    assert not policy_for("exact", device=cuda, compile_mode="off").compile_blocks
    on_cpu = policy_for("exact", device=CPU)
    assert not on_cpu.compile_blocks and on_cpu.vae_dtype == "float32"
    assert policy_for("exact", device=CPU, compile_mode="on").compile_blocks
    assert on_gpu.compile_vae and on_gpu.attention == ATTENTION_PREFERENCE and on_gpu.attention[0] == FLASH_ATTENTION_4
    assert not policy_for("exact", device=cuda, compile_mode="off").compile_vae
    assert on_cpu.attention == SDPA_PREFERENCE  # FlashAttention 4 has no CPU kernel
    # The fast tier's self-attentions: cuDNN's fp8 kernel first, then what exact runs; on the CPU SDPA's only.
    assert policy_for("fast", device=cuda).attention == ("CUDNN_FP8_ATTENTION", *ATTENTION_PREFERENCE)
    assert policy_for("fast", device=CPU).attention == SDPA_PREFERENCE
    streamed = policy_for("exact", device=cuda, memory_mode="low_vram")
    assert not (streamed.compile_blocks or streamed.compile_vae or streamed.fused_qkv or streamed.cfg_batch)
    assert eager_policy() == replace(on_cpu, fused_qkv=False, cfg_batch=False)


def test_the_table_names_the_format_every_weight_of_a_bf16_build_is_in() -> None:
    pipe = build_pipeline(TINY_WAN, device=CPU, dtype=torch.bfloat16)
    seen = {"float32": 0, "bfloat16": 0}
    for component in ("transformer", "text_encoder", "vae"):
        module: torch.nn.Module = getattr(pipe, component)
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if not tensor.is_floating_point():
                continue
            wanted = tensor_format("exact", f"{component}.{name}", compute="bfloat16", vae="float32")
            assert {"fp32": "float32"}.get(wanted, wanted) == str(tensor.dtype).removeprefix("torch."), name
            seen[str(tensor.dtype).removeprefix("torch.")] += 1
    assert seen["float32"] > 0 and seen["bfloat16"] > 0  # both kinds of row were checked against real weights
    with pytest.raises(LookupError):
        tensor_format("exact", "scheduler.sigmas", compute="bfloat16", vae="float32")
    assert len(MODULE_TABLE["exact"]) == len(set(MODULE_TABLE["exact"]))


def test_the_exact_levers_render_the_same_video_as_diffusers_own_loop(reference: RenderResult) -> None:
    exact = exact_on_cpu()
    assert exact.policy.fused_qkv and exact.policy.cfg_batch  # one GEMM for q/k/v, both guidance passes in one batch
    result = exact.generate(make_spec())
    # The same math; float32 GEMMs of another shape may round differently in the last bit, never visibly.
    assert np.abs(result.frames.astype(np.int16) - reference.frames).max() <= 1
    assert result.precision.tier == "exact" and result.precision.policy["cfg_batch"] is True
    unguided = exact.generate(make_spec(guidance_scale=1.0))  # no negative prompt: a batch of one
    assert unguided.frames.shape == reference.frames.shape


def test_the_attention_backend_falls_back_to_the_next_one_that_can_run() -> None:
    # cuDNN's kernel is first in the preference, and absent on a CPU: the next one that runs there is used.
    default = exact_on_cpu().generate(make_spec())
    q = torch.empty((1, 2, 16, 8))
    assert default.precision.attention == SDPBackend(torch._fused_sdp_choice(q, q, q)).name != "CUDNN_ATTENTION"
    math_only = exact_on_cpu(attention=("CUDNN_ATTENTION", "MATH")).generate(make_spec())
    assert math_only.precision.attention == "MATH"
    assert np.abs(math_only.frames.astype(np.int16) - default.frames).max() <= 1  # another kernel, the same math


def test_flash_attention_4_falls_back_to_sdpa_where_it_cannot_run(caplog: pytest.LogCaptureFixture) -> None:
    assert "CUDA" in (flash4_unavailable(CPU, head_dim=128, dtype=torch.bfloat16) or "")
    # Asked for first, and unavailable on a CPU: the render runs on SDPA's preference and says which kernel ran.
    with caplog.at_level(logging.INFO, logger="vidq.render"):
        pipeline = exact_on_cpu(attention=ATTENTION_PREFERENCE)
    assert not pipeline.flash4
    assert any("FlashAttention 4 not used" in r.getMessage() for r in caplog.records)
    result = pipeline.generate(make_spec())
    q = torch.empty((1, 2, 16, 8))
    assert result.precision.attention == SDPBackend(torch._fused_sdp_choice(q, q, q)).name


def test_flash_attention_4_is_used_only_for_heads_dtypes_and_gpus_it_has_kernels_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cuda = torch.device("cuda")  # a device object needs no GPU; its capability is set below

    def reason(capability: tuple[int, int], head_dim: int = 128, dtype: torch.dtype = torch.bfloat16) -> str:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _device=None: capability)
        return flash4_unavailable(cuda, head_dim=head_dim, dtype=dtype) or ""

    assert "not installed" in reason((9, 0))  # Hopper, Wan's 128-wide heads in bf16: only the package is missing
    assert "not installed" in reason((10, 0), head_dim=64, dtype=torch.float16)
    assert "8.9" in reason((8, 9))  # Ada: no kernels
    assert "head size 12" in reason((9, 0), head_dim=12)  # tiny-wan's heads
    assert "head size 192" in reason((10, 0), head_dim=192)
    assert "float32" in reason((9, 0), dtype=torch.float32)


def test_flash_attention_4_is_reached_through_diffusers_dispatcher_from_compiled_blocks(
    reference: RenderResult,
) -> None:
    from diffusers.models.attention_dispatch import _HUB_KERNELS_REGISTRY, AttentionBackendName

    pipe = build_pipeline(TINY_WAN, device=CPU, dtype=torch.float32)
    attentions = [m for m in pipe.transformer.modules() if hasattr(getattr(m, "processor", None), "_attention_backend")]
    assert use_flash4(pipe.transformer) == len(attentions) > 0  # every attention of every block, self and cross
    assert {m.processor._attention_backend for m in attentions} == {AttentionBackendName.FLASH_4_HUB}
    # diffusers' flash_4_hub backend calls the installed package's kernel, never a Hub download.
    assert _HUB_KERNELS_REGISTRY[AttentionBackendName.FLASH_4_HUB].kernel_fn is attention._flash4
    # The operator's declared output (what compiled graphs plan with): the query's tokens and heads, the value's width.
    with FakeTensorMode():
        q, k, v = torch.empty(2, 96, 4, 16), torch.empty(2, 7, 4, 16), torch.empty(2, 7, 4, 16)
        assert tuple(torch.ops.vidq.flash_attention_4(q, k, v, None, False).shape) == (2, 96, 4, 16)

    # The kernel has no CPU build: a CPU stand-in (SDPA) shows the route end to end through compiled blocks.
    calls: list[tuple[int, ...]] = []

    def on_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, causal: bool) -> torch.Tensor:
        calls.append(tuple(q.shape))
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), scale=scale, is_causal=causal)
        return out.transpose(1, 2).contiguous()

    torch.library.register_kernel("vidq::flash_attention_4", "cpu", on_cpu)
    policy = replace(policy_for("exact", device=CPU, compile_mode="on"), compile_vae=False)
    compiled = VideoPipeline(pipe, model=TINY_WAN, device=CPU, dtype=torch.float32, policy=policy)
    compiled.flash4 = True  # routed above, as the pipeline routes it on a GPU that has the kernel
    torch._dynamo.utils.counters.clear()
    result = compiled.generate(make_spec())
    assert not torch._dynamo.utils.counters["graph_break"]  # the blocks stay whole graphs around the operator
    assert len(calls) == len(attentions) * make_spec().steps  # each attention once per step: both passes batched
    assert result.precision.attention == FLASH_ATTENTION_4
    assert np.abs(result.frames.astype(np.int16) - reference.frames).max() <= 1


def test_the_compiled_vae_decoder_decodes_as_the_eager_one_with_one_set_of_graphs_for_every_length() -> None:
    pipe = build_pipeline(TINY_WAN, device=CPU, dtype=torch.float32, text_encoder=False)
    eager = copy.deepcopy(pipe.vae)
    policy = replace(eager_policy(), compile_vae=True)
    compiled = VideoPipeline(pipe, model=TINY_WAN, device=CPU, dtype=torch.float32, policy=policy).pipe.vae
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    graphs = []
    with torch.inference_mode():
        for latent_frames in (4, 6, 3):  # 13, 21 and 9 frames
            z = torch.randn(1, pipe.vae.config.z_dim, latent_frames, 8, 8, generator=torch.Generator().manual_seed(1))
            got, want = compiled.decode(z, return_dict=False)[0], eager.decode(z, return_dict=False)[0]
            assert got.shape == want.shape
            assert torch.allclose(got, want, atol=1e-5)
            graphs.append(counters["stats"]["unique_graphs"])
    assert not counters["graph_break"]  # the whole decoder is one graph per call
    # The first frames' caches differ in length, so a few graphs for the first video; none more for other lengths.
    assert 0 < graphs[0] == graphs[1] == graphs[2] <= 6


def test_a_vae_decoder_torch_cannot_compile_decodes_eagerly(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def untraceable(fn: object, **_options: object) -> object:
        def run(*_args: object, **_kwargs: object) -> None:
            raise torch._dynamo.exc.Unsupported("a construct this torch cannot trace")

        return run

    monkeypatch.setattr(vae.torch, "compile", untraceable)
    pipe = build_pipeline(TINY_WAN, device=CPU, dtype=torch.float32, text_encoder=False)
    eager = copy.deepcopy(pipe.vae)
    vae.compile_decoder(pipe.vae)
    z = torch.randn(1, pipe.vae.config.z_dim, 3, 8, 8)
    with caplog.at_level(logging.WARNING, logger="vidq.render"), torch.inference_mode():
        for _ in range(2):
            assert torch.equal(pipe.vae.decode(z, return_dict=False)[0], eager.decode(z, return_dict=False)[0])
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings.count("the VAE decoder cannot be compiled here; it decodes eagerly") == 1  # once, then eager


def test_warm_up_renders_each_shape_before_any_job_and_needs_no_text_encoder() -> None:
    exact = exact_on_cpu()
    exact.encoder = None  # an encoder-free worker warms up too: the warm-up brings its own text embeddings
    seconds = warm_up(exact, ["64x64x9", "32x48x5"])
    assert set(seconds) == {"64x64x9", "32x48x5"} and all(s > 0 for s in seconds.values())
    # (tokens per sample, batch of two for guidance) of both shapes: a job of either starts on warmed kernels.
    assert {batch for _tokens, batch in exact.rendered_shapes} == {2} and len(exact.rendered_shapes) == 2


def test_warm_up_shapes_are_checked_when_the_settings_load() -> None:
    assert parse_shape("480x832x33") == (480, 832, 33)
    for bad in ("480x832", "480x830x33", "480x832x32", "axbxc"):
        with pytest.raises(ValueError):
            parse_shape(bad)
    assert Settings(worker_warmup_shapes=["480x832x81"]).worker_warmup_shapes == ["480x832x81"]
    with pytest.raises(ValueError, match="multiples of 16"):
        Settings(worker_warmup_shapes=["481x832x81"])


def test_the_compile_cache_archive_is_written_and_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shared.render import warmup

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "unchanged")  # restored after the test
    root = warmup.use_compile_cache(str(tmp_path / "cache"))
    assert root is not None and root == tmp_path / "cache" and root.is_dir()
    assert Path(__import__("os").environ["TORCHINDUCTOR_CACHE_DIR"]) == root / "inductor"
    compiled = torch.compile(lambda x: torch.sin(x) * 2 + 1, fullgraph=True, dynamic=False)
    x = torch.randn(8)
    assert torch.allclose(compiled(x), torch.sin(x) * 2 + 1)
    warmup.save_compile_cache(str(root))
    archives = list(root.glob("artifacts-*.bin"))
    assert len(archives) == 1 and archives[0].stat().st_size > 0
    warmup.use_compile_cache(str(root))  # a restarted worker loads it (an unreadable one is logged, not fatal)
    (root / archives[0].name).write_bytes(b"not an archive")
    assert warmup.use_compile_cache(str(root)) == root  # logged; the worker compiles afresh
    blocked = tmp_path / "file"
    blocked.write_text("a file where the directory should be")
    assert warmup.use_compile_cache(str(blocked / "cache")) is None  # logged; kernels just do not persist
