"""Memory modes on a GPU: peak VRAM and time of ``resident`` vs ``low_vram`` (shared/render/registry.py
``apply_memory_mode``: the transformer streamed block by block from pinned CPU RAM on a side stream, the text encoder
copied whole for each encode; the VAE decoding whole when its estimated peak fits the free memory, in tiles when
not: shared/render/memory.py).

For each mode, in one process: the worker's ``VideoPipeline`` of ``--model`` (text encoder included, as a
``VIDQ_WORKER_TEXT_ENCODER=local`` worker runs it; every tier lever off, VAE in ``--vae-dtype``), built in ``resident``
mode, then rebuilt in ``low_vram`` (the first one freed, so its weights are not counted). Per shape, after one warm-up
render, ``--runs`` timed renders of ``--steps`` steps: peak VRAM allocated and reserved and the stage that set it,
seconds per denoising step, decode seconds and whether the decode was tiled, text-encode seconds, a 20-step video's
seconds estimated from those, the memory model's estimate of a whole decode against the decode's own peak, and the
ratios low_vram / resident against the targets: at most 1.15× the time of a 20-step video, at most 0.50× the peak.
Same seed and inputs: the largest frame difference between the modes is reported too (a tiled decode blends
overlapping tiles). Writes ``gpu_memory_modes_<gpu>_<date><tag>.json`` and ``.md`` to ``--out``.

On the CPU the memory mode changes nothing (no peak, no tiling decision): a rehearsal that the script runs end to end.

    python -m benchmarks.gpu_memory_modes --out benchmarks/results
    python -m benchmarks.gpu_memory_modes --model tiny-wan --device cpu --shapes 64x64x9 --steps 2 --runs 1 \
        --out /tmp/mm  # rehearsal
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import platform
import re
import shlex
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import diffusers
import numpy as np
import torch
import transformers

from shared.render.memory import GIB, DecoderGeometry, untiled_decode_bytes
from shared.render.pipeline import VideoPipeline
from shared.render.precision import resolve_device
from shared.render.registry import WAN21_13B_ARCH, apply_memory_mode, build_pipeline
from shared.render.tiers import eager_policy, policy_for
from shared.spec import GenerationSpec, parse_shape

SHAPES = [(480, 832, 33), (720, 1280, 33)]
MODES = ("resident", "low_vram")
STEPS_ESTIMATED = 20  # a video's time is estimated for this many steps from the measured seconds per step
TARGET_TIME = 1.15  # low_vram / resident, a 20-step video's seconds: at most
TARGET_PEAK = 0.50  # low_vram / resident, peak allocated: at most


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=WAN21_13B_ARCH, help="wan2.1-1.3b-arch, or tiny-wan for a rehearsal")
    parser.add_argument("--device", default="cuda", help="cuda; cpu rehearses (the memory mode is then a no-op)")
    parser.add_argument(
        "--shapes", nargs="+", default=[f"{h}x{w}x{f}" for h, w, f in SHAPES], help="HEIGHTxWIDTHxFRAMES, or a,b"
    )
    parser.add_argument("--steps", type=int, default=4, help="denoising steps per timed render")
    parser.add_argument("--runs", type=int, default=2, help="timed renders per mode and shape, after a warm-up")
    parser.add_argument(
        "--vae-dtype",
        choices=("float32", "bfloat16", "worker"),
        default="float32",
        help="what the VAE decodes in: float32 (diffusers' default, as earlier runs of this benchmark), bfloat16, "
        "or worker (what the worker's tiers use on this device: bfloat16 on CUDA)",
    )
    parser.add_argument(
        "--decode-budget-mb", type=int, default=0, help="as VIDQ_WORKER_LOW_VRAM_DECODE_BUDGET_MB (0: the free memory)"
    )
    parser.add_argument("--tag", default="", help="appended to the results' file names")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.shapes = [parse_shape(s) for item in args.shapes for s in item.split(",") if s]
    return args


def spec(model: str, height: int, width: int, frames: int, steps: int) -> GenerationSpec:
    return GenerationSpec(
        model=model,
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


class StagePeaks:
    """A render's ``stage_scope`` (shared/render/pipeline.py): the device's peak allocated and reserved bytes in each
    stage, and the decode's peak above what was allocated as it began (what the memory model estimates)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.allocated: dict[str, int] = {}
        self.reserved: dict[str, int] = {}
        self.decode_increment = 0

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        if self.device.type != "cuda":
            yield
            return
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        try:
            yield
        finally:
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            self.allocated[stage] = max(self.allocated.get(stage, 0), peak)
            self.reserved[stage] = max(self.reserved.get(stage, 0), torch.cuda.max_memory_reserved(self.device))
            if stage == "decode":
                self.decode_increment = max(self.decode_increment, peak - before)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device, self.dtype = resolve_device(args.device, cuda_dtype="bfloat16")
        worker_vae = policy_for("exact", device=self.device, compile_mode="off").vae_dtype
        self.vae_dtype = worker_vae if args.vae_dtype == "worker" else args.vae_dtype
        self.report: dict[str, Any] = {
            "benchmark": "gpu_memory_modes",
            "date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M"),
            "command": shlex.join(["python", "-m", "benchmarks.gpu_memory_modes", *args.argv]),
            "machine": machine(self.device),
            "model": args.model,
            "dtype": str(self.dtype).removeprefix("torch."),
            "vae_dtype": self.vae_dtype,
            "steps": args.steps,
            "runs": args.runs,
            "decode_budget_mb": args.decode_budget_mb,
            "targets": {"time": TARGET_TIME, "peak": TARGET_PEAK},
            "build_s": {},
            "shapes": {},
        }
        self.frames: dict[tuple[str, str], np.ndarray] = {}

    def build(self, mode: str) -> VideoPipeline:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        started = time.perf_counter()
        pipe = build_pipeline(self.args.model, device=self.device, dtype=self.dtype)
        apply_memory_mode(pipe, mode, device=self.device)
        pipeline = VideoPipeline(
            pipe,
            model=self.args.model,
            device=self.device,
            dtype=self.dtype,
            memory_mode=mode,
            policy=replace(eager_policy(), vae_dtype=self.vae_dtype),
            decode_budget_mb=self.args.decode_budget_mb,
        )
        self.report["build_s"][mode] = round(time.perf_counter() - started, 2)
        return pipeline

    def measure(self, pipeline: VideoPipeline, shape: tuple[int, int, int]) -> dict[str, Any]:
        s = spec(self.args.model, *shape, self.args.steps)
        pipeline.generate(s)  # warm-up: kernels, allocator, pinned buffers
        peaks = StagePeaks(self.device)
        per_step, decode, encode, tiled, overall = [], [], [], [], []
        for _ in range(self.args.runs):
            result = pipeline.generate(s, stage_scope=peaks)
            per_step.append(result.timings_s["denoise"] / s.steps)
            decode.append(result.timings_s["decode"])
            encode.append(result.timings_s["encode_text"])
            if "decode_tiled" in result.timings_s:  # recorded where the pipeline decides (low_vram on CUDA)
                tiled.append(bool(result.timings_s["decode_tiled"]))
            overall.append(max([result.peak_vram_bytes or 0, *peaks.allocated.values()]))
            self.frames[(pipeline.memory_mode, name(shape))] = result.frames
        step_s, decode_s, encode_s = (statistics.median(v) for v in (per_step, decode, encode))
        row: dict[str, Any] = {
            "s_per_step": round(step_s, 4),
            "decode_s": round(decode_s, 3),
            "decode_tiled": any(tiled) if tiled else None,  # None: not decided here (resident, the CPU)
            "encode_text_s": round(encode_s, 3),
            f"est_{STEPS_ESTIMATED}_steps_s": round(step_s * STEPS_ESTIMATED + decode_s + encode_s, 2),
        }
        if self.device.type == "cuda":
            row |= {
                "peak_allocated_gib": round(max(overall) / GIB, 2),
                "peak_reserved_gib": round(max(peaks.reserved.values()) / GIB, 2),
                "peak_stage": max(peaks.allocated, key=lambda stage: peaks.allocated[stage]),
                "peak_by_stage_gib": {k: round(v / GIB, 2) for k, v in peaks.allocated.items()},
                "decode_peak_above_start_gib": round(peaks.decode_increment / GIB, 2),
            }
            if pipeline.decode_budget is not None:
                row["decode_budget_after_render_gib"] = round(pipeline.decode_budget() / GIB, 2)
        return row

    def estimate(self, pipeline: VideoPipeline, shape: tuple[int, int, int]) -> float:
        """The memory model's estimate of a whole decode of ``shape`` with this pipeline's VAE, in GiB."""
        pipe, (height, width, frames) = pipeline.pipe, shape
        vae = pipe.vae
        scale, temporal = pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal
        latents = (1, vae.config.z_dim, (frames - 1) // temporal + 1, height // scale, width // scale)
        geometry = DecoderGeometry.from_config(vae.config)
        return round(untiled_decode_bytes(latents, geometry, element_bytes=vae.dtype.itemsize) / GIB, 2)

    def run(self) -> None:
        for mode in MODES:
            pipeline = self.build(mode)
            for shape in self.args.shapes:
                rows = self.report["shapes"].setdefault(name(shape), {})
                rows[mode] = self.measure(pipeline, shape)
                rows["untiled_decode_estimate_gib"] = self.estimate(pipeline, shape)
                print(mode, name(shape), json.dumps(rows[mode]), flush=True)
                self.write()
            del pipeline
        for shape_name, rows in self.report["shapes"].items():
            rows["ratios"] = ratios(rows["resident"], rows["low_vram"])
            diff = np.abs(
                self.frames[("resident", shape_name)].astype(np.int16)
                - self.frames[("low_vram", shape_name)].astype(np.int16)
            )
            rows["frames_max_abs_diff"] = int(diff.max())
        self.write()

    def write(self) -> None:
        out: Path = self.args.out
        out.mkdir(parents=True, exist_ok=True)
        gpu = re.sub(r"[^a-z0-9]+", "_", self.report["machine"]["gpu"].lower().replace("nvidia", "")).strip("_")
        stem = f"{self.report['benchmark']}_{gpu}_{dt.date.today():%Y%m%d}{self.args.tag}"
        (out / f"{stem}.json").write_text(json.dumps(self.report, indent=2, default=str) + "\n")
        (out / f"{stem}.md").write_text(markdown(self.report))


def name(shape: tuple[int, int, int]) -> str:
    return "x".join(str(n) for n in shape)


def ratios(resident: dict[str, Any], low: dict[str, Any]) -> dict[str, Any]:
    """low_vram / resident, and whether each target is reached (None where the device has no peak to compare)."""
    key = f"est_{STEPS_ESTIMATED}_steps_s"
    time_ratio = round(low[key] / resident[key], 3)
    out: dict[str, Any] = {
        "time": time_ratio,
        "time_target": "reached" if time_ratio <= TARGET_TIME else "missed",
        "s_per_step": round(low["s_per_step"] / resident["s_per_step"], 3),
        "decode": round(low["decode_s"] / resident["decode_s"], 3),
    }
    if "peak_allocated_gib" in resident:
        peak_ratio = round(low["peak_allocated_gib"] / resident["peak_allocated_gib"], 3)
        out |= {"peak": peak_ratio, "peak_target": "reached" if peak_ratio <= TARGET_PEAK else "missed"}
    else:
        out |= {"peak": None, "peak_target": "n/a"}
    return out


def machine(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"device": str(device), "python": platform.python_version(), "cpu": platform.processor()}
    for module in (torch, diffusers, transformers, np):
        info[module.__name__] = str(module.__version__)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {
            "gpu": torch.cuda.get_device_name(device),
            "gpu_memory_gib": round(props.total_memory / GIB, 1),
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),  # type: ignore[no-untyped-call,unused-ignore]
        }
    else:
        info["gpu"] = "cpu"
    return info


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} GiB"


def tiled_cell(mode: str, tiled: bool | None) -> str:
    if tiled is None:
        return "no (never)" if mode == "resident" else "- (not decided here)"
    return "yes" if tiled else "no"


def markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    est = f"est_{STEPS_ESTIMATED}_steps_s"
    lines = [
        f"# Memory modes: `resident` vs `low_vram`, {m['gpu']}, {report['date_utc']}",
        "",
        f"- command: `{report['command']}` ({report['steps']} denoising steps per render, median of {report['runs']} "
        "after a warm-up)",
        f"- machine: {m['gpu']}, torch {m['torch']} (CUDA {m.get('cuda', '-')}, cuDNN {m.get('cudnn', '-')}), "
        f"diffusers {m['diffusers']}, transformers {m['transformers']}, Python {m['python']}",
        f"- model: {report['model']} (random weights) with its text encoder on the worker, {report['dtype']}, "
        f"VAE {report['vae_dtype']}, CFG 5, every tier lever off; builds {report['build_s']} s",
        "- `low_vram`: the transformer streamed block by block from pinned CPU RAM, the text encoder copied whole per "
        "encode, the VAE decoding whole when its estimated peak fits the free memory less a margin"
        + (f" (capped at {report['decode_budget_mb']} MiB)" if report["decode_budget_mb"] else "")
        + ", in tiles when not",
        f"- targets, low_vram / resident: a {STEPS_ESTIMATED}-step video at most {TARGET_TIME}× the time, peak "
        f"allocated at most {TARGET_PEAK}×",
        "",
        "| shape | mode | peak allocated | peak reserved | peak in | s / step | decode s | decode tiled "
        f"| encode text s | est. {STEPS_ESTIMATED} steps s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for shape, rows in report["shapes"].items():
        for mode in MODES:
            r = rows.get(mode)
            if r is None:
                continue
            lines.append(
                f"| {shape.replace('x', '×')} | {mode} | {_gib(r.get('peak_allocated_gib'))} "
                f"| {_gib(r.get('peak_reserved_gib'))} | {r.get('peak_stage', '-')} | {r['s_per_step']:.3f} "
                f"| {r['decode_s']:.2f} | {tiled_cell(mode, r['decode_tiled'])} | {r['encode_text_s']:.3f} "
                f"| {r[est]:.2f} |"
            )
    lines.append("")
    for shape, rows in report["shapes"].items():
        ratio = rows.get("ratios")
        if ratio is None:
            continue
        peak = "n/a on the CPU" if ratio["peak"] is None else f"{ratio['peak']}×"
        lines.append(
            f"- {shape.replace('x', '×')}: low_vram / resident: time **{ratio['time']}×** ({ratio['time_target']}), "
            f"peak **{peak}** ({ratio['peak_target']}); per step {ratio['s_per_step']}×, decode {ratio['decode']}×; "
            f"frames max abs difference {rows['frames_max_abs_diff']} of 255."
        )
        resident = rows["resident"]
        if "decode_peak_above_start_gib" in resident:
            lines.append(
                f"  Whole decode: the memory model estimates {_gib(rows['untiled_decode_estimate_gib'])}; the "
                f"resident decode peaked {_gib(resident['decode_peak_above_start_gib'])} above its start."
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device here: pass --device cpu to rehearse", file=sys.stderr)
        return 2
    bench = Bench(args)
    bench.run()
    print(markdown(bench.report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
