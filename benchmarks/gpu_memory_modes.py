"""Memory modes on a GPU: peak VRAM and time of ``resident`` vs ``low_vram`` (shared/render/registry.py
``apply_memory_mode``: group offloading of the transformer and text encoder on a side stream, VAE tiling).

For each shape, in one process: the worker's ``VideoPipeline`` of ``wan2.1-1.3b-arch`` (text encoder included, as
a ``VIDQ_WORKER_TEXT_ENCODER=local`` worker runs it) in ``resident`` mode, then rebuilt in ``low_vram`` (the first
one freed, so its weights are not counted); after one warm-up render each, ``--runs`` timed renders of ``--steps``
steps: peak VRAM allocated and reserved, seconds per denoising step, decode and text-encode seconds, and the
ratios low_vram / resident. Same seed and inputs: the largest frame difference between the modes is reported too.

    python -m benchmarks.gpu_memory_modes --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shared.render.architectures import WAN21_13B_ARCH
from shared.render.pipeline import VideoPipeline
from shared.render.registry import apply_memory_mode, build_pipeline
from shared.spec import GenerationSpec

GIB = 1024**3
SHAPES = [(480, 832, 33), (720, 1280, 33)]


def spec(height: int, width: int, frames: int, steps: int) -> GenerationSpec:
    return GenerationSpec(
        model=WAN21_13B_ARCH,
        prompt="a lighthouse on a cliff in a storm, waves breaking, cinematic",
        negative_prompt="blurry, low quality",
        width=width,
        height=height,
        num_frames=frames,
        fps=16,
        steps=steps,
        guidance_scale=5.0,
        seed=0,
    )


def build(mode: str) -> VideoPipeline:
    gc.collect()
    torch.cuda.empty_cache()
    device, dtype = torch.device("cuda"), torch.bfloat16
    pipe = build_pipeline(WAN21_13B_ARCH, device=device, dtype=dtype)
    apply_memory_mode(pipe, mode, device=device)
    return VideoPipeline(pipe, model=WAN21_13B_ARCH, device=device, dtype=dtype, memory_mode=mode)


def measure(vp: VideoPipeline, s: GenerationSpec, runs: int) -> tuple[dict[str, Any], np.ndarray]:
    vp.generate(s)  # warm-up: kernels, allocator, pinned buffers
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    per_step, decode, encode, total = [], [], [], []
    frames = np.zeros(0)
    for _ in range(runs):
        started = time.perf_counter()
        result = vp.generate(s)
        total.append(time.perf_counter() - started)
        per_step.append(result.timings_s["denoise"] / s.steps)
        decode.append(result.timings_s["decode"])
        encode.append(result.timings_s["encode_text"])
        frames = result.frames
    row = {
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / GIB, 2),
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 2),
        "s_per_step": round(statistics.median(per_step), 4),
        "decode_s": round(statistics.median(decode), 3),
        "encode_text_s": round(statistics.median(encode), 3),
        "render_s": round(statistics.median(total), 3),
        "est_20_steps_s": round(
            statistics.median(per_step) * 20 + statistics.median(decode) + statistics.median(encode), 2
        ),
    }
    return row, frames


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--shapes", default=",".join(f"{h}x{w}x{f}" for h, w, f in SHAPES))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA device", file=sys.stderr)
        return 2
    shapes = [tuple(int(x) for x in item.split("x")) for item in args.shapes.split(",")]
    results: dict[str, Any] = {"modes": {}, "frames_max_abs_diff": {}}
    frames: dict[tuple[str, str], np.ndarray] = {}
    for mode in ("resident", "low_vram"):
        vp = build(mode)
        for h, w, f in shapes:
            name = f"{h}x{w}x{f}"
            row, frames[(mode, name)] = measure(vp, spec(h, w, f, args.steps), args.runs)
            results["modes"].setdefault(name, {})[mode] = row
            print(mode, name, json.dumps(row), flush=True)
        del vp
    for name, rows in results["modes"].items():
        r, lo = rows["resident"], rows["low_vram"]
        rows["ratio_low_vram_over_resident"] = {
            "peak_allocated": round(lo["peak_allocated_gib"] / r["peak_allocated_gib"], 3),
            "s_per_step": round(lo["s_per_step"] / r["s_per_step"], 3),
            "render": round(lo["render_s"] / r["render_s"], 3),
        }
        diff = np.abs(frames[("resident", name)].astype(np.int16) - frames[("low_vram", name)].astype(np.int16))
        results["frames_max_abs_diff"][name] = int(diff.max())
    import diffusers

    results["machine"] = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "diffusers": diffusers.__version__,
        "python": platform.python_version(),
        "date": dt.date.today().isoformat(),
    }
    results["command"] = " ".join([sys.executable, "-m", "benchmarks.gpu_memory_modes", *(argv or sys.argv[1:])])
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gpu_memory_modes_h200_{dt.date.today():%Y%m%d}.json"
    path.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
