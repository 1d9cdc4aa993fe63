"""VRAM and time per shape, for sizing GPU workers (README "Sizing").

For each resolution × frame count, one warm render of the worker's own ``VideoPipeline`` (few steps: peak memory
does not depend on the step count, and s/step is what scales) records peak VRAM (allocated and reserved), seconds
per denoising step with CFG, and VAE decode seconds. The first shape is the reference: every other row is also
given as a ratio to it, measured in the same run.

    python -m benchmarks.gpu_sizing --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_pipeline import machine
from shared.render.pipeline import VideoPipeline
from shared.render.precision import resolve_device
from shared.render.registry import WAN21_13B_ARCH, build_pipeline
from shared.spec import GenerationSpec

SHAPES = [(480, 832, 33), (480, 832, 81), (720, 1280, 33), (720, 1280, 81)]
GIB = 1024**3


def measure(vp: VideoPipeline, *, height: int, width: int, frames: int, steps: int) -> dict[str, Any]:
    spec = GenerationSpec(
        model=WAN21_13B_ARCH,
        prompt="a lighthouse on a cliff in a storm, waves breaking",
        negative_prompt="",
        width=width,
        height=height,
        num_frames=frames,
        fps=16,
        steps=steps,
        guidance_scale=5.0,
        seed=0,
    )
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    result = vp.generate(spec)
    return {
        "height": height,
        "width": width,
        "frames": frames,
        "steps": steps,
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / GIB, 2),
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 2),
        "s_per_step": round(result.timings_s["denoise"] / steps, 3),
        "decode_s": round(result.timings_s["decode"], 3),
        "est_20_steps_s": round(
            result.timings_s["denoise"] / steps * 20 + result.timings_s["decode"] + result.timings_s["encode_text"], 2
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    device, dtype = resolve_device("cuda", cuda_dtype="bfloat16")
    vp = VideoPipeline(
        build_pipeline(WAN21_13B_ARCH, device=device, dtype=dtype), model=WAN21_13B_ARCH, device=device, dtype=dtype
    )
    measure(vp, height=480, width=832, frames=9, steps=1)  # warm-up: kernels, allocator
    rows = [measure(vp, height=h, width=w, frames=f, steps=args.steps) for h, w, f in SHAPES]
    ref = rows[0]
    for row in rows:
        row["vram_vs_ref"] = round(row["peak_reserved_gib"] / ref["peak_reserved_gib"], 2)
        row["step_time_vs_ref"] = round(row["s_per_step"] / ref["s_per_step"], 2)
    report: dict[str, Any] = {
        "benchmark": "gpu_sizing",
        "model": WAN21_13B_ARCH,
        "dtype": "bfloat16 (VAE float32)",
        "guidance": 5.0,
        "command": "python -m benchmarks.gpu_sizing " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"gpu_sizing_{report['machine']['gpu'].split()[-1].lower()}_{dt.date.today():%Y%m%d}"
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    lines = [
        f"# gpu_sizing: {report['machine']['gpu']}, {report['when']}",
        "",
        f"`{report['command']}`; {WAN21_13B_ARCH}, bf16 (VAE fp32), CFG 5, {args.steps} steps per shape after a "
        "warm-up; reference row = first shape.",
        "",
        "| H×W×frames | peak alloc GiB | peak reserved GiB | s/step | decode s | est. 20 steps s "
        "| VRAM ×ref | step ×ref |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['height']}×{r['width']}×{r['frames']} | {r['peak_allocated_gib']} | {r['peak_reserved_gib']} | "
            f"{r['s_per_step']} | {r['decode_s']} | {r['est_20_steps_s']} | {r['vram_vs_ref']} | "
            f"{r['step_time_vs_ref']} |"
        )
    m = report["machine"]
    lines += [
        "",
        f"Machine: driver {m['driver']}, CUDA {m['cuda']}, torch {m['torch']}, "
        f"diffusers {m['diffusers']}, transformers {m['transformers']}, Python {m['python']}.",
    ]
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
