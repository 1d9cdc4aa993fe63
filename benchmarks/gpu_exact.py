"""GPU benchmark of the ``exact`` tier: one video, vidq's render path against a plain diffusers call, same run.

Both render from the same prompt embeddings (computed once), on the same model instance's weights (vidq's copy is a
``deepcopy`` of the plain pipeline's transformer and VAE, so its fused projections, compiled blocks and bf16 VAE
never touch the plain side), with the same seed:

* plain: ``WanPipeline.__call__`` in bf16 with its VAE in float32, diffusers' defaults;
* exact: ``VideoPipeline`` under the exact tier's policy (shared/render/tiers.py), warmed up with the worker's own
  warm-up (shared/render/warmup.py) from an empty compile cache, so the warm-up time is the cold compile and the
  first timed run is "the first job of a warmed shape".

Per shape, runs alternate plain / exact (drift of clocks or heat hits both alike). Then, while ``--budget-s``
allows, an ablation at the first shape: each lever's share. Drift of exact against plain: largest absolute
difference of the denoised latents and PSNR of the uint8 frames, plus the VAE's own share (plain latents decoded in
bf16 against float32). Random weights render noise, so these drift figures are a lower bound of what trained
weights show. Writes ``gpu_exact_<gpu>_<date>.json`` and ``.md`` to ``--out`` after every phase.

    python -m benchmarks.gpu_exact [--shapes 480x832x33 480x832x81] [--runs 3] [--out benchmarks/results]
    python -m benchmarks.gpu_exact --model tiny-wan --device cpu --shapes 64x64x9 --steps 3   # a rehearsal
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import functools
import json
import math
import platform
import re
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import diffusers
import numpy as np
import torch
import transformers
from diffusers import WanPipeline
from torch.nn.attention import SDPBackend, sdpa_kernel

from shared.render.attention import FLASH_ATTENTION_4, SDPA_PREFERENCE, flash4_unavailable, install_flash4
from shared.render.pipeline import RenderResult, VideoPipeline, _to_uint8, tokens_per_sample
from shared.render.precision import dtype_name, resolve_device
from shared.render.registry import WAN21_13B_ARCH, build_pipeline
from shared.render.text import MAX_SEQUENCE_LENGTH, pad, texts_of
from shared.render.tiers import TierPolicy, eager_policy, policy_for
from shared.render.warmup import use_compile_cache, warm_up
from shared.spec import GenerationSpec, parse_shape

PROMPT = "a red fox runs through fresh snow in a quiet forest at sunrise, cinematic, detailed"
NEGATIVE = "blurry, static, overexposed, worst quality, low quality, ugly, deformed, subtitles"
GIB = 1024**3


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=WAN21_13B_ARCH)
    parser.add_argument("--shapes", nargs="+", default=["480x832x33", "480x832x81"], help="HEIGHTxWIDTHxFRAMES")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", type=int, default=3, help="timed runs per path and shape")
    parser.add_argument("--ablation-runs", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=480.0, help="no ablation step starts after this")
    parser.add_argument(
        "--phases",
        default="headline,ablation",
        help="comma-separated: attention (the attention kernels at every shape, first), headline (plain vs exact "
        "per shape), ablation (levers' shares at the first shape, after its headline), profile (the exact render's "
        "GPU time by kernel kind)",
    )
    parser.add_argument("--tag", default="", help="appended to the results' file names")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--compile", choices=("auto", "on", "off"), default="auto", help="as VIDQ_WORKER_COMPILE")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    for shape in args.shapes:
        parse_shape(shape)
    return args


class Clock:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.started = time.monotonic()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def elapsed(self) -> float:
        return time.monotonic() - self.started


def machine(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"device": str(device), "python": platform.python_version(), "cpu": platform.processor()}
    for module in (torch, diffusers, transformers, np):
        info[module.__name__] = str(module.__version__)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {
            "gpu": torch.cuda.get_device_name(device),
            "gpu_memory_gib": round(props.total_memory / GIB, 1),
            "compute_capability": f"{props.major}.{props.minor}",
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),  # type: ignore[no-untyped-call,unused-ignore]
        }
        try:
            import pynvml

            pynvml.nvmlInit()
            info["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception as exc:  # nice to have; never worth failing a finished benchmark
            info["driver"] = f"unknown ({type(exc).__name__})"
    else:
        info["gpu"] = "cpu"
    return info


def attention_kernels(pipe: Any, shape: str, device: torch.device, dtype: torch.dtype) -> list[dict[str, Any]]:
    """The attention kernels at the self-attention's shape (a batch of two: both guidance passes): time and rate of
    each that runs, which one SDPA picks by default, and each one's largest difference from SDPA's default."""
    config = pipe.transformer.config
    heads, head_dim = config.num_attention_heads, config.attention_head_dim
    tokens = tokens_per_sample(pipe, *parse_shape(shape))
    # (batch, tokens, heads, head_dim) as the attention processor holds them; SDPA takes them heads first.
    q, k, v = (torch.randn((2, tokens, heads, head_dim), device=device, dtype=dtype) for _ in range(3))
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    flop = 4 * 2 * heads * tokens * tokens * head_dim
    default = SDPBackend(torch._fused_sdp_choice(qh, kh, vh)).name
    reference = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh).transpose(1, 2)
    kernels: dict[str, Callable[[], torch.Tensor]] = {}
    if flash4_unavailable(device, head_dim=head_dim, dtype=dtype) is None:
        install_flash4()
        kernels[FLASH_ATTENTION_4] = lambda: torch.ops.vidq.flash_attention_4(q, k, v, None, False)
    for name in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
        kernels[name] = functools.partial(sdpa_with, getattr(SDPBackend, name), qh, kh, vh)
    rows = []
    for name, kernel in kernels.items():
        try:
            seconds = timed(kernel, device, reps=5)
            rows.append(
                {
                    "backend": name,
                    "ms": seconds * 1e3,
                    "tflop_s": flop / seconds / 1e12,
                    "default": name == default,
                    "max_abs_diff": float((kernel().float() - reference.float()).abs().max()),
                }
            )
        except Exception as exc:  # not available for this shape, dtype or device
            rows.append({"backend": name, "error": str(exc).splitlines()[0][:200], "default": name == default})
    return rows


def sdpa_with(backend: SDPBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA on ``backend`` alone, heads-first in, (batch, tokens, heads, head_dim) out."""
    with sdpa_kernel([backend]):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)


def timed(fn: Callable[[], object], device: torch.device, *, reps: int) -> float:
    """Median seconds of ``fn`` after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device, self.dtype = resolve_device(args.device, cuda_dtype="bfloat16")
        self.clock = Clock(self.device)
        self.report: dict[str, Any] = {
            "benchmark": "gpu_exact",
            "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "command": shlex.join(sys.orig_argv),
            "machine": machine(self.device),
            "model": args.model,
            "steps": args.steps,
            "guidance_scale": args.guidance,
            "dtype": dtype_name(self.dtype),
            "shapes": {},
            "ablation": [],
            "errors": [],
        }

    # --- the two paths -------------------------------------------------------------------------------------------

    def spec(self, shape: str) -> GenerationSpec:
        height, width, frames = parse_shape(shape)
        return GenerationSpec(
            model=self.args.model,
            prompt=PROMPT,
            negative_prompt=NEGATIVE,
            width=width,
            height=height,
            num_frames=frames,
            fps=16,
            steps=self.args.steps,
            guidance_scale=self.args.guidance,
            seed=self.args.seed,
        )

    def plain(self, spec: GenerationSpec) -> dict[str, Any]:
        """One plain ``WanPipeline.__call__`` from the precomputed embeddings: seconds, peak memory, frames and the
        denoised latents (handed to a step callback at the last step, which costs nothing)."""
        last: list[torch.Tensor] = []

        def keep(_pipe: Any, index: int, _t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            if index == spec.steps - 1:
                last.append(tensors["latents"])
            return tensors

        self.reset_peak()
        before = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else None
        self.clock.sync()
        started = time.perf_counter()
        (video,) = self.pipe(
            prompt_embeds=self.embeds[:1],
            negative_prompt_embeds=self.embeds[1:2],
            height=spec.height,
            width=spec.width,
            num_frames=spec.num_frames,
            num_inference_steps=spec.steps,
            guidance_scale=spec.guidance_scale,
            generator=torch.Generator(device=self.device).manual_seed(spec.seed),
            output_type="np",
            return_dict=False,
            callback_on_step_end=keep,
            callback_on_step_end_tensor_inputs=["latents"],
            max_sequence_length=MAX_SEQUENCE_LENGTH,
        )
        self.clock.sync()
        seconds = time.perf_counter() - started
        frames = np.clip(np.rint(video[0] * 255.0), 0, 255).astype(np.uint8)
        peak = self.peak()
        # What the call allocated above what was resident before it (activations, workspaces).
        above = None if peak is None or before is None else peak - before / GIB
        return {"total": seconds, "peak_gib": peak, "activations_gib": above, "frames": frames, "latents": last[0]}

    def vidq(self, pipeline: VideoPipeline, spec: GenerationSpec) -> RenderResult:
        self.reset_peak()
        return pipeline.generate(spec, text_rows=lambda texts: [self.rows[t] for t in texts], keep_latents=True)

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> float | None:
        return torch.cuda.max_memory_allocated(self.device) / GIB if self.device.type == "cuda" else None

    def copy_pipeline(self, policy: TierPolicy, *, share_transformer: bool = False) -> VideoPipeline:
        """A VideoPipeline under ``policy`` on deep copies of the plain pipeline's VAE (and transformer): the same
        weights, levers applied to the copies only. A shared transformer takes no lever: eager policies only."""
        pipe = WanPipeline(
            tokenizer=self.pipe.tokenizer,
            text_encoder=None,
            transformer=self.pipe.transformer if share_transformer else copy.deepcopy(self.pipe.transformer),
            vae=copy.deepcopy(self.pipe.vae),
            scheduler=copy.deepcopy(self.pipe.scheduler),
        )
        pipe.set_progress_bar_config(disable=True)
        return VideoPipeline(pipe, model=self.args.model, device=self.device, dtype=self.dtype, policy=policy)

    # --- phases ----------------------------------------------------------------------------------------------------

    def build(self) -> None:
        self.build_plain()
        self.exact = self.copy_pipeline(policy_for("exact", device=self.device, compile_mode=self.args.compile))
        self.report["exact_policy"] = self.exact.policy.describe()

    def build_plain(self) -> None:
        """The plain pipeline, the prompt embeddings both sides render from, and an empty compile cache."""
        started = time.perf_counter()
        self.pipe = build_pipeline(self.args.model, device=self.device, dtype=self.dtype)
        self.pipe.set_progress_bar_config(disable=True)
        plain_vidq = VideoPipeline(self.pipe, model=self.args.model, device=self.device, dtype=self.dtype)
        texts = list(texts_of(PROMPT, NEGATIVE, self.args.guidance))
        rows = plain_vidq.encode_texts(texts)
        self.rows = dict(zip(texts, rows, strict=True))
        self.embeds = pad(rows, max_sequence_length=MAX_SEQUENCE_LENGTH, device=self.device)
        self.clock.sync()
        self.report["build_s"] = time.perf_counter() - started
        # An empty compile cache: a pipeline's first warm-up is the cold compile a first worker on a machine pays.
        self.cache = Path(tempfile.mkdtemp(prefix="vidq-compile-"))
        use_compile_cache(str(self.cache))

    def attention(self, shape: str) -> dict[str, Any]:
        """The attention kernels at ``shape`` (once per shape): the report's entry for the shape."""
        spec = self.spec(shape)
        entry: dict[str, Any] = self.report["shapes"].setdefault(
            shape, {"tokens": tokens_per_sample(self.pipe, spec.height, spec.width, spec.num_frames)}
        )
        if "attention_kernels" not in entry:
            entry["attention_kernels"] = attention_kernels(self.pipe, shape, self.device, self.dtype)
        return entry

    def headline(self, shape: str) -> None:
        spec = self.spec(shape)
        entry = self.attention(shape)
        entry["warm_up_s"] = warm_up(self.exact, [shape], guidance_scale=self.args.guidance)[shape]
        self.plain(spec)  # plain's own first call (cuDNN/cuBLAS choices), untimed
        plain_runs: list[dict[str, Any]] = []
        exact_runs: list[RenderResult] = []
        for run in range(self.args.runs):
            exact_runs.append(self.vidq(self.exact, spec))
            plain_runs.append(self.plain(spec))
            stages = ", ".join(f"{k} {v:.3f}" for k, v in exact_runs[-1].timings_s.items())
            print(f"{shape} run {run + 1}: exact ({stages}) s, plain {plain_runs[-1]['total']:.3f} s", flush=True)
        steady = [r.timings_s["total"] for r in exact_runs[1:]] or [exact_runs[0].timings_s["total"]]
        plain_total = summary([r["total"] for r in plain_runs])
        exact_total = summary([r.timings_s["total"] for r in exact_runs])
        entry |= {
            "plain_s": plain_total,
            "exact_s": exact_total,
            "speedup": plain_total["median"] / exact_total["median"],
            "first_job_s": exact_runs[0].timings_s["total"],
            "first_job_stages_s": exact_runs[0].timings_s,
            "steady_s": statistics.median(steady),
            "exact_stages_s": {
                stage: statistics.median(r.timings_s[stage] for r in exact_runs)
                for stage in ("encode_text", "denoise", "decode")
            },
            "peak_gib": {
                "plain": max(r["peak_gib"] or 0.0 for r in plain_runs),
                "exact": max((r.peak_vram_bytes or 0) / GIB for r in exact_runs),
            },
            "attention_ran": exact_runs[-1].precision.attention,
        }
        entry["drift"] = self.drift(plain_runs[-1], exact_runs[-1])
        entry["vae"] = self.vae_share(plain_runs[-1])

    def drift(self, plain: dict[str, Any], exact: RenderResult) -> dict[str, float]:
        assert exact.latents is not None
        diff = (exact.latents.float() - plain["latents"].float()).abs()
        return {
            "latents_max_abs": float(diff.max()),
            "latents_mean_abs": float(diff.mean()),
            "latents_abs_max": float(plain["latents"].float().abs().max()),
            "frames_psnr_db": psnr(exact.frames, plain["frames"]),
            "frames_max_abs": int(np.abs(exact.frames.astype(np.int16) - plain["frames"]).max()),
        }

    def vae_share(self, plain: dict[str, Any]) -> dict[str, float]:
        """The VAE alone: plain's latents decoded by the exact pipeline's VAE against plain's float32 decode, and
        the same bf16 VAE run eagerly (the compiled decoder's share)."""
        with torch.inference_mode():
            decode = lambda: self.exact._decode(plain["latents"])  # noqa: E731
            bf16_s = timed(decode, self.device, reps=2)
            frames = _to_uint8(decode())
            eager = self.copy_pipeline(eager_policy(), share_transformer=True)
            eager.pipe.vae.to(getattr(torch, self.exact.policy.vae_dtype))
            eager_s = timed(functools.partial(eager._decode, plain["latents"]), self.device, reps=2)
            fp32_vae = VideoPipeline(self.pipe, model=self.args.model, device=self.device, dtype=self.dtype)
            fp32_s = timed(lambda: fp32_vae._decode(plain["latents"]), self.device, reps=2)
        return {
            "dtype": self.exact.policy.vae_dtype,
            "decode_s": bf16_s,
            "eager_decode_s": eager_s,
            "float32_decode_s": fp32_s,
            "frames_psnr_db": psnr(frames, plain["frames"]),
            "frames_max_abs": int(np.abs(frames.astype(np.int16) - plain["frames"]).max()),
        }

    def ablation(self, shape: str) -> None:
        """Each lever's share at ``shape``, while the budget lasts: one lever added at a time from plain eager."""
        spec = self.spec(shape)
        exact = self.exact.policy
        steps: list[tuple[str, Callable[[], VideoPipeline]]] = []
        if self.exact.flash4:
            steps.append(
                (
                    "exact, attention on SDPA (cuDNN) instead of FlashAttention 4",
                    lambda: self.copy_pipeline(replace(exact, attention=SDPA_PREFERENCE)),
                )
            )
        steps.append(("exact, VAE decoder eager", lambda: self.copy_pipeline(replace(exact, compile_vae=False))))
        if "plain_s" in self.report["shapes"].get(shape, {}):
            plain_s = self.report["shapes"][shape]["plain_s"]["median"]
        else:
            self.plain(spec)
            plain_s = statistics.median(self.plain(spec)["total"] for _ in range(self.args.ablation_runs))
            self.report["shapes"].setdefault(shape, {})["plain_s"] = {"median": plain_s}
        for name, make in steps:
            if self.clock.elapsed() > self.args.budget_s:
                self.report["ablation"].append({"variant": name, "skipped": "over the time budget"})
                continue
            try:
                pipeline = make()
                started = time.perf_counter()
                warm_up(pipeline, [shape], guidance_scale=self.args.guidance)
                warm_s = time.perf_counter() - started
                runs = [self.vidq(pipeline, spec).timings_s for _ in range(self.args.ablation_runs)]
                median = statistics.median(r["total"] for r in runs)
                self.report["ablation"].append(
                    {
                        "variant": name,
                        "s": median,
                        "denoise_s": statistics.median(r["denoise"] for r in runs),
                        "speedup": plain_s / median,
                        "warm_up_s": warm_s,
                    }
                )
                print(f"ablation {name}: {median:.3f} s", flush=True)
                del pipeline
            except Exception as exc:
                self.fail(f"ablation {name}", exc)
            finally:
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
            self.write()

    def profile(self, shape: str, pipeline: VideoPipeline | None = None, spec: GenerationSpec | None = None) -> None:
        """GPU time of one render (2 steps; by default exact's) by kernel kind, and its busiest kernels."""
        from torch.profiler import ProfilerActivity, profile

        pipeline = pipeline or self.exact
        spec = (spec or self.spec(shape)).model_copy(update={"steps": 2})
        warm_up(pipeline, [shape], guidance_scale=self.args.guidance)
        self.vidq(pipeline, spec)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            result = self.vidq(pipeline, spec)
        kinds: dict[str, float] = {}
        kernels = []
        for event in prof.key_averages():
            device_us = float(getattr(event, "device_time_total", 0.0) or getattr(event, "cuda_time_total", 0.0))
            if device_us <= 0 or getattr(event, "device_type", None) != torch.autograd.DeviceType.CUDA:
                continue
            kind = kernel_kind(event.key)
            kinds[kind] = kinds.get(kind, 0.0) + device_us / 1e6
            kernels.append({"kernel": event.key[:160], "kind": kind, "s": device_us / 1e6, "calls": event.count})
        kernels.sort(key=lambda k: -k["s"])
        self.report["profile"] = {
            "shape": shape,
            "steps": 2,
            "wall_s": result.timings_s,
            "by_kind_s": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
            "top": kernels[:40],
        }

    def fail(self, phase: str, exc: BaseException) -> None:
        traceback.print_exc()
        self.report["errors"].append({"phase": phase, "error": f"{type(exc).__name__}: {exc}"[:2000]})

    # --- output ----------------------------------------------------------------------------------------------------

    @staticmethod
    def markdown(report: dict[str, Any]) -> str:
        return markdown(report)

    def write(self) -> None:
        out: Path = self.args.out
        out.mkdir(parents=True, exist_ok=True)
        gpu = re.sub(r"[^a-z0-9]+", "_", self.report["machine"]["gpu"].lower().replace("nvidia", "")).strip("_")
        stem = f"{self.report['benchmark']}_{gpu}_{dt.date.today():%Y%m%d}{self.args.tag}"
        (out / f"{stem}.json").write_text(json.dumps(self.report, indent=2, default=str) + "\n")
        (out / f"{stem}.md").write_text(self.markdown(self.report))


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    if any(s in lowered for s in ("fmha", "flash", "cudnn_attn", "attention", "sdpa", "cudnn::fusion")):
        return "attention"
    if any(s in lowered for s in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "matmul")):
        return "gemm"
    if any(s in lowered for s in ("conv", "implicit", "winograd", "fft", "cudnn")):
        return "convolution"
    if lowered.startswith("triton_"):
        return "fused elementwise (inductor)"
    if any(s in lowered for s in ("elementwise", "vectorized", "reduce", "copy", "cat", "norm", "fill")):
        return "aten elementwise"
    return "other"


def markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        f"# gpu_exact: {m['gpu']}, {report['date_utc']}",
        "",
        f"`{report['command']}`",
        "",
        f"{report['model']} (random weights), {report['steps']} steps, guidance {report['guidance_scale']}, "
        f"{report['dtype']}; plain = `WanPipeline.__call__` (VAE float32), exact = vidq's exact tier; same "
        "embeddings, seed and weights; runs alternate.",
        "",
        "| shape | tokens | plain s | exact s | speed-up | first job s | steady s | cold compile s "
        "| peak GiB plain / exact |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for shape, e in report["shapes"].items():
        if "speedup" not in e:
            continue
        lines.append(
            f"| {shape} | {e['tokens']} | {e['plain_s']['median']:.3f} | {e['exact_s']['median']:.3f} | "
            f"**{e['speedup']:.2f}×** | {e['first_job_s']:.3f} | {e['steady_s']:.3f} | {e['warm_up_s']:.1f} | "
            f"{_num(e['peak_gib']['plain'])} / {_num(e['peak_gib']['exact'])} |"
        )
    lines += [
        "",
        "| shape | exact denoise s | decode s (exact / bf16 eager / fp32) | attention ran | latents max abs diff "
        "| frames PSNR dB | VAE-only PSNR dB |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for shape, e in report["shapes"].items():
        if "drift" not in e:
            continue
        d, v = e["drift"], e["vae"]
        lines.append(
            f"| {shape} | {e['exact_stages_s']['denoise']:.3f} | {v['decode_s']:.3f} / {v['eager_decode_s']:.3f} / "
            f"{v['float32_decode_s']:.3f} | "
            f"{e['attention_ran']} | {d['latents_max_abs']:.4g} (of {d['latents_abs_max']:.3g}) | "
            f"{d['frames_psnr_db']:.1f} | {v['frames_psnr_db']:.1f} |"
        )
    lines += attention_table(report)
    if report["ablation"]:
        lines += [
            "",
            "| ablation (first shape) | s | denoise s | speed-up over plain | warm-up s |",
            "| --- | --- | --- | --- | --- |",
        ]
        for a in report["ablation"]:
            if "s" in a:
                lines.append(
                    f"| {a['variant']} | {a['s']:.3f} | {a['denoise_s']:.3f} | {a['speedup']:.2f}× "
                    f"| {a['warm_up_s']:.1f} |"
                )
            else:
                lines.append(f"| {a['variant']} | {a.get('skipped', 'failed')} | | | |")
    lines += profile_table(report)
    for error in report["errors"]:
        lines.append(f"\nerror in {error['phase']}: {error['error'][:300]}")
    lines += [
        "",
        machine_line(report),
        "Drift is measured on random weights (their output is noise): a lower bound of what trained weights show.",
    ]
    return "\n".join(lines) + "\n"


def profile_table(report: dict[str, Any]) -> list[str]:
    """The profiled render's GPU time by kernel kind and its busiest kernels, as Markdown lines (none unprofiled)."""
    if "profile" not in report:
        return []
    p = report["profile"]
    total = sum(p["by_kind_s"].values())
    return [
        "",
        f"GPU time of one {p.get('variant', 'exact')} render at {p['shape']} ({p['steps']} steps, profiled): "
        f"{total:.3f} s of kernels; wall {p['wall_s'].get('total', 0):.3f} s "
        f"(denoise {p['wall_s'].get('denoise', 0):.3f} s).",
        "",
        "| kernel kind | s | share |",
        "| --- | --- | --- |",
        *(f"| {k} | {s:.3f} | {s / total:.1%} |" for k, s in p["by_kind_s"].items()),
        "",
        "| busiest kernels | kind | s | calls |",
        "| --- | --- | --- | --- |",
        *(f"| `{k['kernel'][:90]}` | {k['kind']} | {k['s']:.4f} | {k['calls']} |" for k in p["top"][:15]),
    ]


def attention_table(report: dict[str, Any]) -> list[str]:
    """The attention kernels timed at each shape (``attention_kernels``), as Markdown lines; a column of relative
    error against float32 attention where a row has one."""
    rows = [(shape, k) for shape, e in report["shapes"].items() for k in e.get("attention_kernels", [])]
    if not rows:
        return []
    relative = any("rel_l2_vs_fp32" in k for _, k in rows)
    extra = " relative L2 error vs float32 |" if relative else ""
    lines = [
        "",
        "| shape | attention kernel | ms (batch 2) | TFLOP/s | SDPA's default | max abs diff from SDPA's default |"
        + extra,
        "| --- | --- | --- | --- | --- | --- |" + (" --- |" if relative else ""),
    ]
    for shape, k in rows:
        cell = ""
        if "rel_l2_vs_fp32" in k:
            cell = f" {k['rel_l2_vs_fp32']:.4f} (bf16 default: {k['bf16_default_rel_l2_vs_fp32']:.4f}) |"
        elif relative:
            cell = " |"
        if "ms" in k:
            lines.append(
                f"| {shape} | {k['backend']} | {k['ms']:.2f} | {k['tflop_s']:.0f} "
                f"| {'yes' if k['default'] else ''} | {k.get('max_abs_diff', float('nan')):.3g} |{cell}"
            )
        else:
            lines.append(f"| {shape} | {k['backend']} | — | {k['error']} | | |{' |' if relative else ''}")
    return lines


def machine_line(report: dict[str, Any]) -> str:
    m = report["machine"]
    return (
        f"Build {report.get('build_s', 0):.1f} s. Machine: {m['gpu']}, driver {m.get('driver', '-')}, CUDA "
        f"{m.get('cuda', '-')}, cuDNN {m.get('cudnn', '-')}, torch {m['torch']}, diffusers {m['diffusers']}, "
        f"transformers {m['transformers']}, Python {m['python']}."
    )


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench = Bench(args)
    phases = set(args.phases.split(","))
    bench.build()
    bench.write()
    if "profile" in phases:
        try:
            bench.profile(args.shapes[0])
        except Exception as exc:
            bench.fail("profile", exc)
        bench.write()
    for shape in args.shapes if "attention" in phases else []:
        try:
            bench.attention(shape)
        except Exception as exc:
            bench.fail(f"attention {shape}", exc)
        bench.write()
    for index, shape in enumerate(args.shapes):
        if "headline" in phases:
            try:
                bench.headline(shape)
            except Exception as exc:
                bench.fail(f"headline {shape}", exc)
            bench.write()
        if index == 0 and "ablation" in phases:  # its levers at the first shape, before the next shape's headline
            bench.ablation(shape)
    bench.write()
    print(markdown(bench.report))
    return 1 if bench.report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
