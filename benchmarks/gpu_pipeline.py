"""GPU benchmark of the worker's render path: vidq's VideoPipeline against a plain diffusers call, same run.

Defaults: Wan2.1-T2V-1.3B shapes with random weights (``wan2.1-1.3b-arch``: the real model's cost, noise for
output), 480x832, 33 frames, 20 steps, guidance 5 (so classifier-free guidance doubles the transformer work).
After the warm-up, vidq and plain runs alternate, so clock or thermal drift hits both alike.

    python -m benchmarks.gpu_pipeline [--runs 3] [--out benchmarks/results]

Writes ``gpu_pipeline_<gpu>_<date>.json`` and ``.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import platform
import re
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import av
import diffusers
import numpy as np
import tokenizers
import torch
import transformers

from shared.render.pipeline import VideoPipeline, tokens_per_sample
from shared.render.precision import dtype_name, resolve_device
from shared.render.registry import WAN21_13B_ARCH, build_pipeline
from shared.render.video import encode_mp4, probe
from shared.spec import GenerationSpec

PROMPT = "a red fox runs through fresh snow in a quiet forest at sunrise, cinematic, detailed"
NEGATIVE = "blurry, static, overexposed, worst quality, low quality, ugly, deformed, subtitles"
STAGES = ("encode_text", "denoise", "decode", "convert")  # convert: uint8 frames, what total leaves over
GIB = 1024**3


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=WAN21_13B_ARCH)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--fps", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    return args


def plain_call(pipe: Any, spec: GenerationSpec, device: torch.device) -> tuple[float, int, int, np.ndarray]:
    """One plain ``WanPipeline.__call__``: seconds, peak allocated and reserved bytes, float frames."""
    torch.cuda.reset_peak_memory_stats(device)
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    (video,) = pipe(
        prompt=spec.prompt,
        negative_prompt=spec.negative_prompt,
        height=spec.height,
        width=spec.width,
        num_frames=spec.num_frames,
        num_inference_steps=spec.steps,
        guidance_scale=spec.guidance_scale,
        generator=torch.Generator(device=device).manual_seed(spec.seed),
        output_type="np",
        return_dict=False,
    )
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    return seconds, torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device), video[0]


def denoise_tflop(pipe: Any, spec: GenerationSpec) -> float:
    """Matmul FLOPs of the transformer over all steps (projections, attention, FFN), in TFLOP."""
    cfg = pipe.transformer.config
    dim, ffn, layers = cfg.num_attention_heads * cfg.attention_head_dim, cfg.ffn_dim, cfg.num_layers
    tokens = tokens_per_sample(pipe, spec.height, spec.width, spec.num_frames)
    text = 512
    self_attn = 4 * 2 * tokens * dim * dim + 2 * 2 * tokens * tokens * dim
    cross_attn = 2 * 2 * tokens * dim * dim + 2 * 2 * text * dim * dim + 2 * 2 * tokens * text * dim
    ffn_flops = 2 * 2 * tokens * dim * ffn
    passes = spec.steps * (2 if spec.guidance_scale > 1.0 else 1)
    return float(layers * (self_attn + cross_attn + ffn_flops) * passes / 1e12)


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def machine() -> dict[str, Any]:
    props = torch.cuda.get_device_properties(0)
    info: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(0),
        "gpu_memory_gib": round(props.total_memory / GIB, 1),
        "compute_capability": f"{props.major}.{props.minor}",
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),  # type: ignore[no-untyped-call,unused-ignore]  # typed in newer torch
        "python": platform.python_version(),
    }
    for module in (torch, diffusers, transformers, tokenizers, av, np):
        info[module.__name__] = str(module.__version__)
    try:
        import pynvml

        pynvml.nvmlInit()
        info["driver"] = pynvml.nvmlSystemGetDriverVersion()
    except Exception as exc:  # the driver version is nice to have, not worth failing a finished benchmark
        info["driver"] = f"unknown ({type(exc).__name__})"
    return info


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA device", file=sys.stderr)
        return 2
    device, dtype = resolve_device("cuda", cuda_dtype=args.dtype)
    host = machine()  # first, so a missing library fails before minutes of GPU work, not after
    spec = GenerationSpec(
        model=args.model,
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        width=args.width,
        height=args.height,
        num_frames=args.frames,
        fps=args.fps,
        steps=args.steps,
        guidance_scale=args.guidance,
        seed=args.seed,
    )

    started = time.perf_counter()
    pipe = build_pipeline(args.model, device=device, dtype=dtype)
    torch.cuda.synchronize(device)
    build_s = time.perf_counter() - started
    vidq = VideoPipeline(pipe, model=args.model, device=device, dtype=dtype)
    steps_seen: list[int] = []

    for _ in range(args.warmup):
        vidq.generate(spec)
        plain_call(pipe, spec, device)

    vidq_runs: list[dict[str, Any]] = []
    plain_runs: list[dict[str, Any]] = []
    for run in range(args.runs):
        steps_seen.clear()
        result = vidq.generate(spec, on_step=lambda done, total: steps_seen.append(done))
        convert = result.timings_s["total"] - sum(result.timings_s[k] for k in STAGES[:-1])
        vidq_runs.append(
            {
                **result.timings_s,
                "convert": convert,
                "peak_allocated_bytes": result.peak_vram_bytes or 0,
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
            }
        )
        seconds, allocated, reserved, plain_video = plain_call(pipe, spec, device)
        plain_runs.append({"total": seconds, "peak_allocated_bytes": allocated, "peak_reserved_bytes": reserved})
        print(f"run {run + 1}: vidq {result.timings_s['total']:.3f} s, plain {seconds:.3f} s", flush=True)

    plain_frames = np.clip(np.rint(plain_video * 255.0), 0, 255).astype(np.uint8)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.mp4"
        started = time.perf_counter()
        encode_mp4(result.frames, fps=spec.fps, path=path)
        encode_s = time.perf_counter() - started
        info = probe(path)
        mp4_bytes = path.stat().st_size

    vidq_total = summary([r["total"] for r in vidq_runs])
    plain_total = summary([r["total"] for r in plain_runs])
    stages = {
        stage: {
            "median_s": (s := statistics.median(r[stage] for r in vidq_runs)),
            "share": s / vidq_total["median"],
        }
        for stage in STAGES
    }
    tflop = denoise_tflop(pipe, spec)
    report: dict[str, Any] = {
        "benchmark": "gpu_pipeline",
        "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(sys.orig_argv),
        "machine": host,
        "spec": spec.to_dict(),
        "dtype": dtype_name(dtype),
        "vae_dtype": dtype_name(pipe.vae.dtype),
        "warmup_runs": args.warmup,
        "build_s": build_s,
        "vidq_s_per_video": vidq_total,
        "plain_diffusers_s_per_video": plain_total,
        "ratio_vidq_over_plain": vidq_total["median"] / plain_total["median"],
        "stages": stages,
        "denoise_tflop": tflop,
        "denoise_tflop_per_s": tflop / stages["denoise"]["median_s"],
        "peak_vram": {
            "vidq_allocated_gib": max(r["peak_allocated_bytes"] for r in vidq_runs) / GIB,
            "vidq_reserved_gib": max(r["peak_reserved_bytes"] for r in vidq_runs) / GIB,
            "plain_allocated_gib": max(r["peak_allocated_bytes"] for r in plain_runs) / GIB,
            "plain_reserved_gib": max(r["peak_reserved_bytes"] for r in plain_runs) / GIB,
        },
        "on_step_calls_last_run": len(steps_seen),
        "frames_vs_plain_max_abs_diff": int(np.abs(plain_frames.astype(np.int16) - result.frames).max()),
        "plain_frames_finite": bool(np.isfinite(plain_video).all()),
        "mp4": {"encode_s": encode_s, "bytes": mp4_bytes, **dataclasses.asdict(info)},
        "runs": {"vidq": vidq_runs, "plain": plain_runs},
    }
    write(report, args.out)
    return 0


def write(report: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    gpu = re.sub(r"[^a-z0-9]+", "_", report["machine"]["gpu"].lower().replace("nvidia", "")).strip("_")
    stem = f"gpu_pipeline_{gpu}_{dt.date.today():%Y%m%d}"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    m, s, v, mp4 = report["machine"], report["spec"], report["peak_vram"], report["mp4"]
    vq, pl = report["vidq_s_per_video"], report["plain_diffusers_s_per_video"]
    lines = [
        f"# gpu_pipeline: {m['gpu']}, {report['date_utc']}",
        "",
        f"`{report['command']}`",
        "",
        f"{s['model']} (random weights), {s['height']}x{s['width']}, {s['num_frames']} frames, "
        f"{s['steps']} steps, guidance {s['guidance_scale']}; {report['dtype']} compute, "
        f"VAE {report['vae_dtype']}; "
        f"{report['warmup_runs']} warm-up, {len(report['runs']['vidq'])} timed runs each, alternating.",
        "",
        "| path | median s/video | min | max |",
        "| --- | --- | --- | --- |",
        f"| vidq VideoPipeline | {vq['median']:.3f} | {vq['min']:.3f} | {vq['max']:.3f} |",
        f"| plain WanPipeline.__call__ | {pl['median']:.3f} | {pl['min']:.3f} | {pl['max']:.3f} |",
        "",
        f"vidq / plain = **{report['ratio_vidq_over_plain']:.3f}**; frames vs plain: max |diff| "
        f"{report['frames_vs_plain_max_abs_diff']} (uint8).",
        "",
        "| stage | median s | share |",
        "| --- | --- | --- |",
        *(f"| {k} | {x['median_s']:.3f} | {x['share']:.1%} |" for k, x in report["stages"].items()),
        "",
        f"Denoise: {report['denoise_tflop']:.0f} TFLOP of matmuls, {report['denoise_tflop_per_s']:.0f} TFLOP/s.",
        f"Peak VRAM: vidq {v['vidq_allocated_gib']:.2f} GiB allocated / "
        f"{v['vidq_reserved_gib']:.2f} reserved; "
        f"plain {v['plain_allocated_gib']:.2f} / {v['plain_reserved_gib']:.2f}.",
        f"MP4 (PyAV libx264, crf 18): {mp4['encode_s']:.3f} s, {mp4['bytes'] / 1e6:.2f} MB; "
        f"probe: {mp4['codec']}, {mp4['frames']} frames, {mp4['width']}x{mp4['height']}, "
        f"{mp4['fps']:g} fps, {mp4['pix_fmt']}.",
        f"Build (random init on the GPU): {report['build_s']:.1f} s.",
        "",
        f"Machine: driver {m['driver']}, CUDA {m['cuda']}, torch {m['torch']}, diffusers {m['diffusers']}, "
        f"transformers {m['transformers']}, Python {m['python']}.",
    ]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
