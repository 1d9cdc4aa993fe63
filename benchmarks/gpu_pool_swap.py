"""The VRAM pool's swap on a GPU: what bringing an evicted pipeline back from CPU RAM costs, against building it.

Two ``wan2.1-1.3b-arch`` pipelines (text encoder included) in a pool that holds one on the device
(``max_models=1``, a host budget for both): build A, build B (A goes to CPU RAM), then A again (back from CPU RAM,
B out), ``--swaps`` times. Reports the build time, the swap time (median), device memory after each step, and that
A renders the same frames before and after a round trip.

    python -m benchmarks.gpu_pool_swap --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from shared.render.architectures import WAN21_13B_ARCH
from shared.render.pipeline import VideoPipeline
from shared.render.pool import PipelinePool, PoolPolicy, device_bytes
from shared.render.registry import build_pipeline
from shared.render.text import encoder_identity
from shared.spec import GenerationSpec

GIB = 1024**3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--swaps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA device", file=sys.stderr)
        return 2
    device, dtype = torch.device("cuda"), torch.bfloat16
    builds: list[float] = []

    def build(name: str) -> VideoPipeline:
        started = time.perf_counter()
        pipe = build_pipeline(WAN21_13B_ARCH, device=device, dtype=dtype)
        torch.cuda.synchronize()
        builds.append(time.perf_counter() - started)
        identity = encoder_identity(WAN21_13B_ARCH, dtype=dtype)  # "a" and "b" are pool keys, not model names
        return VideoPipeline(pipe, model=name, device=device, dtype=dtype, identity=identity)

    spec = GenerationSpec(
        model=WAN21_13B_ARCH,
        prompt="a red fox in the snow",
        negative_prompt="",
        width=480,
        height=272,
        num_frames=9,
        fps=16,
        steps=2,
        guidance_scale=5.0,
        seed=0,
    )
    pool = PipelinePool(PoolPolicy(max_models=1, host_budget_bytes=64 * GIB))
    a = pool.get("a", lambda: build("a"))
    before = a.generate(spec).frames
    size = device_bytes(a)
    pool.get("b", lambda: build("b"))
    swaps = []
    memory = []
    for i in range(args.swaps):
        name = "a" if i % 2 == 0 else "b"
        torch.cuda.synchronize()
        started = time.perf_counter()
        pool.get(name, lambda name=name: build(name))
        torch.cuda.synchronize()
        swaps.append(time.perf_counter() - started)
        memory.append(round(torch.cuda.memory_allocated() / GIB, 2))
    after = pool.get("a", lambda: build("a")).generate(spec).frames
    report = {
        "command": " ".join([sys.executable, "-m", "benchmarks.gpu_pool_swap", *(argv or sys.argv[1:])]),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "date": dt.date.today().isoformat(),
        "pipeline_device_gib": round(size / GIB, 2),
        "build_s": [round(b, 2) for b in builds],
        "swap_s": [round(s, 2) for s in swaps],
        "swap_median_s": round(statistics.median(swaps), 2),
        "allocated_after_each_swap_gib": memory,
        "builds": len(builds),
        "same_frames_after_round_trip": bool(np.array_equal(before, after)),
        "state": [(k, loc, round(b / GIB, 2)) for k, loc, b in pool.state()],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"gpu_pool_swap_h200_{dt.date.today():%Y%m%d}.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
