"""The fast tier and step caching with tiny-wan on the CPU: the module table resolves per layer and per device, an
8-bit format that cannot run falls back with a log line and the result says what ran, and a step cache runs the
transformer on the steps its preset names and says so."""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import pytest
import torch

from shared.render import quantize
from shared.render.pipeline import RenderResult, VideoPipeline
from shared.render.quantize import (
    EIGHT_BIT,
    FP8_ROWWISE,
    INT8_WEIGHT_ONLY,
    Fp8RowwiseLinear,
    Int8WeightOnlyLinear,
    linear_layers,
    quantize_linears,
    resolve,
)
from shared.render.registry import TINY_WAN, build_pipeline
from shared.render.step_cache import PRESETS, StepPredictor, preset
from shared.render.tiers import MODULE_TABLE, policy_for, tensor_format
from tests.shared.render.test_registry import make_spec

CPU = torch.device("cpu")
STEPS = 10  # enough for a preset to skip steps: taylor2 computes 8 of 10, taylor3 7


def build(tier: str) -> VideoPipeline:
    pipe = build_pipeline(TINY_WAN, device=CPU, dtype=torch.float32)
    return VideoPipeline(pipe, model=TINY_WAN, device=CPU, dtype=torch.float32, policy=policy_for(tier, device=CPU))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def exact() -> VideoPipeline:
    return build("exact")


@pytest.fixture(scope="module")
def fast() -> VideoPipeline:
    return build("fast")


@pytest.fixture(scope="module")
def exact_video(exact: VideoPipeline) -> RenderResult:
    return exact.generate(make_spec(steps=STEPS))


def eight_bit_layers(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in module.named_modules() if isinstance(m, Fp8RowwiseLinear | Int8WeightOnlyLinear)}


# --- the table -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("weight", "fmt"),
    [
        ("transformer.patch_embedding.weight", "compute"),  # the input end
        ("transformer.condition_embedder.text_embedder.linear_1.weight", "compute"),  # the conditioning
        ("transformer.condition_embedder.time_embedder.linear_1.weight", "fp32"),
        ("transformer.proj_out.weight", "compute"),  # the output end
        ("transformer.blocks.7.attn1.to_qkv.weight", EIGHT_BIT),  # the fused self-attention projections
        ("transformer.blocks.7.attn1.to_q.weight", EIGHT_BIT),
        ("transformer.blocks.7.attn1.to_out.0.weight", EIGHT_BIT),
        ("transformer.blocks.7.attn1.to_qkv.bias", "compute"),  # a bias keeps the compute dtype
        ("transformer.blocks.7.attn1.norm_q.weight", "compute"),
        ("transformer.blocks.7.attn2.to_q.weight", EIGHT_BIT),
        ("transformer.blocks.7.attn2.to_kv.weight", "compute"),  # over the prompt's rows only
        ("transformer.blocks.7.attn2.to_k.weight", "compute"),
        ("transformer.blocks.7.ffn.net.0.proj.weight", EIGHT_BIT),
        ("transformer.blocks.7.ffn.net.2.weight", EIGHT_BIT),
        ("transformer.blocks.7.norm2.weight", "fp32"),
        ("vae.decoder.conv_in.weight", "vae"),
    ],
)
def test_the_fast_table_gives_each_module_its_format(weight: str, fmt: str) -> None:
    assert tensor_format("fast", weight, compute="compute", vae="vae") == fmt


def test_the_fast_table_covers_every_weight_and_the_exact_one_has_no_8_bit_row(fast: VideoPipeline) -> None:
    transformer = fast.pipe.transformer
    for name, _ in [*transformer.named_parameters(), *transformer.named_buffers()]:
        tensor_format("fast", f"transformer.{name}", compute="compute", vae="vae")  # raises if no row covers it
    assert all(fmt in {"compute", "fp32", "vae"} for _, fmt in MODULE_TABLE["exact"])


# --- per device ----------------------------------------------------------------------------------------------------


def fake_gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]) -> torch.device:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a test GPU")
    monkeypatch.setattr(quantize, "_fp8_product_fails", lambda device: None)  # a GPU whose torch runs fp8 products
    return torch.device("cuda")


def fake_gpu_without_probe(monkeypatch: pytest.MonkeyPatch) -> torch.device:
    """A Hopper GPU whose fp8 product probe is whatever the test set."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    return torch.device("cuda")


@pytest.mark.parametrize(
    ("capability", "runs"),
    [
        ((9, 0), FP8_ROWWISE),
        ((8, 9), FP8_ROWWISE),
        ((10, 0), FP8_ROWWISE),
        ((8, 6), INT8_WEIGHT_ONLY),
        ((8, 0), INT8_WEIGHT_ONLY),
        ((7, 5), INT8_WEIGHT_ONLY),
    ],
)
def test_the_8_bit_format_is_chosen_by_the_gpu(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], runs: str
) -> None:
    resolved = resolve(EIGHT_BIT, fake_gpu(monkeypatch, capability))
    assert resolved.runs == runs
    if runs == INT8_WEIGHT_ONLY:  # chosen by the GPU, not the job: the result says why
        assert resolved.reason == (
            f"a test GPU (compute capability {capability[0]}.{capability[1]}) has no fp8 tensor cores: "
            "its 8-bit format is int8_weight_only"
        )
    else:
        assert resolved.reason is None


def test_a_format_that_cannot_run_falls_back_to_the_next_with_a_log_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "vidq.render")
    older = fake_gpu(monkeypatch, (8, 0))
    asked_fp8 = resolve(FP8_ROWWISE, older)  # named outright, on a GPU without fp8
    assert asked_fp8.runs == INT8_WEIGHT_ONLY and "need compute capability 8.9 or newer, not 8.0" in str(
        asked_fp8.reason
    )
    monkeypatch.setattr(quantize, "_fp8_product_fails", lambda device: "torch's fp8 product failed here: no kernel")
    broken = resolve(EIGHT_BIT, fake_gpu_without_probe(monkeypatch))
    assert broken.runs == INT8_WEIGHT_ONLY and "no kernel" in str(broken.reason)
    unknown = resolve("int4_magic", CPU)
    assert unknown.runs == INT8_WEIGHT_ONLY and "no 8-bit format is called 'int4_magic'" in str(unknown.reason)
    fallbacks = [r for r in caplog.records if r.getMessage() == "8-bit format not available; falling back"]
    assert {(r.asked, r.runs) for r in fallbacks} == {
        (FP8_ROWWISE, INT8_WEIGHT_ONLY),
        (EIGHT_BIT, INT8_WEIGHT_ONLY),
        ("int4_magic", INT8_WEIGHT_ONLY),
    }


# --- rendering -----------------------------------------------------------------------------------------------------


def test_a_fast_render_on_the_cpu_runs_the_tables_layers_in_int8_and_says_so(
    fast: VideoPipeline, exact: VideoPipeline, exact_video: RenderResult
) -> None:
    layers = dict(linear_layers(exact.pipe.transformer))  # the bf16 build's Linear layers, fused as fast fuses them
    eight_bit = {
        name
        for name in layers
        if tensor_format("fast", f"transformer.{name}.weight", compute="compute", vae="vae") == EIGHT_BIT
    }
    replaced = eight_bit_layers(fast.pipe.transformer)
    assert eight_bit and set(replaced) == eight_bit  # exactly the table's layers, and all of them
    assert all(isinstance(layer, Int8WeightOnlyLinear) for layer in replaced.values())
    assert {"proj_out", "blocks.0.attn2.to_kv", "condition_embedder.text_embedder.linear_1"} <= set(layers) - eight_bit
    assert isinstance(fast.pipe.transformer.proj_out, torch.nn.Linear)

    result = fast.generate(make_spec(steps=STEPS))
    record = result.precision.to_dict()
    assert record["tier"] == "fast"
    assert record["linear"] == [
        {
            "asked": EIGHT_BIT,
            "runs": INT8_WEIGHT_ONLY,
            "layers": len(eight_bit),
            "reason": "the cpu has no fp8 tensor cores: its 8-bit format is int8_weight_only",
        }
    ]
    assert ["transformer.blocks.*.ffn.net.*.weight", INT8_WEIGHT_ONLY] in record["modules"]
    assert ["transformer.proj_out.*", "float32"] in record["modules"]
    # int8 weights with one scale per row: the video stays close to the exact one (random weights: a lower bound).
    diff = np.abs(result.frames.astype(np.int16) - exact_video.frames)
    assert 0 < diff.max() <= 48 and diff.mean() < 2.0


@pytest.mark.parametrize("kind", [Fp8RowwiseLinear, Int8WeightOnlyLinear])
def test_an_8_bit_layer_computes_its_linear_to_8_bit_precision_eager_and_compiled(kind: type) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    x = torch.randn(2, 10, 64) * torch.linspace(0.1, 10.0, 10)[None, :, None]  # tokens of very different sizes
    with torch.inference_mode():
        want = linear(x)
        module = torch.nn.Sequential(linear)
        fmt = FP8_ROWWISE if kind is Fp8RowwiseLinear else INT8_WEIGHT_ONLY
        assert quantize_linears(module, {"0": fmt}) == {"0": fmt} and isinstance(module[0], kind)
        got = module(x)
        compiled = torch.compile(module, fullgraph=True)(x)
    # Per row: each token is quantized against its own largest value, so a small token keeps its precision.
    for row in range(10):
        error = (got[:, row] - want[:, row]).norm() / want[:, row].norm()
        assert error < (0.06 if kind is Fp8RowwiseLinear else 0.01), (row, float(error))
    assert torch.equal(got, compiled)


def test_a_policy_naming_an_unknown_format_renders_with_the_fallback_and_says_so(exact_video: RenderResult) -> None:
    pipe = build_pipeline(TINY_WAN, device=CPU, dtype=torch.float32)
    policy = replace(policy_for("fast", device=CPU), eight_bit="int4_magic")
    pipeline = VideoPipeline(pipe, model=TINY_WAN, device=CPU, dtype=torch.float32, policy=policy)
    (linear,) = pipeline.generate(make_spec(steps=STEPS)).precision.linear
    assert linear["asked"] == "int4_magic" and linear["runs"] == INT8_WEIGHT_ONLY and linear["layers"] > 0
    assert "no 8-bit format is called 'int4_magic'" in linear["reason"]


def test_a_layer_fp8_products_cannot_take_gets_int8_weights() -> None:
    module = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 24), torch.nn.Linear(24, 8))
    applied = quantize_linears(module, {"0": FP8_ROWWISE, "1": FP8_ROWWISE, "2": "compute"})
    assert applied == {"0": FP8_ROWWISE, "1": INT8_WEIGHT_ONLY}  # 24 is no multiple of 16
    assert isinstance(module[0], Fp8RowwiseLinear) and isinstance(module[1], Int8WeightOnlyLinear)
    assert type(module[2]) is torch.nn.Linear


# --- step caching --------------------------------------------------------------------------------------------------


def test_a_preset_computes_the_first_steps_every_nth_after_them_and_the_last() -> None:
    taylor2, taylor3 = PRESETS["taylor2"], PRESETS["taylor3"]
    assert [i for i in range(20) if taylor3.computes(i, 20)] == [0, 1, 2, 3, 4, 7, 10, 13, 16, 19]
    assert taylor2.computed_steps(20) == 13 and taylor3.computed_steps(20) == 10
    assert [i for i in range(20) if PRESETS["taylor4"].computes(i, 20)] == [0, 1, 2, 3, 4, 8, 12, 16, 19]
    assert taylor3.computed_steps(3) == 3  # too few steps to skip any
    assert preset("off") is None
    with pytest.raises(ValueError, match="unknown step cache"):
        preset("taylor9")  # type: ignore[arg-type]


def test_a_skipped_step_is_the_taylor_extrapolation_of_the_last_two_computed() -> None:
    predictor = StepPredictor(PRESETS["taylor3"], 20)
    calls: list[int] = []

    def linear_in_t(index: int, t: float) -> torch.Tensor:
        calls.append(index)
        return torch.full((2, 3), 5.0 - 0.01 * t)

    timesteps = [1000.0 - 50 * i for i in range(20)]
    outputs = [predictor.output(i, t, lambda i=i, t=t: linear_in_t(i, t)) for i, t in enumerate(timesteps)]
    assert calls == [0, 1, 2, 3, 4, 7, 10, 13, 16, 19]
    for out, t in zip(outputs, timesteps, strict=True):  # a first-order extrapolation of a line is the line
        assert torch.allclose(out, torch.full((2, 3), 5.0 - 0.01 * t), atol=1e-5)
    assert predictor.record() == {"preset": "taylor3", "computed_steps": 10, "steps": 20}


@pytest.mark.parametrize("name", ["taylor2", "taylor3"])
def test_a_step_cached_render_runs_the_transformer_only_on_its_computed_steps_and_says_so(
    fast: VideoPipeline, name: str
) -> None:
    calls: list[int] = []
    handle = fast.pipe.transformer.register_forward_hook(lambda *_: calls.append(1))
    try:
        steps: list[int] = []
        spec = make_spec(steps=STEPS, step_cache=name)
        result = fast.generate(spec, on_step=lambda done, total: steps.append(done))
    finally:
        handle.remove()
    computed = PRESETS[name].computed_steps(STEPS)  # type: ignore[index]
    assert len(calls) == computed < STEPS  # one batched call (both guidance passes) per computed step
    assert steps == list(range(1, STEPS + 1))  # progress still reports every step
    assert result.precision.step_cache == {"preset": name, "computed_steps": computed, "steps": STEPS}
    assert result.precision.to_dict()["step_cache"]["preset"] == name
    plain = fast.generate(make_spec(steps=STEPS))
    assert "step_cache" not in plain.precision.to_dict()  # off: nothing to say
    assert not np.array_equal(result.frames, plain.frames) and np.isfinite(result.frames).all()


def test_a_step_cache_keeps_the_guidance_passes_apart_where_the_policy_does() -> None:
    pipe = build_pipeline(TINY_WAN, device=CPU, dtype=torch.float32)
    two_passes = replace(policy_for("exact", device=CPU), cfg_batch=False)  # as under low_vram
    pipeline = VideoPipeline(pipe, model=TINY_WAN, device=CPU, dtype=torch.float32, policy=two_passes)
    batches: list[int] = []
    handle = pipe.transformer.register_forward_hook(
        lambda _m, args, kwargs, _out: batches.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
    )
    try:
        result = pipeline.generate(make_spec(steps=STEPS, step_cache="taylor3"))
    finally:
        handle.remove()
    computed = PRESETS["taylor3"].computed_steps(STEPS)
    assert batches == [1] * (2 * computed)  # two passes of one row per computed step
    assert result.precision.step_cache == {"preset": "taylor3", "computed_steps": computed, "steps": STEPS}
