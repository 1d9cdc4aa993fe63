"""``low_vram``'s VAE decode: whole when its estimated peak fits the memory budget, in tiles when not, in tiles again
after running out of memory (shared/render/memory.py, ``VideoPipeline._decode``). On the CPU with the tiny Wan
pipeline and a budget the test gives; the last test runs on CUDA."""

from __future__ import annotations

import logging
import weakref
from typing import Any

import pytest
import torch
from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from shared.render.memory import (
    DECODE_MARGIN_BYTES,
    GIB,
    MIB,
    DecodeBudget,
    DecoderGeometry,
    chooses_decode_tiling,
    decode_tiled,
    untiled_decode_bytes,
)
from shared.render.pipeline import VideoPipeline
from shared.render.registry import TINY_WAN, apply_memory_mode, build_pipeline, clear_cache, pipeline_for
from shared.spec import GenerationSpec

CPU = torch.device("cpu")
CUDA = torch.device("cuda")
TINY_VAE = {"base_dim": 3, "z_dim": 16, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1}  # build_tiny_wan's VAE
WAN21 = DecoderGeometry.from_config({})  # AutoencoderKLWan's defaults are Wan2.1's VAE (wan2.1-1.3b-arch's)
# Latents of 480×832×33 and 720×1280×33: (batch, channels, latent frames, latent height, latent width).
LATENTS_480P = (1, 16, 9, 60, 104)
LATENTS_720P = (1, 16, 9, 90, 160)
# A tiny-wan decode of 272×272×9: over the VAE's 256-pixel tile, so a tiled decode really tiles.
TILEABLE = (1, 16, 3, 34, 34)


def spec(**overrides: Any) -> GenerationSpec:
    values: dict[str, Any] = {
        "model": TINY_WAN,
        "prompt": "a lighthouse in a storm",
        "negative_prompt": "blurry",
        "width": 64,
        "height": 64,
        "num_frames": 9,
        "fps": 8,
        "steps": 2,
        "guidance_scale": 5.0,
        "seed": 5,
    }
    return GenerationSpec(**(values | overrides))


def fixed(free: int) -> DecodeBudget:
    """A budget of exactly ``free`` bytes, whatever the device has."""
    return DecodeBudget(lambda: free, margin_bytes=0)


@pytest.fixture(scope="module")
def tiny() -> VideoPipeline:
    pipe = build_pipeline(TINY_WAN, device=CPU, dtype=torch.float32)
    return VideoPipeline(pipe, model=TINY_WAN, device=CPU, dtype=torch.float32, memory_mode="low_vram")


@pytest.fixture
def budgeted(tiny: VideoPipeline) -> Any:
    """The tiny CPU pipeline deciding its decodes against a budget the test sets (as on CUDA in low_vram)."""
    yield tiny
    tiny.decode_budget = None
    tiny.pipe.vae.disable_tiling()


def latents(shape: tuple[int, ...] = TILEABLE) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(0))


def decode(pipeline: VideoPipeline, z: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    timings: dict[str, float] = {}
    with torch.inference_mode():
        frames = pipeline._decode(z, timings)
    return frames, timings


class TiledCalls:
    """Counts the VAE's tiled decodes and records ``use_tiling`` at each decode."""

    def __init__(self, vae: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tiled = 0
        self.use_tiling: list[bool] = []
        tiled_decode, whole = vae.tiled_decode, vae._decode

        def count_tiled(*args: Any, **kwargs: Any) -> Any:
            self.tiled += 1
            return tiled_decode(*args, **kwargs)

        def note(*args: Any, **kwargs: Any) -> Any:
            self.use_tiling.append(vae.use_tiling)
            return whole(*args, **kwargs)

        monkeypatch.setattr(vae, "tiled_decode", count_tiled)
        monkeypatch.setattr(vae, "_decode", note)


# The memory model.


def test_the_decoder_geometry_is_read_from_the_vae_config() -> None:
    with torch.device("meta"):
        wan21, tiny = AutoencoderKLWan(), AutoencoderKLWan(**TINY_VAE)
    # Wan2.1: the last spatial upsampler's input (192 channels) upsampled to the full frame, 4 frames per latent frame.
    assert DecoderGeometry.from_config(wan21.config) == WAN21 == DecoderGeometry(768.0, 8, 4, 3)
    assert DecoderGeometry.from_config(tiny.config) == DecoderGeometry(12.0, 8, 4, 3)


def test_the_estimate_covers_the_whole_decodes_measured_on_an_h200() -> None:
    # Resident renders of wan2.1-1.3b-arch (VAE float32): their peak less the weights (13.70 GiB) is the decode's
    # (benchmarks/results/gpu_memory_modes_h200_20261130.md).
    for shape, measured_gib in ((LATENTS_480P, 22.32 - 13.70), (LATENTS_720P, 33.50 - 13.70)):
        estimate = untiled_decode_bytes(shape, WAN21, element_bytes=4) / GIB
        assert measured_gib <= estimate <= measured_gib * 1.1


class LiveBytes(TorchDispatchMode):
    """The peak bytes of tensors alive under it: every op's outputs, counted until their storage is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def _freed(self, key: int, size: int) -> None:
        self.live -= size
        self.seen.discard(key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and id(storage := tensor.untyped_storage()) not in self.seen:
                self.seen.add(id(storage))
                self.live += storage.nbytes()
                weakref.finalize(storage, self._freed, id(storage), storage.nbytes())
                self.peak = max(self.peak, self.live)
        return out


@pytest.mark.parametrize("config", [TINY_VAE, {}], ids=["tiny-wan", "wan2.1"])
def test_the_estimate_covers_a_real_decodes_live_tensors_on_the_cpu(config: dict[str, Any]) -> None:
    torch.manual_seed(0)
    vae = AutoencoderKLWan(**config).eval()
    shape = (1, 16, 3, 4, 4)  # 32×32×9
    with torch.inference_mode(), LiveBytes() as live:
        vae.decode(latents(shape), return_dict=False)
    estimate = untiled_decode_bytes(shape, DecoderGeometry.from_config(vae.config), element_bytes=4)
    # On CUDA, cuDNN's workspace and the allocator's rounding come on top: the model leaves room for them.
    assert live.peak <= estimate <= 1.5 * live.peak


def test_the_estimate_scales_with_the_frame_size_and_the_batch_far_more_than_with_the_length() -> None:
    base = untiled_decode_bytes(LATENTS_480P, WAN21, element_bytes=4)
    assert untiled_decode_bytes((2, *LATENTS_480P[1:]), WAN21, element_bytes=4) == 2 * base
    assert untiled_decode_bytes(LATENTS_480P, WAN21, element_bytes=2) < 0.51 * base  # a bf16 VAE: half the bytes
    wide = untiled_decode_bytes(LATENTS_720P, WAN21, element_bytes=4)
    assert wide == pytest.approx(base * (720 * 1280) / (480 * 832), rel=0.01)
    longer = untiled_decode_bytes((1, 16, 21, 60, 104), WAN21, element_bytes=4)  # 81 frames
    assert base < longer < 1.05 * base


@pytest.mark.parametrize(
    ("shape", "element_bytes", "budget_gib", "tiled"),
    [
        (LATENTS_480P, 4, 80.0, False),  # an H200 with room to spare
        (LATENTS_480P, 4, 12.0, False),  # ≈ 8.9 GiB
        (LATENTS_480P, 4, 6.0, True),
        (LATENTS_720P, 4, 12.0, True),  # ≈ 20.5 GiB
        (LATENTS_720P, 2, 12.0, False),  # a bf16 VAE: ≈ 10.2 GiB
        (LATENTS_720P, 2, 8.0, True),
        ((2, *LATENTS_480P[1:]), 4, 12.0, True),  # two videos decoded as one batch
        (LATENTS_480P, 4, -1.0, True),  # less free than the margin
    ],
)
def test_the_decision_tiles_only_over_budget(
    shape: tuple[int, ...], element_bytes: int, budget_gib: float, tiled: bool
) -> None:
    budget = int(budget_gib * GIB)
    assert decode_tiled(shape, WAN21, element_bytes=element_bytes, budget=budget) is tiled


def test_a_decode_exactly_at_the_budget_fits_and_one_byte_over_tiles() -> None:
    need = untiled_decode_bytes(LATENTS_480P, WAN21, element_bytes=4)
    assert decode_tiled(LATENTS_480P, WAN21, element_bytes=4, budget=need) is False
    assert decode_tiled(LATENTS_480P, WAN21, element_bytes=4, budget=need - 1) is True


def test_the_budget_is_the_free_memory_less_a_margin_and_at_most_its_cap() -> None:
    assert DecodeBudget(lambda: 10 * GIB)() == 10 * GIB - DECODE_MARGIN_BYTES
    assert DecodeBudget(lambda: 10 * GIB, cap_bytes=4 * GIB)() == 4 * GIB
    assert DecodeBudget(lambda: 3 * GIB, cap_bytes=4 * GIB)() == 3 * GIB - DECODE_MARGIN_BYTES
    assert DecodeBudget.on(CUDA, cap_mb=512).cap_bytes == 512 * MIB  # read lazily: nothing asked of a device here
    assert DecodeBudget.on(CUDA).cap_bytes == 0


def test_only_low_vram_on_cuda_chooses() -> None:
    assert chooses_decode_tiling("low_vram", CUDA)
    assert chooses_decode_tiling("low_vram", torch.device("cuda:1"))
    assert not chooses_decode_tiling("resident", CUDA)
    assert not chooses_decode_tiling("low_vram", CPU)


# The decode site.


def test_off_cuda_and_in_resident_mode_the_decode_is_as_before(tiny: VideoPipeline) -> None:
    assert tiny.decode_budget is None  # low_vram on the CPU: nothing changes
    resident = VideoPipeline(tiny.pipe, model=TINY_WAN, device=CPU, dtype=torch.float32)
    assert resident.decode_budget is None
    result = tiny.generate(spec())
    assert set(result.timings_s) == {"encode_text", "denoise", "decode", "total"}
    assert not tiny.pipe.vae.use_tiling
    pytest.importorskip("pydantic_settings")  # a GPU machine with the render path alone runs this file too
    from shared.infra.config import Settings

    clear_cache()
    try:
        assert pipeline_for(TINY_WAN, Settings(worker_low_vram_decode_budget_mb=512)).decode_budget is None
    finally:
        clear_cache()


def test_a_small_budget_tiles_and_a_large_one_decodes_whole_with_near_equal_frames(
    budgeted: VideoPipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    vae = budgeted.pipe.vae
    calls = TiledCalls(vae, monkeypatch)
    need = untiled_decode_bytes(TILEABLE, DecoderGeometry.from_config(vae.config), element_bytes=4)

    budgeted.decode_budget = fixed(need)
    whole, timings = decode(budgeted, latents())
    assert timings == {"decode_tiled": 0.0}
    assert calls.use_tiling == [False] and calls.tiled == 0

    budgeted.decode_budget = fixed(need - 1)
    tiled, timings = decode(budgeted, latents())
    assert timings == {"decode_tiled": 1.0}
    assert calls.use_tiling == [False, True] and calls.tiled == 1

    budgeted.decode_budget = fixed(need)  # the next decode decides again: whole
    again, timings = decode(budgeted, latents())
    assert timings == {"decode_tiled": 0.0} and calls.tiled == 1
    assert torch.equal(again, whole)

    # Tiles overlap and are blended: the frames differ a little, at the seams.
    assert whole.shape == tiled.shape == (1, 9, 3, 272, 272)
    difference = (whole - tiled).abs()
    assert difference.mean() < 0.005
    assert (difference > 1 / 255).float().mean() < 0.1


def test_a_render_records_whether_it_decoded_in_tiles(budgeted: VideoPipeline) -> None:
    budgeted.decode_budget = fixed(80 * GIB)
    assert budgeted.generate(spec()).timings_s["decode_tiled"] == 0.0
    budgeted.decode_budget = fixed(0)
    result = budgeted.generate(spec(width=272))  # 272 pixels wide: over one tile
    assert result.timings_s["decode_tiled"] == 1.0
    assert result.frames.shape == (9, 64, 272, 3)
    batch = budgeted.generate_batch([spec(seed=1), spec(seed=2)], on_steps=[lambda *_: None] * 2)
    assert all(not isinstance(r, Exception) and r.timings_s["decode_tiled"] == 1.0 for r in batch)


def test_running_out_of_memory_decoding_whole_decodes_again_in_tiles(
    budgeted: VideoPipeline, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    vae = budgeted.pipe.vae
    reference, _ = decode(VideoPipeline(budgeted.pipe, model=TINY_WAN, device=CPU, dtype=torch.float32), latents())
    vae.enable_tiling()
    tiled_reference, _ = decode(
        VideoPipeline(budgeted.pipe, model=TINY_WAN, device=CPU, dtype=torch.float32), latents()
    )
    vae.disable_tiling()
    forward, frames_in = vae.decoder.forward, []

    def out_of_memory_on_the_second_latent_frame(*args: Any, **kwargs: Any) -> Any:
        frames_in.append(vae.use_tiling)
        if frames_in == [False, False]:  # mid-decode: the feature cache already holds the first frame's features
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return forward(*args, **kwargs)

    monkeypatch.setattr(vae.decoder, "forward", out_of_memory_on_the_second_latent_frame)
    calls = TiledCalls(vae, monkeypatch)
    budgeted.decode_budget = fixed(80 * GIB)
    with caplog.at_level(logging.WARNING, logger="vidq.render"):
        frames, timings = decode(budgeted, latents())
    assert timings == {"decode_tiled": 1.0}
    assert calls.use_tiling == [False, True] and calls.tiled == 1
    assert torch.equal(frames, tiled_reference) and not torch.equal(frames, reference)
    assert "decoding in tiles" in caplog.text


def test_running_out_of_memory_in_tiles_too_fails_the_decode(
    budgeted: VideoPipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    vae = budgeted.pipe.vae

    def out_of_memory(*args: Any, **kwargs: Any) -> Any:
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(vae.decoder, "forward", out_of_memory)
    budgeted.decode_budget = fixed(80 * GIB)
    with pytest.raises(torch.OutOfMemoryError):
        decode(budgeted, latents())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_low_vram_on_cuda_decodes_whole_when_it_fits_and_in_tiles_under_a_cap() -> None:
    pipe = build_pipeline(TINY_WAN, device=CUDA, dtype=torch.bfloat16)
    apply_memory_mode(pipe, "low_vram", device=CUDA)
    assert not pipe.vae.use_tiling  # no longer tiled once and for all
    whole = VideoPipeline(pipe, model=TINY_WAN, device=CUDA, dtype=torch.bfloat16, memory_mode="low_vram")
    assert whole.decode_budget is not None and whole.decode_budget() > 0
    assert whole.generate(spec(width=272)).timings_s["decode_tiled"] == 0.0
    capped = VideoPipeline(
        pipe, model=TINY_WAN, device=CUDA, dtype=torch.bfloat16, memory_mode="low_vram", decode_budget_mb=1
    )
    assert capped.generate(spec(width=272)).timings_s["decode_tiled"] == 1.0
    resident = VideoPipeline(
        build_pipeline(TINY_WAN, device=CUDA, dtype=torch.bfloat16), model=TINY_WAN, device=CUDA, dtype=torch.bfloat16
    )
    assert "decode_tiled" not in resident.generate(spec(width=272)).timings_s
