"""GPU benchmark of the ``fast`` tier and step caching: plain diffusers, ``exact``, ``fast``, ``fast`` with each step
cache preset and the int8 weight-only policy, side by side in one run, each with its drift against plain.

Every variant renders from the same prompt embeddings (computed once), on deep copies of the plain pipeline's
transformer and VAE (the same weights; each tier's levers touch its own copy only), with the same seed:

* plain: ``WanPipeline.__call__`` in bf16 with its VAE in float32, diffusers' defaults: the reference;
* exact: vidq's exact tier (shared/render/tiers.py);
* fast: exact with the module table's 8-bit layers in this GPU's format (fp8 rowwise on compute capability ≥ 8.9);
* fast+taylor2, fast+taylor3: the fast pipeline with a job's step cache (shared/render/step_cache.py);
* int8: the fast tier's table with int8 weight-only layers, the policy of GPUs without fp8, forced here so that one
  GPU measures both.

Each pipeline is warmed up with the worker's own warm-up first (its compile is reported). Then, per shape and run,
the variants and plain alternate. Drift of each against plain: largest absolute difference of the denoised latents
and PSNR of the uint8 frames. The weights are random: their frames are noise, so drift figures are a lower bound of
what trained weights show, and a step cache's effect on quality is not measured at all here (its skipping follows a
fixed schedule, so its speed is). The attention kernels at each shape are timed first. Writes
``gpu_fast_<gpu>_<date><tag>.json`` and ``.md`` to ``--out`` after every variant.

    python -m benchmarks.gpu_fast [--shapes 480x832x33 480x832x81] [--runs 2] [--out benchmarks/results]
    python -m benchmarks.gpu_fast --model tiny-wan --device cpu --shapes 64x64x9 --steps 8 --compile on  # rehearsal
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks import gpu_exact as exact_bench
from benchmarks.gpu_exact import GIB, Clock, attention_kernels, machine, timed
from shared.render import fp8_attention_cudnn as cudnn_fp8
from shared.render.fp8_attention import (
    CUDNN_FP8_ATTENTION,
    FP8_ATTENTION,
    FP8_KERNELS,
    fp8_attention,
    fp8_attention_unavailable,
)
from shared.render.pipeline import RenderResult, VideoPipeline, tokens_per_sample
from shared.render.precision import dtype_name, resolve_device
from shared.render.quantize import INT8_WEIGHT_ONLY
from shared.render.registry import WAN21_13B_ARCH
from shared.render.tiers import TierPolicy, policy_for
from shared.render.warmup import warm_up
from shared.spec import GenerationSpec, StepCache, parse_shape


@dataclass(frozen=True)
class Variant:
    name: str
    pipeline: str  # which built pipeline renders it
    step_cache: StepCache = "off"


VARIANTS = (
    Variant("exact", "exact"),
    Variant("fast", "fast"),
    Variant("fast+taylor2", "fast", "taylor2"),
    Variant("fast+taylor3", "fast", "taylor3"),
    Variant("fast+cudnnfp8", "fast_cudnnfp8"),
    Variant("fast+cudnnfp8+taylor3", "fast_cudnnfp8", "taylor3"),
    Variant("fast+cudnnfp8+taylor4", "fast_cudnnfp8", "taylor4"),
    Variant("fast+fp8attn", "fast_fp8attn"),
    Variant("int8", "int8"),
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=WAN21_13B_ARCH)
    parser.add_argument("--shapes", nargs="+", default=["480x832x33", "480x832x81"], help="HEIGHTxWIDTHxFRAMES")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", type=int, default=2, help="timed runs per variant and shape")
    parser.add_argument("--variants", default=",".join(v.name for v in VARIANTS), help="comma-separated")
    parser.add_argument("--skip-attention", action="store_true", help="do not time the attention kernels")
    parser.add_argument("--attention-only", action="store_true", help="time the attention kernels, render nothing")
    parser.add_argument("--profile", metavar="VARIANT", help="GPU time by kernel kind of 2 steps of VARIANT")
    parser.add_argument("--tag", default="", help="appended to the results' file names")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--compile", choices=("auto", "on", "off"), default="auto", help="as VIDQ_WORKER_COMPILE")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    for shape in args.shapes:
        parse_shape(shape)
    known = {v.name for v in VARIANTS}
    args.variants = [name for name in args.variants.split(",") if name]
    if unknown := set(args.variants) - known:
        parser.error(f"unknown variants {sorted(unknown)}; known: {sorted(known)}")
    if args.profile and args.profile not in known:
        parser.error(f"--profile names no variant; known: {sorted(known)}")
    pipelines = {v.pipeline for v in VARIANTS if v.name in {*args.variants, args.profile}}
    if {"fast_cudnnfp8", "fast_fp8attn"} <= pipelines:
        parser.error("one process routes fp8 attention to one kernel: run the cudnnfp8 and fp8attn variants apart")
    return args


class Bench(exact_bench.Bench):
    """The exact benchmark's plain call, specs and pipeline copies, with this benchmark's variants and report."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device, self.dtype = resolve_device(args.device, cuda_dtype="bfloat16")
        self.clock = Clock(self.device)
        self.variants = [v for v in VARIANTS if v.name in args.variants]
        self.report: dict[str, Any] = {
            "benchmark": "gpu_fast",
            "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "command": shlex.join(sys.orig_argv),
            "machine": machine(self.device),
            "model": args.model,
            "steps": args.steps,
            "guidance_scale": args.guidance,
            "dtype": dtype_name(self.dtype),
            "pipelines": {},
            "shapes": {},
            "errors": [],
        }

    # --- building ----------------------------------------------------------------------------------------------------

    def policies(self) -> dict[str, TierPolicy]:
        fast = policy_for("fast", device=self.device, compile_mode=self.args.compile)
        without = tuple(kernel for kernel in fast.attention if kernel not in FP8_KERNELS)
        return {
            "exact": policy_for("exact", device=self.device, compile_mode=self.args.compile),
            "fast": replace(fast, attention=without),
            "fast_cudnnfp8": replace(fast, attention=(CUDNN_FP8_ATTENTION, *without)),
            "fast_fp8attn": replace(fast, attention=(FP8_ATTENTION, *without)),
            "int8": replace(fast, eight_bit=INT8_WEIGHT_ONLY, attention=without),
        }

    def build(self) -> None:
        self.build_plain()
        wanted = {v.pipeline for v in VARIANTS if v.name == self.args.profile}
        wanted |= set() if self.args.attention_only else {v.pipeline for v in self.variants}
        self.pipelines: dict[str, VideoPipeline] = {}
        for name, policy in self.policies().items():
            if name not in wanted:
                continue
            started = time.perf_counter()
            self.pipelines[name] = pipeline = self.copy_pipeline(policy)
            self.report["pipelines"][name] = {
                "policy": policy.describe(),
                "build_s": time.perf_counter() - started,
                "precision": pipeline.rendered_precision().to_dict(),
                "weights_gib": weights_bytes(pipeline.pipe.transformer, pipeline.pipe.vae) / GIB,
                "transformer_gib": weights_bytes(pipeline.pipe.transformer) / GIB,
            }
            print(f"built {name}: linear {pipeline.linear}", flush=True)

    # --- rendering ---------------------------------------------------------------------------------------------------

    def spec(self, shape: str, step_cache: StepCache = "off") -> GenerationSpec:
        return super().spec(shape).model_copy(update={"step_cache": step_cache})

    def render(self, variant: Variant, shape: str) -> tuple[RenderResult, float | None]:
        """The variant's render, and the device memory it used above what was allocated before it (activations,
        workspaces: its pipeline's weights are resident throughout)."""
        self.reset_peak()
        before = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else None
        pipeline = self.pipelines[variant.pipeline]
        spec = self.spec(shape, variant.step_cache)
        result = pipeline.generate(spec, text_rows=lambda texts: [self.rows[t] for t in texts], keep_latents=True)
        above = None if before is None or result.peak_vram_bytes is None else (result.peak_vram_bytes - before) / GIB
        return result, above

    # --- one shape ---------------------------------------------------------------------------------------------------

    def shape(self, shape: str) -> None:
        height, width, frames = parse_shape(shape)
        entry: dict[str, Any] = self.report["shapes"].setdefault(
            shape, {"tokens": tokens_per_sample(self.pipe, height, width, frames), "variants": {}}
        )
        if not self.args.skip_attention and "attention_kernels" not in entry:
            entry["attention_kernels"] = attention_kernels(self.pipe, shape, self.device, self.dtype)
            entry["attention_kernels"] += fp8_attention_rows(self.pipe, shape, self.device, self.dtype)
            self.write()
        if self.args.attention_only:
            return
        warm: dict[str, float] = {}
        for name, pipeline in list(self.pipelines.items()):
            try:
                warm[name] = warm_up(pipeline, [shape], guidance_scale=self.args.guidance)[shape]
            except Exception as exc:  # its variants are left out; the others go on
                self.fail(f"{shape} warm-up {name}", exc)
                del self.pipelines[name]
                continue
            print(f"{shape}: {name} warmed up in {warm[name]:.1f} s", flush=True)
        entry["warm_up_s"] = warm
        self.plain(self.spec(shape))  # plain's own first call (cuDNN/cuBLAS choices), untimed
        plain_runs: list[dict[str, Any]] = []
        runs: dict[str, list[RenderResult]] = {v.name: [] for v in self.variants}
        self.activations: dict[str, float] = {}
        for run in range(self.args.runs):
            for variant in self.variants:
                if variant.pipeline not in self.pipelines:
                    continue
                try:
                    result, above = self.render(variant, shape)
                    runs[variant.name].append(result)
                    if above is not None:
                        self.activations[variant.name] = max(above, self.activations.get(variant.name, 0.0))
                except Exception as exc:
                    self.fail(f"{shape} {variant.name}", exc)
            plain_runs.append(self.plain(self.spec(shape)))
            line = ", ".join(f"{name} {r[-1].timings_s['total']:.3f}" for name, r in runs.items() if r)
            print(f"{shape} run {run + 1}: plain {plain_runs[-1]['total']:.3f}, {line} s", flush=True)
            self.summarise(entry, plain_runs, runs)
            self.write()

    def summarise(
        self, entry: dict[str, Any], plain_runs: list[dict[str, Any]], runs: dict[str, list[RenderResult]]
    ) -> None:
        plain_s = statistics.median(r["total"] for r in plain_runs)
        entry["plain"] = {
            "s": plain_s,
            "runs_s": [r["total"] for r in plain_runs],
            "alone_peak_gib": (
                None
                if plain_runs[0]["activations_gib"] is None
                else weights_bytes(self.pipe.transformer, self.pipe.vae) / GIB
                + max(r["activations_gib"] for r in plain_runs)
            ),
        }
        exact_s = statistics.median(r.timings_s["total"] for r in runs["exact"]) if runs.get("exact") else None
        reference = plain_runs[-1]
        for name, results in runs.items():
            if not results:
                continue
            last = results[-1]
            total = statistics.median(r.timings_s["total"] for r in results)
            record = last.precision.to_dict()
            pipeline = next(v.pipeline for v in VARIANTS if v.name == name)
            above = self.activations.get(name)
            weights = self.report["pipelines"][pipeline]["weights_gib"]
            entry["variants"][name] = {
                "s": total,
                "runs_s": [r.timings_s["total"] for r in results],
                "denoise_s": statistics.median(r.timings_s["denoise"] for r in results),
                "decode_s": statistics.median(r.timings_s["decode"] for r in results),
                "speedup": plain_s / total,
                "vs_exact": exact_s / total if exact_s else None,
                # As a worker holding this pipeline alone would peak: its transformer's and VAE's weights (the text
                # encoder aside: workers may run without one) plus what the render allocated above them.
                "alone_peak_gib": None if above is None else weights + above,
                "activations_gib": above,
                "attention": record["attention"],
                "linear": record.get("linear", []),
                "step_cache": record.get("step_cache"),
                "drift": self.drift(reference, last),
            }

    # --- output ------------------------------------------------------------------------------------------------------

    @staticmethod
    def markdown(report: dict[str, Any]) -> str:
        return markdown(report)


def fp8_attention_rows(pipe: Any, shape: str, device: torch.device, dtype: torch.dtype) -> list[dict[str, Any]]:
    """The fp8 kernels at the self-attention's shape, as ``attention_kernels`` reports the others, each with its
    error relative to float32 attention (and the bf16 default's, for scale). cuDNN's is timed twice: as the
    compiled blocks run it (its quantization compiled around the operator) and its operator alone."""
    config = pipe.transformer.config
    heads, head_dim = config.num_attention_heads, config.attention_head_dim
    reasons = {
        name: fp8_attention_unavailable(device, head_dim=head_dim, dtype=dtype, kernel=name) for name in FP8_KERNELS
    }
    rows: list[dict[str, Any]] = [{"backend": n, "error": r, "default": False} for n, r in reasons.items() if r]
    if len(rows) == len(reasons):
        return rows
    tokens = tokens_per_sample(pipe, *parse_shape(shape))
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn((2, tokens, heads, head_dim), device=device, dtype=dtype, generator=generator) for _ in range(3)
    )
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    default = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh).transpose(1, 2).float()
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        exact = torch.nn.functional.scaled_dot_product_attention(qh.float(), kh.float(), vh.float()).transpose(1, 2)
    flop = 4 * 2 * heads * tokens * tokens * head_dim
    kernels: dict[str, Callable[[], torch.Tensor]] = {
        FP8_ATTENTION: lambda: fp8_attention(q, k, v),
        CUDNN_FP8_ATTENTION: torch.compile(functools.partial(cudnn_fp8.attention, q, k, v), fullgraph=True),
    }
    for name, kernel in kernels.items():
        if reasons[name]:
            continue
        try:
            seconds = timed(kernel, device, reps=5)
            out = kernel().float()
            rows.append(
                {
                    "backend": name,
                    "ms": seconds * 1e3,
                    "tflop_s": flop / seconds / 1e12,
                    "default": False,
                    "max_abs_diff": float((out - default).abs().max()),
                    "rel_l2_vs_fp32": float((out - exact).norm() / exact.norm()),
                    "bf16_default_rel_l2_vs_fp32": float((default - exact).norm() / exact.norm()),
                }
            )
            if name == CUDNN_FP8_ATTENTION:
                rows.append(cudnn_operator_row(q, k, v, flop, device))
        except Exception as exc:
            rows.append({"backend": name, "error": str(exc).splitlines()[0][:200], "default": False})
    return rows


def cudnn_operator_row(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flop: float, device: torch.device
) -> dict[str, Any]:
    """cuDNN's fp8 operator alone, on inputs already in fp8: what the attention itself costs."""
    one = torch.ones((1, 1, 1, 1), device=device)
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    seconds = timed(
        lambda: torch.ops.vidq.cudnn_fp8_attention(q8, k8, v8, one, one, one, one, 0.0883883), device, reps=5
    )
    return {
        "backend": f"{CUDNN_FP8_ATTENTION} (operator alone)",
        "default": False,
        "ms": seconds * 1e3,
        "tflop_s": flop / seconds / 1e12,
    }


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def weights_bytes(*modules: torch.nn.Module) -> int:
    """Bytes of the modules' parameters and buffers as stored: a quantized weight (a torchao tensor subclass) counts
    its 8-bit data and its scales."""
    total = 0
    for module in modules:
        for tensor in [*module.parameters(), *module.buffers()]:
            total += _stored_bytes(tensor)
    return total


def _stored_bytes(tensor: torch.Tensor) -> int:
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None:
        return tensor.numel() * tensor.element_size()
    names, _ = flatten()
    return sum(_stored_bytes(getattr(tensor, name)) for name in names)


def markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        f"# gpu_fast: {m['gpu']}, {report['date_utc']}",
        "",
        f"`{report['command']}`",
        "",
        f"{report['model']} (random weights), {report['steps']} steps, guidance {report['guidance_scale']}, "
        f"{report['dtype']}; plain = `WanPipeline.__call__` (VAE float32); every variant from the same embeddings, "
        "seed and weights; runs alternate. Drift is against plain. Random weights render noise: drift is a lower "
        "bound of what trained weights show, and a step cache's cost in quality is not measured (only its speed).",
        "",
        "| shape | variant | s | × plain | × exact | denoise s | decode s | peak GiB alone | 8-bit layers | attention "
        "| steps run | latents max abs diff | frames PSNR dB | warm-up s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for shape, e in report["shapes"].items():
        if "plain" not in e:
            continue
        lines.append(
            f"| {shape} | plain diffusers | {e['plain']['s']:.3f} | 1.00× | | | | {_gib(e['plain']['alone_peak_gib'])} "
            "| none (bf16) | SDPA default | all | 0 | ∞ | |"
        )
        for name, v in e["variants"].items():
            linear = ", ".join(f"{x['layers']} {x['runs']}" for x in v["linear"]) or "none"
            steps = f"{v['step_cache']['computed_steps']}/{v['step_cache']['steps']}" if v["step_cache"] else "all"
            d = v["drift"]
            pipeline = next((p.pipeline for p in VARIANTS if p.name == name), name)
            warm = e.get("warm_up_s", {}).get(pipeline)
            vs_exact = "" if v["vs_exact"] is None else f"{v['vs_exact']:.2f}×"
            lines.append(
                f"| {shape} | {name} | {v['s']:.3f} | **{v['speedup']:.2f}×** | {vs_exact} | {v['denoise_s']:.3f} | "
                f"{v['decode_s']:.3f} | {_gib(v['alone_peak_gib'])} | {linear} | {v['attention']} | {steps} | "
                f"{d['latents_max_abs']:.4g} (of {d['latents_abs_max']:.3g}) | {d['frames_psnr_db']:.1f} | "
                f"{'' if warm is None else round(warm, 1)} |"
            )
    lines += exact_bench.attention_table(report)
    lines += exact_bench.profile_table(report)
    if report["errors"]:
        lines += ["", "Errors:", *[f"- {e['phase']}: {e['error'][:300]}" for e in report["errors"]]]
    lines += ["", exact_bench.machine_line(report)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench = Bench(args)
    bench.build()
    bench.write()
    for shape in args.shapes:
        try:
            bench.shape(shape)
        except Exception as exc:
            bench.fail(f"shape {shape}", exc)
        bench.write()
    if args.profile:
        variant = next(v for v in VARIANTS if v.name == args.profile)
        try:
            shape = args.shapes[0]
            bench.profile(shape, bench.pipelines[variant.pipeline], bench.spec(shape, variant.step_cache))
            bench.report["profile"]["variant"] = variant.name
        except Exception as exc:
            bench.fail(f"profile {variant.name}", exc)
        bench.write()
    print(markdown(bench.report))
    return 1 if bench.report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
