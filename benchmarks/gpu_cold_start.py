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
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from shared.spec import parse_shape
from tools.processes import free_ports, log_tail, popen_in_session, vidq_argv

MODEL = "wan2.1-1.3b-arch"  # its real compute cost, random weights


class Stack:
    """``vidq up`` in a state directory of its own, driven from outside as a user would: started, keyed, sent
    jobs over REST, stopped with Ctrl-C."""

    def __init__(self, state_dir: Path, env: dict[str, str]) -> None:
        self.state_dir = state_dir
        state_dir.mkdir(parents=True, exist_ok=True)
        api_port, flower_port = free_ports(2)
        self.api = f"http://127.0.0.1:{api_port}"
        self.env = {**os.environ, **env, "VIDQ_API_PORT": str(api_port), "PYTHONUNBUFFERED": "1"}
        self.flower_port = flower_port
        self.log = state_dir / "up.log"

    def start(self, *, timeout_s: float = 600) -> float:
        """Start and wait until the worker has loaded (and warmed up) its model: seconds since the start."""
        self.started = time.monotonic()
        argv = vidq_argv("up", "--state-dir", str(self.state_dir), "--flower-port", str(self.flower_port))
        self.proc = popen_in_session(argv, log_path=self.log, cwd=None, env=self.env)
        worker_log = self.state_dir / "logs" / "worker.log"
        while "pipeline loaded" not in (worker_log.read_text(errors="replace") if worker_log.exists() else ""):
            if self.proc.poll() is not None:
                raise RuntimeError(f"vidq up exited with {self.proc.poll()}:\n{log_tail(self.log)}")
            if time.monotonic() - self.started > timeout_s:
                raise TimeoutError(f"the worker did not load within {timeout_s:.0f} s:\n{log_tail(worker_log)}")
            time.sleep(0.5)
        ready = time.monotonic() - self.started
        self.worker_start = self.worker_started()
        while not (self.state_dir / "env").exists():  # written once every process is up
            if self.proc.poll() is not None or time.monotonic() - self.started > timeout_s:
                raise RuntimeError(f"vidq up did not come up:\n{log_tail(self.log)}")
            time.sleep(0.2)
        self.key = self._create_key()
        return ready

    def _create_key(self) -> str:
        stack_env = dict(
            line.split("=", 1) for line in (self.state_dir / "env").read_text().splitlines() if "=" in line
        )
        env = {**self.env, **{k: shlex.split(v)[0] if v else "" for k, v in stack_env.items()}}
        out = subprocess.run(
            vidq_argv("create-key", "--tenant", "bench"), env=env, capture_output=True, text=True, timeout=60
        )
        if out.returncode:
            raise RuntimeError(f"create-key failed: {out.stderr[-2000:]}")
        return str(json.loads(out.stdout)["api_key"])

    def render(self, body: dict[str, Any], *, timeout_s: float = 600) -> tuple[dict[str, Any], float]:
        """Submit a job and wait for its end: the job's body and the seconds from submit to its end."""
        headers = {"Authorization": f"Bearer {self.key}"}
        with httpx.Client(base_url=self.api, headers=headers, timeout=30) as client:
            started = time.monotonic()
            response = client.post("/v1/jobs", json=body)
            response.raise_for_status()
            job_id = response.json()["id"]
            while time.monotonic() - started < timeout_s:
                job = client.get(f"/v1/jobs/{job_id}").raise_for_status().json()
                if job["status"] in {"succeeded", "failed", "cancelled"}:
                    return job, time.monotonic() - started
                time.sleep(0.2)
        raise TimeoutError(f"job {job_id} did not end within {timeout_s:.0f} s")

    def worker_started(self) -> float:
        """The video worker's process start (unix seconds): it is a child of ``vidq up`` named by its argv."""
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            argv = child.cmdline()
            if "worker" in argv and "--role" in argv and argv[argv.index("--role") + 1] == "video":
                return float(child.create_time())
        raise RuntimeError("no video worker process under vidq up")

    def worker_log_seconds(self, started: float) -> dict[str, float]:
        """Process start → "pipeline loaded" in its log (the model build and the warm-up included), and the
        warm-up's own seconds."""
        lines = [
            json.loads(x) for x in (self.state_dir / "logs" / "worker.log").read_text().splitlines() if x[:1] == "{"
        ]
        loaded = next(x for x in lines if x.get("msg") == "pipeline loaded")
        return {
            "worker_start_to_ready_s": dt.datetime.fromisoformat(loaded["ts"]).timestamp() - started,
            "warm_up_s": sum((loaded.get("warmed_up_s") or {}).values()),
        }

    def stop(self) -> None:
        """Ctrl-C, as a user stops it; killed if it is still there after two minutes."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)


def job_body(shape: str, seed: int, *, steps: int, model: str = MODEL) -> dict[str, Any]:
    height, width, frames = parse_shape(shape)
    fps = 16
    return {
        "prompt": "a red fox runs through fresh snow in a quiet forest at sunrise",
        "model": model,
        "cache": False,  # always render: a stored result would answer without the GPU
        "width": width,
        "height": height,
        "duration_s": (frames - 1) / fps,  # 4k+1 frames: (frames - 1) / fps seconds at fps gives exactly frames
        "fps": fps,
        "steps": steps,
        "guidance_scale": 5.0,
        "seed": seed,
    }


def stack_env(warm_up: list[str], cache_dir: Path, *, model: str = MODEL, device: str = "cuda") -> dict[str, str]:
    return {
        "VIDQ_DEFAULT_MODEL": model,
        "VIDQ_DEVICE": device,
        "VIDQ_WORKER_WARMUP_SHAPES": json.dumps(warm_up),
        "VIDQ_WORKER_COMPILE_CACHE_DIR": str(cache_dir),
        "HF_HUB_OFFLINE": "1",
    }


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
    gpu = re.sub(r"[^a-z0-9]+", "_", report["gpu"].lower().replace("nvidia", "")).strip("_")
    return f"gpu_cold_start_{gpu}_{dt.date.today():%Y%m%d}"


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
