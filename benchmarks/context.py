"""What a video is about, measured: how well keyframe embeddings find copies, how often motion labels are right, and
what the context step costs a worker next to the render it follows.

* ``quality``: ``--clips`` synthetic clips (tools/clips.py: a camera moving over a random texture, each its own
  texture and motion) and, of each, a recoloured, a slightly cropped and an H.264 re-encoded copy, all encoded by
  ``--vae`` (the random-weights VAE of ``tiny-wan`` or of ``wan2.1-1.3b-arch``, Wan 2.1's architecture) and
  embedded as the worker embeds a render's latents. A copy is found when it and its original are each other's
  nearest neighbour: the copy's nearest original is its own, and the original's nearest among the other originals
  and its copy is the copy.
* ``labels``: clips of every motion at three speeds and ``--label-seeds`` textures, labelled by the context step's
  optical flow; the share labelled right, per motion.
* ``cost``: the context step at ``--shape`` (default 480×832×33): motion on the decoded frames (the worker's CPU),
  keyframe pooling of latents of that shape (on ``--device``), the projection, and the encoder reference of a frame
  count (once per process); its memory; and, with ``--render``, one plain render of ``wan2.1-1.3b-arch`` at the
  same shape in the same run (20 steps, eager, random prompt rows) as the denominator, plus the pooled keyframes the
  render itself handed over.

Writes ``context_<machine>_<date><tag>.json`` and ``.md`` to ``--out``.

    python -m benchmarks.context --sections quality,labels,cost --vae tiny-wan --clips 1000 --device cpu
    python -m benchmarks.context --sections quality,labels,cost --vae wan2.1-1.3b-arch --device cuda --render
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import resource
import shlex
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shared.context import embedding, motion
from tools import clips

COPIES = ("recoloured", "cropped", "reencoded")
SPEEDS = (0.5, 1.0, 2.0)


def build_vae(name: str, device: torch.device) -> Any:
    from diffusers import AutoencoderKLWan

    from shared.render.architectures import build_tiny_wan

    if name == "tiny-wan":
        return build_tiny_wan(device=device, dtype=torch.float32, text_encoder=False).vae
    torch.manual_seed(0)  # the VAE of wan2.1-1.3b-arch, as shared/render/architectures.py builds it
    return AutoencoderKLWan().to(device).eval()


def quality(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    vae = build_vae(args.vae, device)
    frames, size = args.clip_frames, args.clip_size
    reference = embedding.reference_tones(vae, frames)
    ratio = 4

    def embed(video: np.ndarray) -> np.ndarray:
        latents = embedding.encode_frames(vae, video)
        features = embedding.keyframe_features(latents, num_frames=frames, temporal_ratio=ratio, reference=reference)
        return embedding.embed(features)[1]

    rng = np.random.default_rng(args.seed)
    originals: list[np.ndarray] = []
    copies: dict[str, list[np.ndarray]] = {name: [] for name in COPIES}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.clips + 1):  # each clip among ``clips`` others
            shown = clips.clip(
                args.seed * 100_000 + i,
                clips.MOTIONS[i % len(clips.MOTIONS)],
                frames=frames,
                height=size,
                width=size,
                speed=float(rng.uniform(0.5, 2.0)),
            )
            originals.append(embed(shown))
            copies["recoloured"].append(embed(clips.recoloured(shown, seed=i)))
            copies["cropped"].append(embed(clips.cropped(shown)))
            copies["reencoded"].append(embed(clips.reencoded(shown, Path(tmp))))
    seconds = time.perf_counter() - started
    base = np.stack(originals)
    among = base @ base.T
    np.fill_diagonal(among, -2.0)
    nearest_other = among.max(axis=1)
    found: dict[str, Any] = {}
    for name in COPIES:
        copy = np.stack(copies[name])
        to_originals = copy @ base.T
        own = np.einsum("ij,ij->i", copy, base)
        forward = to_originals.argmax(axis=1) == np.arange(len(base))
        backward = own > nearest_other
        found[name] = {
            "mutual_nearest": round(float(np.mean(forward & backward)), 4),
            "copy_finds_original": round(float(np.mean(forward)), 4),
            "original_finds_copy": round(float(np.mean(backward)), 4),
            "similarity_to_copy_median": round(float(np.median(own)), 4),
            "similarity_to_nearest_other_median": round(float(np.median(nearest_other)), 4),
        }
    return {
        "vae": args.vae,
        "clips": len(base),
        "clip": f"{size}x{size}x{frames}",
        "seconds": round(seconds, 1),
        "copies": found,
    }


def labels(args: argparse.Namespace) -> dict[str, Any]:
    per_motion: dict[str, list[bool]] = {name: [] for name in clips.MOTIONS}
    wrong: list[str] = []
    started = time.perf_counter()
    for name in clips.MOTIONS:
        for speed in SPEEDS:
            for seed in range(args.label_seeds):
                shown = clips.clip(
                    10_000 + seed,
                    name,
                    frames=args.clip_frames,
                    height=args.clip_size,
                    width=args.clip_size,
                    speed=speed,
                )
                got = motion.analyse(shown).label
                per_motion[name].append(got == name)
                if got != name:
                    wrong.append(f"{name}@{speed}×/{seed}→{got}")
    total = [ok for oks in per_motion.values() for ok in oks]
    return {
        "clips": len(total),
        "accuracy": round(float(np.mean(total)), 4),
        "per_motion": {name: round(float(np.mean(oks)), 4) for name, oks in per_motion.items()},
        "wrong": wrong[:40],
        "seconds": round(time.perf_counter() - started, 1),
    }


def _median_s(fn: Callable[[], object], runs: int, device: torch.device) -> float:
    fn()  # first call: allocations, cuDNN / OpenCV setup
    times = []
    for _ in range(runs):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cost(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from shared.spec import parse_shape

    height, width, frames = parse_shape(args.shape)
    decoded = clips.clip(3, "pan_left", frames=frames, height=height, width=width, speed=1.0)
    latent_shape = (1, 16, (frames - 1) // 4 + 1, height // 8, width // 8)
    latents = torch.randn(latent_shape, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    vae = build_vae("wan2.1-1.3b-arch" if args.vae != "tiny-wan" else "tiny-wan", device)
    t0 = time.perf_counter()
    reference = embedding.reference_tones(vae, frames)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    reference_s = time.perf_counter() - t0

    def pool() -> np.ndarray:
        return embedding.keyframe_features(latents, num_frames=frames, temporal_ratio=4, reference=reference)

    features = pool()
    motion_s = _median_s(lambda: motion.analyse(decoded), args.runs, device)
    pool_s = _median_s(pool, args.runs, device)
    project_s = _median_s(lambda: embedding.embed(features), args.runs, device)
    tracemalloc.start()
    motion.analyse(decoded)
    embedding.embed(features)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    step_s = motion_s + pool_s + project_s
    report: dict[str, Any] = {
        "shape": args.shape,
        "vae": args.vae,
        "motion_s": round(motion_s, 4),
        "pool_s": round(pool_s, 5),
        "project_s": round(project_s, 5),
        "step_s": round(step_s, 4),
        "reference_once_s": round(reference_s, 3),
        "host_peak_mib": round(peak / 2**20, 1),
        "process_max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "decoded_frames_mib": round(decoded.nbytes / 2**20, 1),
    }
    if args.render:
        report |= render_baseline(args, device, step_s)
    return report


def render_baseline(args: argparse.Namespace, device: torch.device, step_s: float) -> dict[str, Any]:
    """One plain (eager) render of wan2.1-1.3b-arch at the shape: the time the context step is measured against."""
    from shared.render.pipeline import VideoPipeline
    from shared.render.registry import WAN21_13B_ARCH, build_pipeline
    from shared.render.tiers import eager_policy
    from shared.spec import GenerationSpec, parse_shape

    height, width, frames = parse_shape(args.shape)
    dtype = torch.bfloat16
    pipe = build_pipeline(WAN21_13B_ARCH, device=device, dtype=dtype, text_encoder=False)
    pipeline = VideoPipeline(pipe, model=WAN21_13B_ARCH, device=device, dtype=dtype, policy=eager_policy())
    generator = torch.Generator(device="cpu").manual_seed(0)

    def rows(texts: list[str]) -> list[torch.Tensor]:
        return [torch.randn(24, 4096, generator=generator).to(device, dtype) for _ in texts]

    spec = GenerationSpec(
        model=WAN21_13B_ARCH,
        prompt="a fox in the snow",
        negative_prompt="blurry",
        width=width,
        height=height,
        num_frames=frames,
        fps=16,
        steps=args.steps,
        guidance_scale=5.0,
        seed=0,
    )
    pipeline.generate(spec, text_rows=rows)  # the first render: kernels and allocator
    t0 = time.perf_counter()
    result = pipeline.generate(spec, text_rows=rows)
    render_s = time.perf_counter() - t0
    described = result.keyframes is not None
    in_render = motion.analyse(result.frames)
    return {
        "render_s": round(render_s, 3),
        "render_steps": args.steps,
        "step_share_of_render": round(step_s / render_s, 5),
        "render_handed_keyframes": described,
        "render_keyframes_shape": list(result.keyframes.shape) if described else None,  # type: ignore[union-attr]
        "render_motion_label": in_render.label,
        "gpu_peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
    }


def machine(device: torch.device) -> dict[str, Any]:
    import cv2

    info: dict[str, Any] = {
        "device": str(device),
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "opencv": cv2.__version__,
        "threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# Context step — {report['machine'].get('gpu', 'cpu')}, {report['date']}", ""]
    lines += [f"Command: `{report['command']}`", "", f"Machine: `{json.dumps(report['machine'])}`", ""]
    if "quality" in report:
        q = report["quality"]
        lines += [
            f"## Copies found ({q['vae']} VAE, random weights; {q['clips']} clips of {q['clip']}, each among the "
            "others)",
            "",
            "| copy | mutual nearest | copy → its original | original → its copy | cos to copy (median) | "
            "cos to nearest other (median) |",
            "|---|---|---|---|---|---|",
        ]
        for name, row in q["copies"].items():
            lines.append(
                f"| {name} | {row['mutual_nearest']:.1%} | {row['copy_finds_original']:.1%} | "
                f"{row['original_finds_copy']:.1%} | {row['similarity_to_copy_median']} | "
                f"{row['similarity_to_nearest_other_median']} |"
            )
        lines.append("")
    if "labels" in report:
        lab = report["labels"]
        lines += [f"## Motion labels: {lab['accuracy']:.1%} of {lab['clips']} clips right", ""]
        lines += ["| motion | right |", "|---|---|"]
        lines += [f"| {name} | {share:.0%} |" for name, share in lab["per_motion"].items()]
        if lab["wrong"]:
            lines += ["", "Wrong: " + ", ".join(lab["wrong"])]
        lines.append("")
    if "cost" in report:
        c = report["cost"]
        lines += [f"## Cost per video at {c['shape']}", "", "| part | seconds |", "|---|---|"]
        for key in ("motion_s", "pool_s", "project_s", "step_s", "reference_once_s"):
            lines.append(f"| {key.removesuffix('_s')} | {c[key]} |")
        if "render_s" in c:
            lines += [
                f"| plain render ({c['render_steps']} steps, same run) | {c['render_s']} |",
                "",
                f"The context step is **{c['step_share_of_render']:.2%}** of the render's time. The render handed "
                f"over pooled keyframes {c['render_keyframes_shape']}; GPU peak {c['gpu_peak_gib']} GiB.",
            ]
        lines += [
            "",
            f"Host memory: {c['host_peak_mib']} MiB at the step's peak (tracemalloc) beside the decoded frames' "
            f"{c['decoded_frames_mib']} MiB the worker already holds; the process's max RSS "
            f"{c['process_max_rss_mib']} MiB.",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="quality,labels,cost")
    parser.add_argument("--vae", default="tiny-wan", choices=("tiny-wan", "wan2.1-1.3b-arch"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clips", type=int, default=1000, help="each clip is searched for among this many others")
    parser.add_argument("--clip-size", type=int, default=64)
    parser.add_argument("--clip-frames", type=int, default=17)
    parser.add_argument("--label-seeds", type=int, default=12)
    parser.add_argument("--shape", default="480x832x33")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--render", action="store_true", help="a plain wan2.1-1.3b-arch render as the denominator")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    device = torch.device(args.device)
    sections = set(args.sections.split(","))
    report: dict[str, Any] = {
        "date": dt.date.today().isoformat(),
        "command": "python -m benchmarks.context " + shlex.join(sys.argv[1:]),
        "machine": machine(device),
    }
    name = "h200" if device.type == "cuda" else "cpu"
    stem = args.out / f"context_{name}_{dt.date.today():%Y%m%d}{args.tag}"
    args.out.mkdir(parents=True, exist_ok=True)
    for section, run in (
        ("labels", lambda: labels(args)),
        ("cost", lambda: cost(args, device)),
        ("quality", lambda: quality(args, device)),
    ):
        if section in sections:
            report[section] = run()
            stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
            stem.with_suffix(".md").write_text(markdown(report))
            print(json.dumps({section: report[section]}), flush=True)
    print(markdown(report))


if __name__ == "__main__":
    main()
