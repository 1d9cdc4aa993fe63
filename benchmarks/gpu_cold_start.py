"""A worker's cold start on a GPU box, through the whole stack as a user runs it: ``vidq up`` (embedded Postgres,
Redis and S3, the API, the prewarmer, the video worker on CUDA), jobs submitted over REST.

Two starts of the stack share one compile cache directory (``VIDQ_WORKER_COMPILE_CACHE_DIR``): the first finds it
empty (the worker compiles its warm-up shape), the second finds what the first left (it loads the kernels). For each
start: the worker's start → ready (its log's first line → "pipeline loaded", the warm-up included) and the stack's,
then ``--jobs`` jobs of the warmed shape one after another: the first job's render against the next ones' (a warmed
shape should cost the first job nothing extra). Writes ``gpu_cold_start_<gpu>_<date>.json`` and ``.md``.

    python -m benchmarks.gpu_cold_start [--shape 480x832x33] [--jobs 2] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.stack import MODEL, Stack, gpu_slug, job_body, stack_env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="480x832x33")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--model", default=MODEL, help="tiny-wan with --device cpu: a rehearsal")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    root = Path(tempfile.mkdtemp(prefix="vidq-cold-"))
    cache = root / "compile"
    report: dict[str, Any] = {
        "benchmark": "gpu_cold_start",
        "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(sys.orig_argv),
        "gpu": gpu,
        "torch": torch.__version__,
        "shape": args.shape,
        "steps": args.steps,
        "model": args.model,
        "device": args.device,
        "starts": [],
    }
    for start, label in enumerate(("empty compile cache", "warm compile cache")):
        stack = Stack(root / f"state{start}", stack_env([args.shape], cache, model=args.model, device=args.device))
        entry: dict[str, Any] = {"cache": label}
        try:
            entry["stack_start_to_worker_ready_s"] = stack.start()
            entry |= stack.worker_log_seconds(stack.worker_start)
            jobs = []
            for seed in range(args.jobs):
                job, wall = stack.render(job_body(args.shape, seed, steps=args.steps, model=args.model))
                timings = job.get("timings") or {}
                jobs.append(
                    {
                        "status": job["status"],
                        "submit_to_end_s": wall,
                        **{
                            k: timings.get(k) for k in ("encode_text", "denoise", "decode", "total", "encode", "upload")
                        },
                        "device": timings.get("device"),
                        "precision": timings.get("precision"),
                    }
                )
                print(f"{label}: job {seed + 1} {job['status']} in {wall:.2f} s (render {timings.get('total')})")
            entry["jobs"] = jobs
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"[:3000]
            print(entry["error"], file=sys.stderr)
        finally:
            stack.stop()
        report["starts"].append(entry)
        write(report, args.out)
    print((args.out / f"{stem(report)}.md").read_text())
    return 0 if all("error" not in s for s in report["starts"]) else 1


def stem(report: dict[str, Any]) -> str:
    return f"gpu_cold_start_{gpu_slug(report['gpu'])}_{dt.date.today():%Y%m%d}"


def write(report: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem(report)}.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"# gpu_cold_start: {report['gpu']}, {report['date_utc']}",
        "",
        f"`{report['command']}`",
        "",
        f"`vidq up` with the video worker on {report['device']} ({report['model']}, warm-up shape "
        f"{report['shape']}, exact tier), jobs of that shape ({report['steps']} steps, guidance 5) over REST, one "
        f"after another; torch {report['torch']}.",
        "",
        "| compile cache | worker start → ready s | warm-up s | stack start → worker ready s "
        "| job renders s (first, then the rest) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for s in report["starts"]:
        if "error" in s:
            lines.append(f"| {s['cache']} | error: {s['error'][:200]} | | | |")
            continue
        renders = ", ".join(f"{j['total']:.3f}" if j.get("total") else j["status"] for j in s.get("jobs", []))
        lines.append(
            f"| {s['cache']} | {s['worker_start_to_ready_s']:.1f} | {s['warm_up_s']:.1f} | "
            f"{s['stack_start_to_worker_ready_s']:.1f} | {renders} |"
        )
    (out / f"{stem(report)}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
