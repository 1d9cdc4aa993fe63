"""The model registry, its parts and VideoPipeline on the tiny Wan pipeline (CPU, float32, random weights: noise)."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import WanPipeline
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from shared.render.pipeline import PermanentRenderError, RenderResult, VideoPipeline
from shared.render.precision import resolve_device
from shared.render.registry import (
    LOCAL,
    TINY_WAN,
    PipelineKey,
    build_pipeline,
    get_pipeline,
    pipeline_for,
    pipeline_key,
)
from shared.render.registry import clear_cache as clear_pipeline_cache
from shared.render.tokenizer import build_tokenizer
from shared.spec import GenerationSpec

CPU = torch.device("cpu")
STEPS = 3


class Cancelled(Exception):
    """Stands in for the task layer's JobCancelled."""


def make_spec(**overrides: object) -> GenerationSpec:
    values: dict[str, object] = {
        "model": TINY_WAN,
        "prompt": "a red fox runs through the snow at sunset",
        "negative_prompt": "blurry, static",
        "width": 64,
        "height": 64,
        "num_frames": 9,
        "fps": 8,
        "steps": STEPS,
        "guidance_scale": 5.0,
        "seed": 7,
    }
    values.update(overrides)
    return GenerationSpec(**values)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tiny() -> VideoPipeline:
    pipe = build_pipeline(TINY_WAN, device=CPU, dtype=torch.float32)
    return VideoPipeline(pipe, model=TINY_WAN, device=CPU, dtype=torch.float32)


@pytest.fixture(scope="module")
def reference(tiny: VideoPipeline) -> RenderResult:
    return tiny.generate(make_spec())


def test_tiny_wan_is_a_real_wan_pipeline_with_identical_weights_every_build() -> None:
    first = build_pipeline(TINY_WAN, device=CPU, dtype=torch.float32)
    second = build_pipeline(TINY_WAN, device=CPU, dtype=torch.float32)
    assert isinstance(first, WanPipeline)
    for name in ("transformer", "text_encoder", "vae"):
        a, b = getattr(first, name).state_dict(), getattr(second, name).state_dict()
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"{name}.{key} differs between builds"


def test_tokenizer_is_deterministic_and_ends_with_eos() -> None:
    tokenizer = build_tokenizer()
    ids = tokenizer("A Cat, running 12 zorbly!").input_ids
    assert ids == build_tokenizer()("A Cat, running 12 zorbly!").input_ids
    assert ids[-1] == tokenizer.eos_token_id == 1
    assert tokenizer.unk_token_id in ids  # "zorbly" is not in the vocabulary
    assert (tokenizer.pad_token_id, tokenizer.unk_token_id) == (0, 2)


def test_generate_returns_uint8_frames_and_stage_timings(reference: RenderResult) -> None:
    assert reference.frames.shape == (9, 64, 64, 3)
    assert reference.frames.dtype == np.uint8
    assert set(reference.timings_s) == {"encode_text", "denoise", "decode", "total"}
    assert all(seconds >= 0 for seconds in reference.timings_s.values())
    assert reference.timings_s["total"] >= reference.timings_s["denoise"]
    assert (reference.device, reference.dtype, reference.peak_vram_bytes) == ("cpu", "float32", None)
    assert reference.frames.std() > 0  # noise, but not a constant image


def test_same_seed_same_frames_other_seed_other_frames(tiny: VideoPipeline, reference: RenderResult) -> None:
    assert np.array_equal(tiny.generate(make_spec()).frames, reference.frames)
    assert not np.array_equal(tiny.generate(make_spec(seed=8)).frames, reference.frames)


def test_matches_a_plain_diffusers_call(tiny: VideoPipeline, reference: RenderResult) -> None:
    spec = make_spec()
    (video,) = tiny.pipe(
        prompt=spec.prompt,
        negative_prompt=spec.negative_prompt,
        height=spec.height,
        width=spec.width,
        num_frames=spec.num_frames,
        num_inference_steps=spec.steps,
        guidance_scale=spec.guidance_scale,
        generator=torch.Generator(device="cpu").manual_seed(spec.seed),
        output_type="np",
        return_dict=False,
    )
    plain = np.clip(np.rint(video[0] * 255.0), 0, 255).astype(np.uint8)
    assert np.array_equal(plain, reference.frames)


def test_without_guidance_no_negative_prompt_is_encoded(tiny: VideoPipeline, monkeypatch: pytest.MonkeyPatch) -> None:
    encoded: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    encode_prompt = tiny.pipe.encode_prompt

    def spy(*args: Any, **kwargs: Any) -> Any:
        encoded.append(out := encode_prompt(*args, **kwargs))
        return out

    batches: list[int] = []  # one entry per forward pass of the text encoder: its batch size
    monkeypatch.setattr(tiny.pipe, "encode_prompt", spy)
    hook = tiny.pipe.text_encoder.register_forward_hook(lambda _m, args, _out: batches.append(args[0].shape[0]))
    try:
        result = tiny.generate(make_spec(guidance_scale=1.0, steps=2))
    finally:
        hook.remove()
    assert result.frames.shape == (9, 64, 64, 3)
    assert batches == [1]  # the prompt alone; with guidance a second pass encodes the negative prompt
    prompt_embeds, negative_embeds = encoded[0]  # later calls (the pipeline's own) get embeddings, encode nothing
    assert prompt_embeds.shape[0] == 1
    assert negative_embeds is None


def test_on_step_reports_every_step(tiny: VideoPipeline) -> None:
    calls: list[tuple[int, int]] = []
    tiny.generate(make_spec(), on_step=lambda done, total: calls.append((done, total)))
    assert calls == [(i, STEPS) for i in range(1, STEPS + 1)]


def test_exception_from_on_step_propagates_and_stops_the_render(tiny: VideoPipeline) -> None:
    calls: list[int] = []

    def cancel_at_two(done: int, total: int) -> None:
        calls.append(done)
        if done == 2:
            raise Cancelled

    with pytest.raises(Cancelled):
        tiny.generate(make_spec(steps=4), on_step=cancel_at_two)
    assert calls == [1, 2]


def _record_latents(tiny: VideoPipeline, monkeypatch: pytest.MonkeyPatch) -> list[weakref.ref[torch.Tensor]]:
    """Weak references to every latent the scheduler's steps return: alive after a cancel means a leak."""
    latents: list[weakref.ref[torch.Tensor]] = []
    step = tiny.pipe.scheduler.step

    def recording_step(*args: Any, **kwargs: Any) -> Any:
        out = step(*args, **kwargs)
        latents.append(weakref.ref(out[0]))
        return out

    monkeypatch.setattr(tiny.pipe.scheduler, "step", recording_step)
    return latents


def test_cancel_frees_the_render_tensors_while_the_exception_is_still_held(
    tiny: VideoPipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    latents = _record_latents(tiny, monkeypatch)

    def cancel(done: int, total: int) -> None:
        raise Cancelled

    with pytest.raises(Cancelled) as caught:
        tiny.generate(make_spec(), on_step=cancel)
    # A worker logs the exception after generate returns; the latents must not live as long as it does.
    assert caught.value.__traceback__ is not None
    assert latents and all(ref() is None for ref in latents)


def test_value_error_from_on_step_is_not_turned_into_a_permanent_error(tiny: VideoPipeline) -> None:
    def fail(done: int, total: int) -> None:
        raise ValueError("the caller's own error")

    with pytest.raises(ValueError, match="the caller's own error") as caught:
        tiny.generate(make_spec(), on_step=fail)
    assert not isinstance(caught.value, PermanentRenderError)


def test_model_rejecting_the_input_is_a_permanent_error(tiny: VideoPipeline, monkeypatch: pytest.MonkeyPatch) -> None:
    def reject(*args: object, **kwargs: object) -> None:
        raise ValueError("`height` and `width` have to be divisible by 16")

    monkeypatch.setattr(tiny.pipe, "check_inputs", reject)
    with pytest.raises(PermanentRenderError) as caught:
        tiny.generate(make_spec())
    assert isinstance(caught.value.__cause__, ValueError)


def test_registry_loads_a_saved_pipeline_from_a_local_folder(
    tiny: VideoPipeline, reference: RenderResult, tmp_path: Path
) -> None:
    tiny.pipe.save_pretrained(tmp_path)
    loaded = build_pipeline(str(tmp_path), device=CPU, dtype=torch.float32)
    assert isinstance(loaded, WanPipeline)
    result = VideoPipeline(loaded, model=str(tmp_path), device=CPU, dtype=torch.float32).generate(make_spec())
    assert np.array_equal(result.frames, reference.frames)


def test_local_model_needs_a_folder() -> None:
    with pytest.raises(ValueError, match="model_dir"):
        build_pipeline(LOCAL, device=CPU, dtype=torch.float32)


def test_resolve_device_on_cpu() -> None:
    assert resolve_device("cpu", cuda_dtype="bfloat16") == (CPU, torch.float32)
    if not torch.cuda.is_available():
        assert resolve_device(None, cuda_dtype="bfloat16") == (CPU, torch.float32)
        with pytest.raises(RuntimeError, match="CUDA"):
            resolve_device("cuda", cuda_dtype="bfloat16")


def test_pipeline_key_names_model_precision_and_device() -> None:
    key = pipeline_key(TINY_WAN, device_pref="cpu", cuda_dtype="float16")
    assert key == PipelineKey(model=TINY_WAN, precision="float32", device="cpu")  # the CPU computes in fp32
    assert (key.torch_device, key.dtype) == (CPU, torch.float32)
    assert len({key, PipelineKey(TINY_WAN, "float32", "cpu"), PipelineKey(TINY_WAN, "bfloat16", "cpu")}) == 2
    with pytest.raises(ValueError, match="compute dtype"):
        PipelineKey(TINY_WAN, "fp8", "cpu")


def test_get_pipeline_builds_once_per_key() -> None:
    clear_pipeline_cache()
    try:
        first = get_pipeline(PipelineKey(TINY_WAN, "float32", "cpu"))
        assert get_pipeline(PipelineKey(TINY_WAN, "float32", "cpu")) is first
        assert (first.model, first.device, first.dtype) == (TINY_WAN, CPU, torch.float32)
        other = get_pipeline(PipelineKey(TINY_WAN, "bfloat16", "cpu"))
        assert other is not first and other.pipe.transformer.dtype == torch.bfloat16
    finally:
        clear_pipeline_cache()


def test_pipeline_for_reads_only_the_settings_it_is_given(tmp_path: Path) -> None:
    class Settings:  # no get_settings() anywhere: what the entry point passes is all the registry sees
        device = "cpu"
        cuda_dtype = "bfloat16"
        model_dir = str(tmp_path / "not-a-pipeline")  # read for "local" only
        worker_text_encoder = "local"
        worker_memory_mode = "resident"
        worker_compile = "auto"  # on CUDA only: this CPU pipeline is not compiled
        worker_low_vram_decode_budget_mb = 0  # read by a low_vram pipeline on CUDA only

    clear_pipeline_cache()
    try:
        pipe = pipeline_for(TINY_WAN, Settings())
        assert pipe is get_pipeline(PipelineKey(TINY_WAN, "float32", "cpu"))
    finally:
        clear_pipeline_cache()


def test_memory_mode_is_part_of_the_key_and_an_out_of_memory_fallback_sticks_to_low_vram() -> None:
    from shared.render.registry import fall_back_to_low_vram

    with pytest.raises(ValueError, match="unknown memory mode"):
        PipelineKey(TINY_WAN, "float32", "cpu", memory_mode="tiny")

    class Settings:
        device = "cpu"
        cuda_dtype = "bfloat16"
        model_dir = None
        worker_text_encoder = "local"
        worker_memory_mode = "resident"
        worker_compile = "auto"  # on CUDA only: this CPU pipeline is not compiled
        worker_low_vram_decode_budget_mb = 0  # read by a low_vram pipeline on CUDA only

    clear_pipeline_cache()
    try:
        resident = pipeline_for(TINY_WAN, Settings())
        assert resident.memory_mode == "resident"
        low = fall_back_to_low_vram(TINY_WAN, Settings())
        assert low.memory_mode == "low_vram" and low is not resident
        assert pipeline_for(TINY_WAN, Settings()) is low  # the process keeps the model in low_vram from now on
        assert get_pipeline(PipelineKey(TINY_WAN, "float32", "cpu")) is not resident  # the resident one was dropped
    finally:
        clear_pipeline_cache()


def test_stage_scope_wraps_each_stage_in_order(tiny: VideoPipeline, reference: RenderResult) -> None:
    events: list[tuple[str, object]] = []

    @contextmanager
    def scope(name: str) -> Iterator[None]:
        events.append(("start", name))
        try:
            yield
        finally:
            events.append(("end", name))

    result = tiny.generate(make_spec(), on_step=lambda done, _: events.append(("step", done)), stage_scope=scope)
    assert events == [
        ("start", "embeddings"),
        ("end", "embeddings"),
        ("start", "denoise"),
        *[("step", i) for i in range(1, STEPS + 1)],
        ("end", "denoise"),
        ("start", "decode"),
        ("end", "decode"),
    ]
    assert np.array_equal(result.frames, reference.frames)


def test_a_cancel_in_a_traced_stage_ends_its_span_and_still_frees_the_render_tensors(
    tiny: VideoPipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    latents = _record_latents(tiny, monkeypatch)

    def cancel(done: int, total: int) -> None:
        raise Cancelled

    with pytest.raises(Cancelled):
        tiny.generate(make_spec(), on_step=cancel, stage_scope=lambda name: tracer.start_as_current_span(name))
    assert latents and all(ref() is None for ref in latents)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"embeddings", "denoise"}  # decode never started
    assert spans["denoise"].status.status_code is StatusCode.ERROR
    recorded = [str(e.attributes["exception.type"]) for e in spans["denoise"].events if e.attributes]
    assert [r.rsplit(".", 1)[-1] for r in recorded] == ["Cancelled"]
