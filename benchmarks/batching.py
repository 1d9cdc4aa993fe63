"""Where batching pays: videos per second at batch 1, 2, 4 and 8 per shape, and the batch table workers read.

For each shape, the worker's own render path (``VideoPipeline.generate_batch`` under the worker's tier policy, the
same prompt embeddings for every run) renders ``--videos`` videos in batches of each size, after one warm-up batch of
that size; runs of the sizes alternate (clock and heat drift hit every size alike), ``--runs`` times. A shape's
table entry is the size with the most videos per second if that beats batch 1 by at least ``--gain``, else 1 (it
renders alone: batching must never cost a shape speed).

Writes ``batching_<device>_<date>.md`` (people), ``.json`` (every figure) and ``batching_<device>_table.json`` (the
table, for ``VIDQ_WORKER_BATCH_TABLE``) to ``--out``.

    python -m benchmarks.batching                                   # tiny-wan on this machine's device
    python -m benchmarks.batching --model wan2.1-1.3b-arch --shapes 480x832x33 320x576x33 240x416x17 --videos 8
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import diffusers
import torch

from shared.render.pipeline import VideoPipeline
from shared.render.precision import resolve_device
from shared.render.registry import TINY_WAN, build_pipeline
from shared.render.tiers import policy_for
from shared.spec import GenerationSpec, parse_shape

PROMPT = "a red fox runs through fresh snow in a quiet forest at sunrise"
NEGATIVE = "blurry, static, low quality"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=TINY_WAN)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--shapes", nargs="+", default=["64x64x9", "128x128x17", "256x256x17"], help="HxWxF")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--videos", type=int, default=8, help="videos per run (a multiple of every batch size)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--gain", type=float, default=1.3, help="least videos/s gain over batch 1 to batch a shape")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    return parser.parse_args(argv)


def machine(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "device": str(device),
        "cpu": platform.processor() or platform.machine(),
        "cpus": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def spec_for(model: str, shape: str, *, steps: int, seed: int) -> GenerationSpec:
    height, width, frames = parse_shape(shape)
    return GenerationSpec(
        model=model,
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        width=width,
        height=height,
        num_frames=frames,
        fps=8,
        steps=steps,
        guidance_scale=5.0,
        seed=seed,
    )


def videos_per_s(pipeline: VideoPipeline, specs: list[GenerationSpec], batch: int, rows: Any) -> float:
    started = time.perf_counter()
    for i in range(0, len(specs), batch):
        chunk = specs[i : i + batch]
        pipeline.generate_batch(chunk, on_steps=[lambda d, t: None] * len(chunk), text_rows=rows)
    return len(specs) / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device, dtype = resolve_device(args.device, cuda_dtype="bfloat16")
    pipe = build_pipeline(args.model, device=device, dtype=dtype)
    pipeline = VideoPipeline(
        pipe, model=args.model, device=device, dtype=dtype, policy=policy_for("exact", device=device)
    )
    cache: dict[str, torch.Tensor] = {}

    def rows(texts: list[str]) -> list[torch.Tensor]:  # each text encoded once: the runs time the render alone
        missing = [t for t in dict.fromkeys(texts) if t not in cache]
        if missing:
            cache.update(zip(missing, pipeline.encode_texts(missing), strict=True))
        return [cache[t] for t in texts]

    shapes: list[dict[str, Any]] = []
    for shape in args.shapes:
        specs = [spec_for(args.model, shape, steps=args.steps, seed=i) for i in range(args.videos)]
        for batch in args.batches:  # warm-up: the first render of each batch size builds what it needs
            videos_per_s(pipeline, specs[:batch], batch, rows)
        runs: dict[int, list[float]] = {b: [] for b in args.batches}
        for _ in range(args.runs):
            for batch in args.batches:
                runs[batch].append(videos_per_s(pipeline, specs, batch, rows))
        medians = {b: statistics.median(v) for b, v in runs.items()}
        best = max(medians, key=lambda b: medians[b])
        gain = medians[best] / medians[1]
        max_batch = best if gain >= args.gain else 1
        height, width, frames = parse_shape(shape)
        shapes.append(
            {
                "shape": shape,
                "model": args.model,
                "frames": frames,
                "height": height,
                "width": width,
                "videos_per_s": {str(b): round(m, 4) for b, m in medians.items()},
                "runs": {str(b): [round(x, 4) for x in v] for b, v in runs.items()},
                "gain_vs_1": {str(b): round(m / medians[1], 3) for b, m in medians.items()},
                "max_batch": max_batch,
            }
        )
        print(f"{shape}: " + ", ".join(f"b{b} {m:.3f}/s" for b, m in medians.items()) + f" → max_batch {max_batch}")
        report = write(args, argv, device, shapes)  # after every shape: a run cut short keeps what it measured

    print(markdown(report))
    return 0


def write(
    args: argparse.Namespace, argv: list[str] | None, device: torch.device, shapes: list[dict[str, Any]]
) -> dict[str, Any]:
    """The report and the table for the shapes measured so far, written to ``args.out``."""
    stamp = dt.datetime.now(dt.UTC)
    kind = "cuda" if device.type == "cuda" else "cpu"
    report = {
        "benchmark": "batching",
        "date": stamp.isoformat(timespec="seconds"),
        "command": "python -m benchmarks.batching " + shlex.join(sys.argv[1:] if argv is None else argv),
        "machine": machine(device),
        "steps": args.steps,
        "videos_per_run": args.videos,
        "runs": args.runs,
        "gain": args.gain,
        "shapes": shapes,
    }
    table = {
        "device": report["machine"].get("gpu", report["machine"]["cpu"]),
        "gain": args.gain,
        "shapes": [{k: s[k] for k in ("model", "frames", "height", "width", "max_batch")} for s in shapes],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    base = args.out / f"batching_{kind}_{stamp:%Y%m%d}"
    base.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / f"batching_{kind}_table.json").write_text(json.dumps(table, indent=2) + "\n")
    base.with_suffix(".md").write_text(markdown(report))
    return report


def markdown(report: dict[str, Any]) -> str:
    batches = list(report["shapes"][0]["videos_per_s"])
    lines = [
        f"# Batching — {report['machine'].get('gpu', report['machine']['cpu'])} ({report['machine']['device']})",
        "",
        f"`{report['command']}` — {report['date']}; {report['steps']} steps, guidance 5, "
        f"{report['videos_per_run']} videos per run, median of {report['runs']} runs; torch "
        f"{report['machine']['torch']}, diffusers {report['machine']['diffusers']}, Python "
        f"{report['machine']['python']}, {report['machine']['cpus']} threads.",
        "",
        "| shape (H×W×F) | " + " | ".join(f"videos/s at {b}" for b in batches) + " | best vs 1 | table |",
        "|---|" + "---|" * len(batches) + "---|---|",
    ]
    for s in report["shapes"]:
        best = max(s["gain_vs_1"].values())
        cells = " | ".join(f"{s['videos_per_s'][b]:.3f} ({s['gain_vs_1'][b]:.2f}×)" for b in batches)
        lines.append(f"| {s['shape']} | {cells} | {best:.2f}× | {s['max_batch']} |")
    lines += [
        "",
        f"A shape batches up to the table's size where that gained ≥ {report['gain']}× videos/s over batch 1; the "
        "rest render alone, so they lose nothing.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
