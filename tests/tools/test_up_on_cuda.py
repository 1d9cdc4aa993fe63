"""``vidq up`` on a GPU machine, as a user runs it: embedded Postgres, Redis and S3, the prewarmer and the video
worker on CUDA, a real job submitted over REST. The worker's pool process is forked from a main process that never
touched CUDA, so it can initialise CUDA itself; the job renders in the exact tier, compiling its shape first (not
warmed up: logged), and its MP4 is in S3."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from benchmarks.gpu_cold_start import Stack, job_body, stack_env
from shared.render.tiers import ATTENTION_PREFERENCE
from shared.render.video import probe

pytestmark = pytest.mark.gpu

SHAPE = "240x416x17"  # small: the point is the path, not the speed (benchmarks/gpu_exact.py has the figures)


def test_vidq_up_renders_a_job_on_cuda_in_the_exact_tier(tmp_path: Path) -> None:
    stack = Stack(tmp_path / "state", stack_env([], tmp_path / "compile"))
    try:
        stack.start()
        job, _ = stack.render(job_body(SHAPE, seed=7, steps=6))
        video = httpx.get(job["output"]["url"], timeout=60).content if job["status"] == "succeeded" else b""
    finally:
        stack.stop()
    logs = {name: (tmp_path / "state" / "logs" / f"{name}.log").read_text() for name in ("worker", "prewarmer")}
    assert "Cannot re-initialize CUDA" not in logs["worker"]
    # One text encoder on the machine, the prewarmer's: the worker loads none of its own.
    assert '"text_encoder": "remote"' in logs["worker"]
    assert job["status"] == "succeeded", job
    timings = job["timings"]
    assert timings["device"].startswith("cuda")
    precision = timings["precision"]
    assert precision["tier"] == "exact" and precision["compute_dtype"] == "bfloat16"
    assert precision["policy"]["compile_blocks"] and precision["policy"]["cfg_batch"]
    assert precision["attention"] in ATTENTION_PREFERENCE
    assert "compiling the transformer blocks for a shape not warmed up" in logs["worker"]
    path = tmp_path / "out.mp4"
    path.write_bytes(video)
    info = probe(path)
    assert (info.codec, info.frames, info.width, info.height) == ("h264", 17, 416, 240)
    print(f"\nattention {precision['attention']}; render {timings['total']:.2f} s: {timings}")
