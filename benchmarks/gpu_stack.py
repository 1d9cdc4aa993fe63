"""The whole service on a GPU box against a plain diffusers loop: videos per minute, how busy the GPU stays, how
good the ETA quotes are, in one run on one machine.

Sections, in this order (``--sections`` picks; calibration and batch start the stack):

1. start: ``vidq up`` (embedded Postgres, Redis and S3 of its own, the API, the prewarmer with the machine's one text
   encoder, the video worker in the exact tier, the webhook worker) with the compile cache ``--compile-cache`` (the
   run on the GPU passes one an earlier run filled: whether it was warm is reported) and the batch's shape as the
   warm-up shape: seconds from the start to the worker's "pipeline loaded", and the worker process's own start →
   ready from its log.
2. calibration: ``--calibration`` jobs of the shape, one at a time: the render costs the ETA quotes stand on. Not
   in the throughput.
3. batch: ``--jobs`` jobs (distinct prompts and seeds, ``cache: false``, a webhook each to a receiver this process
   runs) submitted at once, polled until all are final. Videos per minute = succeeded jobs / (last finished_at −
   first submit). The GPU's busy share two ways: NVML samples every 100 ms over that window (share of samples with
   utilization > 0, mean utilization, peak memory, memory per process), and the worker's own "render timeline" log
   lines (the union of the renders' device intervals over the first render start → last render end, and the gaps
   between renders). ETA quotes (the submit's ``estimate``) against what happened; each stage's median from the jobs'
   ``timings``; every webhook delivered; every MP4 fetched from its presigned URL and checked (an ``ftyp`` box).
4. plain: the stack stopped (Ctrl-C), the same jobs (prompts, seeds, shape, steps, guidance; ``--plain-jobs`` fewer)
   as a user's loop of ``WanPipeline.__call__`` (text encoder of its own, VAE in float32) and
   ``diffusers.utils.export_to_video`` in this process, after one untimed warm-up call; NVML over the loop too.

The report: stack / plain videos per minute (target ≥ 2.0×, moonshot 2.5×), busy share (target ≥ 95%), and the rest
above. ``gpu_stack_<gpu>_<date><tag>.json`` and ``.md`` go to ``--out``, rewritten after every section (and during
the long ones), so a run cut short still leaves its figures.

    python -m benchmarks.gpu_stack --compile-cache /tmp/vidq-compile --out benchmarks/results
    python -m benchmarks.gpu_stack --model tiny-wan --device cpu --shape 64x64x9 --steps 2 --jobs 5   # a rehearsal
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import importlib.metadata
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from benchmarks.stack import FINAL, MODEL, Stack, gpu_slug, job_body, stack_env
from shared.spec import parse_shape
from tools.processes import free_ports

ROOT = Path(__file__).resolve().parent.parent
NEGATIVE = "blurry, static, overexposed, worst quality, low quality, ugly, deformed, subtitles"
SUBJECTS = [
    "a red fox running through fresh snow",
    "an old fishing boat rocking in a harbour",
    "a hot air balloon drifting over vineyards",
    "a black cat walking along a garden wall",
    "a vintage tram climbing a steep street",
    "a hummingbird hovering at a flower",
    "waves breaking against a lighthouse",
    "a paper kite dancing in the wind",
    "a herd of horses crossing a river",
    "a steam locomotive leaving a station",
    "a jellyfish pulsing in dark water",
    "a snowboarder carving down a slope",
    "a windmill turning above tulip fields",
]
PLACES = [
    "at sunrise",
    "in heavy rain",
    "under neon lights",
    "in a snowstorm",
    "at golden hour",
    "on a foggy morning",
    "under a full moon",
    "in late autumn",
    "on a hot summer afternoon",
    "during a thunderstorm",
    "at dusk",
]
GIB = 1024**3
TARGET_RATIO, MOONSHOT_RATIO, TARGET_BUSY = 2.0, 2.5, 0.95
SECTIONS = ("start", "calibration", "batch", "plain")


def prompt(i: int) -> str:
    """The i-th job's prompt: all distinct (so no text-embedding cache answers one job with another's)."""
    combos = len(SUBJECTS) * len(PLACES)  # coprime lengths: i → (i mod 13, i mod 11) is one-to-one below 143
    take = f", take {i // combos + 1}" if i >= combos else ""
    return f"{SUBJECTS[i % len(SUBJECTS)]} {PLACES[i % len(PLACES)]}, cinematic, detailed{take}"


def calibration_prompt(i: int) -> str:
    return f"{prompt(i)}, calibration"


def seed(i: int) -> int:
    return 1000 + i


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=MODEL, help="tiny-wan with --device cpu: a rehearsal")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="480x832x33", help="HEIGHTxWIDTHxFRAMES")
    parser.add_argument("--jobs", type=int, default=20, help="jobs in the batch")
    parser.add_argument("--plain-jobs", type=int, default=None, help="videos of the plain loop (default: --jobs)")
    parser.add_argument("--calibration", type=int, default=2, help="jobs rendered one at a time before the batch")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=5.0)
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    parser.add_argument("--compile-cache", type=Path, default=None, help="default: a folder under the state dir")
    parser.add_argument(
        "--batch-table",
        default="",
        help="VIDQ_WORKER_BATCH_TABLE: a table's path, or auto (the one vidq ships for this GPU); empty (the default): "
        "every job renders alone",
    )
    parser.add_argument(
        "--extra-env", action="append", default=[], metavar="K=V", help="more environment for the stack (repeatable)"
    )
    parser.add_argument(
        "--reuse-services",
        action="store_true",
        help="let `vidq up` use the Postgres and Redis of the settings when they answer (default: embedded ones of "
        "its own, as on a bare GPU box)",
    )
    parser.add_argument("--state-dir", type=Path, default=None, help="default: a new temporary folder")
    parser.add_argument("--start-timeout-s", type=float, default=300.0)
    parser.add_argument("--batch-timeout-s", type=float, default=360.0, help="from the first submit to all final")
    parser.add_argument(
        "--budget-s", type=float, default=540.0, help="no timed plain video starts past this (since the start)"
    )
    parser.add_argument("--tag", default="", help="appended to the results' file names")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    parse_shape(args.shape)
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections: {', '.join(sorted(unknown))}")
    for item in args.extra_env:
        if "=" not in item:
            parser.error(f"--extra-env wants K=V, not {item!r}")
    return args


# --- measuring instruments ---------------------------------------------------------------------------------------


class GpuSampler:
    """NVML, every ``interval_s`` on a thread of its own: the GPU's utilization and memory used, and every ~1 s
    the memory each process holds on it. Unavailable (no pynvml, no driver, no GPU) it records why and nothing
    else."""

    def __init__(self, index: int, *, interval_s: float = 0.1) -> None:
        self.interval_s = interval_s
        self.samples: list[tuple[float, int, int]] = []  # (unix s, utilization %, memory used bytes)
        self.process_peak: dict[int, int] = {}  # pid → most GPU memory seen held, bytes
        self.process_error = ""
        self.unavailable = ""
        self.name = ""
        self.driver = ""
        self.total_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml: Any = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(self.handle)
            self.name = name.decode() if isinstance(name, bytes) else str(name)
            driver = pynvml.nvmlSystemGetDriverVersion()
            self.driver = driver.decode() if isinstance(driver, bytes) else str(driver)
            self.total_bytes = int(pynvml.nvmlDeviceGetMemoryInfo(self.handle).total)
        except Exception as exc:  # ImportError, NVMLError (no library, no driver, no such GPU)
            self.unavailable = f"{type(exc).__name__}: {exc}"[:300]

    def start(self) -> None:
        if not self.unavailable and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        nvml, tick = self.nvml, 0
        next_at = time.monotonic()
        while not self._stop.is_set():
            try:
                util = nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu
                used = nvml.nvmlDeviceGetMemoryInfo(self.handle).used
                self.samples.append((time.time(), int(util), int(used)))
                if tick % 10 == 0 and not self.process_error:
                    self._processes()
            except Exception as exc:  # a sample lost is a sample lost; the run goes on
                self.process_error = self.process_error or f"sampling: {type(exc).__name__}: {exc}"[:300]
            tick += 1
            next_at += self.interval_s
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def _processes(self) -> None:
        try:
            for p in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle):
                used = getattr(p, "usedGpuMemory", None)
                if used is not None:
                    self.process_peak[int(p.pid)] = max(self.process_peak.get(int(p.pid), 0), int(used))
        except Exception as exc:
            self.process_error = f"nvmlDeviceGetComputeRunningProcesses: {type(exc).__name__}: {exc}"[:300]

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        """Utilization and memory over [t0, t1] (unix seconds)."""
        if self.unavailable:
            return {"available": False, "why": self.unavailable}
        inside = [s for s in list(self.samples) if t0 <= s[0] <= t1]
        if not inside:
            return {"available": True, "samples": 0}
        return {
            "available": True,
            "samples": len(inside),
            "busy_share": sum(1 for s in inside if s[1] > 0) / len(inside),
            "mean_utilization": statistics.mean(s[1] for s in inside) / 100,
            "peak_memory_gib": max(s[2] for s in inside) / GIB,
        }


class WebhookReceiver:
    """A tiny HTTP server on 127.0.0.1 that takes the stack's webhooks: each delivery's job id, event type and
    arrival time. Answers 204 to every POST."""

    def __init__(self) -> None:
        self.deliveries: list[dict[str, Any]] = []
        lock = threading.Lock()
        deliveries = self.deliveries

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    event = json.loads(body)
                    job_id, kind = str((event.get("data") or {}).get("id")), str(event.get("type"))
                except ValueError:
                    job_id, kind = "", "unreadable"
                with lock:
                    deliveries.append({"job_id": job_id, "type": kind, "at": time.time()})
                self.send_response(204)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, name="webhooks", daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks"

    def job_ids(self) -> set[str]:
        return {d["job_id"] for d in list(self.deliveries)}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# --- the figures -------------------------------------------------------------------------------------------------


def when(text: str) -> float:
    """A job body's timestamp (ISO 8601, ``Z`` or an offset) as unix seconds."""
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def timeline(worker_log: Path, job_ids: set[str]) -> dict[str, Any]:
    """The batch's renders from the worker's "render timeline" lines (one per render: ``job_ids``, ``started_unix``,
    ``ended_unix``): the union of their intervals over the first start → last end, and the gaps between them."""
    renders = []
    for line in worker_log.read_text(errors="replace").splitlines() if worker_log.exists() else []:
        if '"render timeline"' not in line:
            continue
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if entry.get("msg") == "render timeline" and job_ids & set(entry.get("job_ids") or []):
                renders.append((float(entry["started_unix"]), float(entry["ended_unix"]), len(entry["job_ids"])))
    if not renders:
        return {"renders": 0, "why": 'no timeline (no "render timeline" line names a batch job)'}
    renders.sort()
    covered, gaps = 0.0, []
    start, end = renders[0][0], renders[0][1]
    for s, e, _ in renders[1:]:
        if s > end:
            covered += end - start
            gaps.append(s - end)
            start, end = s, e
        else:
            gaps.append(0.0)
            end = max(end, e)
    covered += end - start
    window = max(e for _, e, _ in renders) - renders[0][0]
    return {
        "renders": len(renders),
        "jobs_in_renders": sum(n for _, _, n in renders),
        "window_s": window,
        "covered_s": covered,
        "busy_share": covered / window if window > 0 else None,
        "largest_gap_s": max(gaps, default=0.0),
        "median_gap_s": statistics.median(gaps) if gaps else 0.0,
        "first_start_unix": renders[0][0],
        "last_end_unix": max(e for _, e, _ in renders),
    }


def eta_accuracy(jobs: list[dict[str, Any]], quotes: dict[str, dict[str, Any] | None]) -> dict[str, Any]:
    """Each finished job's quote at submit against what happened: error = |actual − quoted| / actual, both from the
    job's created_at; a start error only for jobs that waited (started > 0.5 s after their creation)."""
    finish, start, unquoted, started_at_once = [], [], 0, 0
    for job in jobs:
        if job.get("status") != "succeeded" or not job.get("finished_at"):
            continue
        quote = quotes.get(job["id"])
        if not quote:
            unquoted += 1
            continue
        created = when(job["created_at"])
        actual = when(job["finished_at"]) - created
        finish.append(abs(actual - (when(quote["finish_at"]) - created)) / actual)
        waited = when(job["started_at"]) - created if job.get("started_at") else 0.0
        if waited > 0.5:
            start.append(abs(waited - (when(quote["start_at"]) - created)) / waited)
        else:
            started_at_once += 1
    return {
        "finish_error": {"p50": pct(finish, 0.5), "p90": pct(finish, 0.9), "n": len(finish)},
        "start_error": {"p50": pct(start, 0.5), "p90": pct(start, 0.9), "n": len(start)},
        "unquoted": unquoted,
        "started_at_once": started_at_once,
    }


STAGES = ("encode_text", "denoise", "decode", "total", "encode", "upload", "worker")


def stage_medians(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median seconds of every stage the jobs' ``timings`` hold, and what rendered them (tier, attention,
    memory mode, device), counted."""
    timings = [j.get("timings") or {} for j in jobs if j.get("status") == "succeeded"]
    numeric = sorted(
        {k for t in timings for k, v in t.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        - {"peak_vram_bytes"}
    )
    medians = {k: statistics.median(t[k] for t in timings if isinstance(t.get(k), int | float)) for k in numeric}
    peaks = [t["peak_vram_bytes"] / GIB for t in timings if isinstance(t.get("peak_vram_bytes"), int | float)]
    what: dict[str, dict[str, int]] = {}
    for t in timings:
        precision = t.get("precision") or {}
        for name, value in (
            ("tier", precision.get("tier")),
            ("attention", precision.get("attention")),
            ("memory_mode", t.get("memory_mode")),
            ("device", t.get("device")),
            ("dtype", t.get("dtype")),
        ):
            counts = what.setdefault(name, {})
            counts[str(value)] = counts.get(str(value), 0) + 1
    return {
        "median_s": medians,
        "peak_vram_gib_median": statistics.median(peaks) if peaks else None,
        "rendered_by": what,
    }


def is_mp4(data: bytes) -> bool:
    """Whether ``data`` starts as an MP4 does: a box whose type is ``ftyp``."""
    return len(data) >= 8 and data[4:8] == b"ftyp"


def machine(sampler: GpuSampler, device: str) -> dict[str, Any]:
    """What ran it, without importing torch (a CUDA context in this process would show in the stack's memory)."""
    info: dict[str, Any] = {
        "device": device,
        "gpu": sampler.name or ("cpu" if device == "cpu" else "unknown"),
        "driver": sampler.driver or None,
        "gpu_memory_gib": round(sampler.total_bytes / GIB, 1) if sampler.total_bytes else None,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
    }
    for package in ("torch", "diffusers", "transformers", "nvidia-ml-py"):
        try:
            info[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            info[package] = None
    return info


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() + (" (uncommitted changes)" if dirty.stdout.strip() else "")


# --- the run -----------------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t0 = time.monotonic()
        self.sections = set(args.sections.split(","))
        self.root = args.state_dir or Path(tempfile.mkdtemp(prefix="vidq-gpu-stack-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self.cache_dir: Path = args.compile_cache or self.root / "compile"
        index = int(args.device.split(":", 1)[1]) if args.device.startswith("cuda:") else 0
        self.sampler = GpuSampler(index)
        self.labels: dict[int, str] = {os.getpid(): "gpu_stack (this process: the plain loop)"}
        self.plain_jobs = min(args.plain_jobs or args.jobs, args.jobs)
        self.stack: Stack | None = None
        height, width, frames = parse_shape(args.shape)
        self.report: dict[str, Any] = {
            "benchmark": "gpu_stack",
            "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "command": shlex.join(sys.orig_argv),
            "git_commit": git_commit(),
            "machine": machine(self.sampler, args.device),
            "model": args.model,
            "device": args.device,
            "shape": args.shape,
            "height": height,
            "width": width,
            "frames": frames,
            "steps": args.steps,
            "guidance_scale": args.guidance,
            "jobs": args.jobs,
            "plain_jobs": self.plain_jobs,
            "sections": sorted(self.sections, key=SECTIONS.index),
            "state_dir": str(self.root),
            "nvml": {"available": not self.sampler.unavailable, "why": self.sampler.unavailable or None},
            "errors": [],
        }
        self.stem = f"gpu_stack_{gpu_slug(self.report['machine']['gpu'])}_{dt.date.today():%Y%m%d}{args.tag}"
        self._last_write = 0.0

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def fail(self, section: str, exc: BaseException) -> None:
        traceback.print_exc()
        self.report["errors"].append({"section": section, "error": f"{type(exc).__name__}: {exc}"[:3000]})

    def write(self, *, every_s: float = 0.0) -> None:
        """The JSON and the Markdown, as they stand (at most once per ``every_s``)."""
        if every_s and time.monotonic() - self._last_write < every_s:
            return
        self._last_write = time.monotonic()
        self.report["elapsed_s"] = self.elapsed()
        self.report["summary"] = summary(self.report)
        out: Path = self.args.out
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{self.stem}.json").write_text(json.dumps(self.report, indent=2, default=str) + "\n")
        (out / f"{self.stem}.md").write_text(markdown(self.report))

    # --- the stack ---------------------------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        args = self.args
        env = stack_env([args.shape], self.cache_dir, model=args.model, device=args.device) | {
            "VIDQ_WORKER_PRECISION": "exact",
            "VIDQ_WORKER_BATCH_TABLE": args.batch_table,
            "VIDQ_WEBHOOK_ALLOW_PRIVATE": "true",  # the receiver is on 127.0.0.1
            "VIDQ_WORKER_METRICS_PORT": "0",
            "VIDQ_PREWARMER_METRICS_PORT": "0",
        }
        if not args.reuse_services:  # nobody answers there: `vidq up` starts embedded ones of its own
            pg, redis = free_ports(2)
            env["VIDQ_DATABASE_URL"] = f"postgresql+psycopg://postgres@127.0.0.1:{pg}/vidq"
            env["VIDQ_BROKER_URL"] = f"redis://127.0.0.1:{redis}/0"
        env |= dict(item.split("=", 1) for item in args.extra_env)
        return env

    def start(self) -> None:
        env = self.env()
        files = [p for p in self.cache_dir.rglob("*") if p.is_file()] if self.cache_dir.exists() else []
        entry: dict[str, Any] = {
            "env": {k: v for k, v in env.items() if k.startswith("VIDQ_") and "URL" not in k},
            "extra_env": self.args.extra_env,
            "compile_cache": {
                "dir": str(self.cache_dir),
                "files_before": len(files),
                "bytes_before": sum(p.stat().st_size for p in files),
            },
        }
        self.report["start"] = entry
        self.stack = Stack(self.root / "state", env)
        self.sampler.start()
        entry["stack_start_to_worker_loaded_s"] = self.stack.start(timeout_s=self.args.start_timeout_s)
        entry["stack_start_to_up_s"] = self.stack.up_s
        entry |= self.stack.worker_log_seconds(self.stack.worker_start)
        log = self.stack.worker_log.read_text(errors="replace")
        entry["compile_cache"]["worker_loaded_archive"] = '"compile cache loaded"' in log
        entry["compile_cache"]["warm"] = entry["compile_cache"]["files_before"] > 0
        self.labels |= self.stack.processes()
        print(
            f"start: worker loaded {entry['stack_start_to_worker_loaded_s']:.1f} s after `vidq up` (its process: "
            f"{entry['worker_start_to_ready_s']:.1f} s, warm-up {entry['warm_up_s']:.1f} s); compile cache "
            f"{'warm' if entry['compile_cache']['warm'] else 'empty'}",
            flush=True,
        )

    def body(self, i: int, *, text: str, webhook: str | None = None) -> dict[str, Any]:
        body = job_body(self.args.shape, seed(i), steps=self.args.steps, model=self.args.model)
        body |= {"prompt": text, "negative_prompt": NEGATIVE, "guidance_scale": self.args.guidance}
        if webhook:
            body["webhook_url"] = webhook
        return body

    def calibration(self) -> None:
        assert self.stack is not None
        jobs: list[dict[str, Any]] = []
        self.report["calibration"] = {"jobs": jobs}
        for k in range(self.args.calibration):
            job, wall = self.stack.render(self.body(10_000 + k, text=calibration_prompt(k)), timeout_s=120)
            timings = job.get("timings") or {}
            jobs.append({"status": job["status"], "submit_to_end_s": wall, "worker_s": timings.get("worker")})
            print(f"calibration {k + 1}: {job['status']} in {wall:.2f} s (worker {timings.get('worker')})", flush=True)
            if job["status"] != "succeeded":
                raise RuntimeError(f"calibration job failed: {json.dumps(job.get('error'))[:1000]}")
        time.sleep(1.5)  # the API's quotes read the measured costs every VIDQ_ETA_REFRESH_S (1 s)

    def batch(self) -> None:
        assert self.stack is not None
        stack, args = self.stack, self.args
        entry: dict[str, Any] = {}
        self.report["batch"] = entry
        hooks = WebhookReceiver()
        try:
            bodies = [self.body(i, text=prompt(i), webhook=hooks.url) for i in range(args.jobs)]
            first_submit = time.time()
            answers = asyncio.run(submit_all(stack.api, stack.headers, bodies))
            entry["first_submit_unix"] = first_submit
            entry["submits_answered_s"] = max(a["answered"] for a in answers) - first_submit
            entry["submit_retries"] = sum(a["retries"] for a in answers)
            refused = [a for a in answers if a["status"] != 202]
            entry["refused"] = [{"status": a["status"], "body": str(a["body"])[:300]} for a in refused]
            quotes = {a["body"]["id"]: a["body"].get("estimate") for a in answers if a["status"] == 202}
            ids = list(quotes)
            entry["accepted"] = len(ids)
            print(f"batch: {len(ids)} of {args.jobs} jobs accepted in {entry['submits_answered_s']:.2f} s", flush=True)
            done = self.wait_final(ids, first_submit, entry)
            self.labels |= stack.processes()
            jobs = [done[i] for i in ids]
            succeeded = [j for j in jobs if j["status"] == "succeeded"]
            last_finish = max((when(j["finished_at"]) for j in jobs if j.get("finished_at")), default=time.time())
            window = last_finish - first_submit
            entry |= {
                "succeeded": len(succeeded),
                "statuses": {s: sum(1 for j in jobs if j["status"] == s) for s in sorted({j["status"] for j in jobs})},
                "last_finish_unix": last_finish,
                "window_s": window,
                "videos_per_minute": 60 * len(succeeded) / window if window > 0 else None,
                "nvml": self.sampler.window(first_submit, last_finish),
            }
            print(f"batch: {len(succeeded)} succeeded in {window:.2f} s", flush=True)
            self.write()
            entry["timeline"] = timeline(stack.worker_log, set(ids))
            entry["eta"] = eta_accuracy(jobs, quotes)
            entry["stages"] = stage_medians(jobs)
            failed = [j for j in jobs if j["status"] != "succeeded"]
            entry["failures"] = [{"id": j["id"], "status": j["status"], "error": j.get("error")} for j in failed[:5]]
            entry["mp4"] = verify_mp4s(succeeded)
            entry["webhooks"] = self.wait_webhooks(hooks, {j["id"] for j in jobs if j["status"] in FINAL})
            entry["detail"] = [job_row(j, quotes.get(j["id"]), entry["mp4"]["ok_ids"]) for j in jobs]
            entry["mp4"].pop("ok_ids")
        finally:
            hooks.close()

    def wait_final(self, ids: list[str], first_submit: float, entry: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Poll every job still open every 0.5 s until all are final (or the batch's timeout: then as they are)."""
        assert self.stack is not None
        done: dict[str, dict[str, Any]] = {}
        last: dict[str, dict[str, Any]] = {}
        deadline = first_submit + self.args.batch_timeout_s
        with httpx.Client(base_url=self.stack.api, headers=self.stack.headers, timeout=10) as http:
            while len(done) < len(ids):
                for job_id in ids:
                    if job_id in done:
                        continue
                    with contextlib.suppress(httpx.HTTPError, ValueError):
                        job = http.get(f"/v1/jobs/{job_id}").raise_for_status().json()
                        last[job_id] = job
                        if job["status"] in FINAL:
                            done[job_id] = job
                entry["final_so_far"] = len(done)
                self.write(every_s=10)
                if time.time() > deadline:
                    entry["timed_out"] = f"{len(ids) - len(done)} jobs not final {self.args.batch_timeout_s:.0f} s in"
                    break
                if len(done) < len(ids):
                    time.sleep(0.5)
        entry.pop("final_so_far", None)
        return {job_id: done.get(job_id) or last.get(job_id) or {"id": job_id, "status": "unknown"} for job_id in ids}

    def wait_webhooks(self, hooks: WebhookReceiver, expected: set[str], *, timeout_s: float = 15.0) -> dict[str, Any]:
        """Every finished job's webhook, waited for up to ``timeout_s`` after the last job ended."""
        deadline = time.monotonic() + timeout_s
        while not expected <= hooks.job_ids() and time.monotonic() < deadline:
            time.sleep(0.2)
        got = hooks.job_ids()
        return {
            "expected": len(expected),
            "delivered": len(expected & got),
            "deliveries": len(hooks.deliveries),
            "missing": sorted(expected - got)[:10],
            "types": sorted({d["type"] for d in hooks.deliveries}),
        }

    def stop(self) -> None:
        if self.stack is None:
            return
        started = time.monotonic()
        self.labels |= self.stack.processes()
        self.stack.stop(wait_s=60)
        self.report.setdefault("start", {})["stop_s"] = time.monotonic() - started
        self.report["stack_nvml"] = {
            **self.sampler.window(self.stack.started_unix, time.time()),
            "per_process": self.per_process(),
        }
        self.stack = None

    def per_process(self) -> list[dict[str, Any]] | str:
        """The GPU memory each process held at most since the last call (NVML's per-process figures), named."""
        if self.sampler.unavailable:
            return "NVML unavailable"
        peaks, self.sampler.process_peak = self.sampler.process_peak, {}
        if self.sampler.process_error and not peaks:
            return self.sampler.process_error
        return [
            {"pid": pid, "process": self.labels.get(pid, "not seen under vidq up"), "peak_gib": used / GIB}
            for pid, used in sorted(peaks.items(), key=lambda kv: -kv[1])
        ]

    # --- the plain loop ----------------------------------------------------------------------------------------

    def plain(self) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # an offline box: nothing may wait on the hub
        import diffusers
        import torch
        import transformers
        from diffusers.utils import export_to_video
        from diffusers.utils.export_utils import _legacy_export_to_video
        from diffusers.utils.import_utils import is_imageio_available

        from shared.render.precision import dtype_name, resolve_device
        from shared.render.registry import build_pipeline

        args = self.args
        entry: dict[str, Any] = {"videos": []}
        self.report["plain"] = entry
        self.sampler.start()
        device, dtype = resolve_device(args.device, cuda_dtype="bfloat16")
        self.report["machine"] |= {
            "torch": torch.__version__,
            "diffusers": diffusers.__version__,
            "transformers": transformers.__version__,
            "cuda": torch.version.cuda,
        }
        entry["dtype"] = dtype_name(dtype)
        if device.type == "cuda" and self.report["machine"]["gpu"] == "unknown":
            self.report["machine"]["gpu"] = torch.cuda.get_device_name(device)

        def sync() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        started = time.perf_counter()
        pipe: Any = build_pipeline(args.model, device=device, dtype=dtype)  # its own text encoder, VAE float32
        pipe.set_progress_bar_config(disable=True)
        sync()
        entry["build_s"] = time.perf_counter() - started
        height, width, frames = parse_shape(args.shape)
        folder = self.root / "plain"
        folder.mkdir(exist_ok=True)
        writer: list[str] = []

        def render(i: int, text: str, path: Path) -> tuple[float, float]:
            t = time.perf_counter()
            video = pipe(
                prompt=text,
                negative_prompt=NEGATIVE,
                height=height,
                width=width,
                num_frames=frames,
                num_inference_steps=args.steps,
                guidance_scale=args.guidance,
                generator=torch.Generator(device=device).manual_seed(seed(i)),
                output_type="np",
            ).frames[0]
            sync()
            rendered = time.perf_counter()
            try:
                export_to_video(video, str(path), fps=16)
                if not writer:
                    writer.append("imageio-ffmpeg" if is_imageio_available() else "OpenCV mp4v (no imageio)")
                    diffusers.utils.logging.set_verbosity_error()  # its fallback warning once, not once a video
            except (AttributeError, ImportError) as exc:  # imageio without an ffmpeg: what a plain user then does
                _legacy_export_to_video(video, str(path), fps=16)
                if not writer:
                    writer.append(f"OpenCV mp4v (export_to_video: {type(exc).__name__}: {str(exc)[:120]})")
            return rendered - t, time.perf_counter() - rendered

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        warm = render(10_000, calibration_prompt(0), folder / "warm_up.mp4")
        entry["warm_up_s"] = sum(warm)
        entry["writer"] = writer[0] if writer else None
        print(f"plain: built in {entry['build_s']:.1f} s, warm-up {entry['warm_up_s']:.2f} s", flush=True)
        self.write()
        loop_start_unix, loop_start = time.time(), time.perf_counter()
        entry["loop_start_unix"] = loop_start_unix
        for i in range(self.plain_jobs):
            if entry["videos"] and self.elapsed() + max(v["s"] for v in entry["videos"]) > args.budget_s:
                entry["stopped"] = f"after {i} of {self.plain_jobs} videos: --budget-s {args.budget_s:.0f} reached"
                break
            path = folder / f"plain_{i:03d}.mp4"
            pipe_s, write_s = render(i, prompt(i), path)
            data = path.read_bytes() if path.exists() else b""
            entry["videos"].append(
                {
                    "i": i,
                    "s": pipe_s + write_s,
                    "pipe_s": pipe_s,
                    "write_s": write_s,
                    "bytes": len(data),
                    "mp4": is_mp4(data),
                }
            )
            loop_s = time.perf_counter() - loop_start
            entry |= {
                "done": len(entry["videos"]),
                "loop_s": loop_s,
                "videos_per_minute": 60 * len(entry["videos"]) / loop_s,
                "pipe_s_median": statistics.median(v["pipe_s"] for v in entry["videos"]),
                "write_s_median": statistics.median(v["write_s"] for v in entry["videos"]),
                "mp4_ok": sum(1 for v in entry["videos"] if v["mp4"]),
            }
            print(f"plain {i + 1}/{self.plain_jobs}: {pipe_s:.2f} s + write {write_s:.2f} s", flush=True)
            self.write(every_s=5)
        entry["nvml"] = self.sampler.window(loop_start_unix, time.time())
        if device.type == "cuda":
            entry["torch_peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        entry["per_process"] = self.per_process()

    # --- the whole run -----------------------------------------------------------------------------------------

    def section(self, name: str, fn: Callable[[], None]) -> bool:
        """Run one section; a failure is recorded (the run goes on where it can). The report is written after."""
        try:
            fn()
            return True
        except Exception as exc:
            self.fail(name, exc)
            return False
        except BaseException as exc:  # Ctrl-C, SIGTERM: recorded, then the run unwinds (the stack is stopped)
            self.fail(name, exc)
            raise
        finally:
            self.write()

    def run(self) -> None:
        if self.sections & {"start", "calibration", "batch"}:
            try:
                if self.section("start", self.start):
                    for name, fn in (("calibration", self.calibration), ("batch", self.batch)):
                        if name in self.sections:
                            self.section(name, fn)
            finally:  # a Ctrl-C too: nothing of the stack is left holding the GPU
                self.section("stop", self.stop)
        if "plain" in self.sections:
            self.section("plain", self.plain)
        self.sampler.stop()
        self.write()


async def submit_all(api: str, headers: dict[str, str], bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """POST every body at once (open loop: all in flight together). A 429 or 503 is sent again after its
    Retry-After (at most 2 s, 5 times), and counted."""
    limits = httpx.Limits(max_connections=len(bodies) + 4, max_keepalive_connections=len(bodies) + 4)
    async with httpx.AsyncClient(base_url=api, headers=headers, timeout=30, limits=limits) as http:

        async def one(body: dict[str, Any]) -> dict[str, Any]:
            retries = 0
            while True:
                response = await http.post("/v1/jobs", json=body)
                if response.status_code not in (429, 503) or retries >= 5:
                    break
                retries += 1
                with contextlib.suppress(ValueError):
                    await asyncio.sleep(min(2.0, float(response.headers.get("retry-after", "0.5"))))
            try:
                answer = response.json()
            except ValueError:
                answer = {"text": response.text[:300]}
            return {"status": response.status_code, "body": answer, "answered": time.time(), "retries": retries}

        return list(await asyncio.gather(*(one(b) for b in bodies)))


def verify_mp4s(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """Fetch each job's MP4 from its presigned URL: bytes > 0, an ``ftyp`` box first, the size the job states."""
    ok_ids, problems = [], []
    with httpx.Client(timeout=60) as http:
        for job in jobs:
            output = job.get("output") or {}
            try:
                data = http.get(output["url"]).raise_for_status().content
                if is_mp4(data) and len(data) == output.get("bytes", len(data)):
                    ok_ids.append(job["id"])
                else:
                    problems.append(f"{job['id']}: {len(data)} bytes, starts {data[:8]!r}")
            except (httpx.HTTPError, KeyError, TypeError) as exc:
                problems.append(f"{job['id']}: {type(exc).__name__}: {exc}"[:300])
    return {"checked": len(jobs), "ok": len(ok_ids), "problems": problems[:5], "ok_ids": ok_ids}


def job_row(job: dict[str, Any], quote: dict[str, Any] | None, mp4_ok: list[str]) -> dict[str, Any]:
    created = when(job["created_at"]) if job.get("created_at") else None

    def since(text: str | None) -> float | None:
        return None if created is None or not text else round(when(text) - created, 3)

    timings = job.get("timings") or {}
    return {
        "id": job["id"],
        "status": job["status"],
        "started_s": since(job.get("started_at")),
        "finished_s": since(job.get("finished_at")),
        "quoted_start_s": since(quote["start_at"]) if quote else None,
        "quoted_finish_s": since(quote["finish_at"]) if quote else None,
        "quoted_gpu_s": quote.get("gpu_seconds") if quote else None,
        **{k: timings.get(k) for k in STAGES},
        "mp4_ok": job["id"] in mp4_ok,
    }


# --- the report --------------------------------------------------------------------------------------------------


def summary(r: dict[str, Any]) -> dict[str, Any]:
    """The headline figures and whether each target was reached."""
    batch, plain = r.get("batch") or {}, r.get("plain") or {}
    s: dict[str, Any] = {
        "stack_videos_per_minute": batch.get("videos_per_minute"),
        "plain_videos_per_minute": plain.get("videos_per_minute"),
    }
    if s["stack_videos_per_minute"] and s["plain_videos_per_minute"]:
        ratio = s["stack_videos_per_minute"] / s["plain_videos_per_minute"]
        s["ratio"] = ratio
        s["ratio_target"] = f"≥ {TARGET_RATIO}×: {'reached' if ratio >= TARGET_RATIO else 'missed'}"
        s["ratio_moonshot"] = f"≥ {MOONSHOT_RATIO}×: {'reached' if ratio >= MOONSHOT_RATIO else 'missed'}"
    for name, share in (
        ("nvml", (batch.get("nvml") or {}).get("busy_share")),
        ("timeline", (batch.get("timeline") or {}).get("busy_share")),
    ):
        if share is not None:
            s[f"busy_share_{name}"] = share
            s[f"busy_target_{name}"] = f"≥ {TARGET_BUSY:.0%}: {'reached' if share >= TARGET_BUSY else 'missed'}"
    return s


def _f(value: Any, fmt: str = ".2f", none: str = "–") -> str:
    return none if value is None else format(value, fmt)


def _share(value: Any) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def markdown(r: dict[str, Any]) -> str:
    m, s = r["machine"], r.get("summary") or {}
    start, cal, batch, plain = (r.get(k) or {} for k in ("start", "calibration", "batch", "plain"))
    cache, mp4 = start.get("compile_cache") or {}, batch.get("mp4") or {}
    busy_target = f"≥ {TARGET_BUSY:.0%}"
    lines = [
        f"# gpu_stack: {m['gpu']}, {r['date_utc']}",
        "",
        f"`{r['command']}`",
        "",
        f"{r['model']} (random weights) at {r['shape']}, {r['steps']} steps, guidance {r['guidance_scale']}; the stack "
        f"(`vidq up`, exact tier, batch table {start.get('env', {}).get('VIDQ_WORKER_BATCH_TABLE') or 'none'}) takes "
        f"{r['jobs']} jobs submitted at once; the plain loop renders {r['plain_jobs']} of the same jobs with "
        "`WanPipeline.__call__` + `export_to_video`. Commit " + str(r["git_commit"]) + ".",
        "",
        "| figure | stack | plain diffusers | target |",
        "| --- | --- | --- | --- |",
        f"| videos per minute | {_f(s.get('stack_videos_per_minute'))} | {_f(s.get('plain_videos_per_minute'))} | "
        + (
            f"ratio **{s['ratio']:.2f}×**: {s['ratio_target']}; moonshot {s['ratio_moonshot']} |"
            if "ratio" in s
            else f"ratio ≥ {TARGET_RATIO}× (moonshot {MOONSHOT_RATIO}×) |"
        ),
        f"| window / loop s | {_f(batch.get('window_s'))} ({batch.get('succeeded', '–')} of {r['jobs']} "
        f"succeeded) | {_f(plain.get('loop_s'))} ({plain.get('done', '–')} of {r['plain_jobs']}) | |",
        f"| GPU busy, NVML (samples > 0%) | {_share((batch.get('nvml') or {}).get('busy_share'))} | "
        f"{_share((plain.get('nvml') or {}).get('busy_share'))} | {s.get('busy_target_nvml', busy_target)} |",
        f"| GPU mean utilization, NVML | {_share((batch.get('nvml') or {}).get('mean_utilization'))} | "
        f"{_share((plain.get('nvml') or {}).get('mean_utilization'))} | |",
        f"| GPU busy, the worker's render timeline | {_share((batch.get('timeline') or {}).get('busy_share'))} | | "
        f"{s.get('busy_target_timeline', (batch.get('timeline') or {}).get('why', busy_target))} |",
        f"| peak GPU memory GiB (NVML) | {_f((r.get('stack_nvml') or {}).get('peak_memory_gib'))} | "
        f"{_f((plain.get('nvml') or {}).get('peak_memory_gib'))} | |",
        f"| MP4s verified | {mp4.get('ok', '–')} of {mp4.get('checked', '–')} "
        f"| {plain.get('mp4_ok', '–')} of {plain.get('done', '–')} ({plain.get('writer') or '–'}) | |",
    ]
    if not r["nvml"]["available"]:
        lines += ["", f"NVML unavailable ({r['nvml']['why']}): no utilization or memory figures."]
    if start:
        lines += [
            "",
            f"Start: `vidq up` → worker loaded {_f(start.get('stack_start_to_worker_loaded_s'), '.1f')} s, every "
            f"process up {_f(start.get('stack_start_to_up_s'), '.1f')} s; the worker process's own start → ready "
            f"{_f(start.get('worker_start_to_ready_s'), '.1f')} s (warm-up {_f(start.get('warm_up_s'), '.1f')} s); "
            f"compile cache {'warm' if cache.get('warm') else 'empty'} ({cache.get('files_before', 0)} files, "
            f"{cache.get('bytes_before', 0) / 2**20:.0f} MiB before the start; the worker "
            f"{'loaded' if cache.get('worker_loaded_archive') else 'loaded no'} archive); stop "
            f"{_f(start.get('stop_s'), '.1f')} s.",
        ]
    if cal.get("jobs"):
        lines.append(
            "Calibration (not counted): "
            + ", ".join(f"{j['status']} in {j['submit_to_end_s']:.2f} s" for j in cal["jobs"])
            + "."
        )
    if batch.get("stages"):
        med = batch["stages"]["median_s"]
        stages = ", ".join(f"{k} {med[k]:.3f}" for k in STAGES if k in med)
        rendered = "; ".join(f"{k} {v}" for k, v in batch["stages"]["rendered_by"].items())
        peak = batch["stages"].get("peak_vram_gib_median")
        peak_text = f" The worker's peak VRAM per render (median): {peak:.1f} GiB." if peak else ""
        lines += ["", f"Stage medians (s): {stages}. Rendered by: {rendered}.{peak_text}"]
    if batch.get("eta"):
        e = batch["eta"]
        lines.append(
            f"ETA quotes: finish error p50 {_share(e['finish_error']['p50'])}, p90 {_share(e['finish_error']['p90'])} "
            f"(n {e['finish_error']['n']}); start error p50 {_share(e['start_error']['p50'])}, p90 "
            f"{_share(e['start_error']['p90'])} (n {e['start_error']['n']}; {e['started_at_once']} started at once); "
            f"{e['unquoted']} without a quote. Error = |actual − quoted| / actual, from created_at."
        )
    if batch.get("timeline", {}).get("renders"):
        t = batch["timeline"]
        lines.append(
            f"Render timeline: {t['renders']} renders ({t['jobs_in_renders']} jobs), {t['covered_s']:.2f} s covered "
            f"of {t['window_s']:.2f} s; gaps between renders: largest {t['largest_gap_s']:.3f} s, median "
            f"{t['median_gap_s']:.3f} s."
        )
    if batch.get("webhooks"):
        w = batch["webhooks"]
        lines.append(
            f"Webhooks: {w['delivered']} of {w['expected']} jobs' delivered ({w['deliveries']} deliveries, "
            f"{', '.join(w['types']) or 'none'}). Submits answered within {_f(batch.get('submits_answered_s'))} s, "
            f"{batch.get('submit_retries', 0)} retried."
        )
    if plain:
        lines += [
            "",
            f"Plain: build {_f(plain.get('build_s'), '.1f')} s, warm-up {_f(plain.get('warm_up_s'))} s; per video "
            f"`__call__` {_f(plain.get('pipe_s_median'))} s + MP4 write {_f(plain.get('write_s_median'))} s "
            f"(medians); {plain.get('dtype', '–')}, VAE float32"
            + (
                f"; torch peak allocated {plain['torch_peak_allocated_gib']:.1f} GiB"
                if "torch_peak_allocated_gib" in plain
                else ""
            )
            + (f". {plain['stopped']}" if plain.get("stopped") else "")
            + ".",
        ]
    for label, rows in (
        ("stack", (r.get("stack_nvml") or {}).get("per_process")),
        ("plain", plain.get("per_process")),
    ):
        if isinstance(rows, list) and rows:
            lines.append(
                f"GPU memory per process ({label}, peak): "
                + ", ".join(f"{p['process']} {p['peak_gib']:.1f} GiB" for p in rows)
                + "."
            )
        elif isinstance(rows, list):
            lines.append(f"GPU memory per process ({label}): NVML reported no process.")
        elif isinstance(rows, str):
            lines.append(f"GPU memory per process ({label}): {rows}.")
    for error in r["errors"]:
        lines.append(f"\nerror in {error['section']}: {error['error'][:400]}")
    lines += [
        "",
        f"Machine: {m['gpu']}, driver {m.get('driver') or '–'}, {m.get('gpu_memory_gib') or '–'} GiB; torch "
        f"{m.get('torch')}, CUDA {m.get('cuda') or '–'}, diffusers {m.get('diffusers')}, transformers "
        f"{m.get('transformers')}, Python {m['python']}, {m['cores']} CPU cores. "
        f"Elapsed {r.get('elapsed_s', 0):.0f} s.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # A SIGTERM (a `timeout` around the run) unwinds like Ctrl-C: the stack is stopped and the figures are written.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    bench = Bench(args)
    bench.write()
    bench.run()
    print(markdown(bench.report))
    print(f"results: {args.out / bench.stem}.json and .md", flush=True)
    return 1 if bench.report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
