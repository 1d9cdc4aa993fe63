"""The whole stack on one machine, driven from outside as a user drives it (``vidq up``, an API key, jobs over
REST, Ctrl-C), for the benchmarks that measure a GPU box through the service: ``gpu_cold_start`` and ``gpu_stack``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from shared.spec import parse_shape
from tools.processes import free_ports, log_tail, popen_in_session, vidq_argv

MODEL = "wan2.1-1.3b-arch"  # its real compute cost, random weights
FINAL = frozenset({"succeeded", "failed", "cancelled"})


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
        self.worker_log = state_dir / "logs" / "worker.log"
        self.proc: Any = None

    def start(self, *, timeout_s: float = 600) -> float:
        """Start and wait until the worker has loaded (and warmed up) its model: seconds since the start."""
        self.started = time.monotonic()
        self.started_unix = time.time()
        argv = vidq_argv("up", "--state-dir", str(self.state_dir), "--flower-port", str(self.flower_port))
        self.proc = popen_in_session(argv, log_path=self.log, cwd=None, env=self.env)
        while not self.worker_loaded():
            if self.proc.poll() is not None:
                raise RuntimeError(f"vidq up exited with {self.proc.poll()}:\n{log_tail(self.log)}")
            if time.monotonic() - self.started > timeout_s:
                raise TimeoutError(f"the worker did not load within {timeout_s:.0f} s:\n{log_tail(self.worker_log)}")
            time.sleep(0.2)
        ready = time.monotonic() - self.started
        self.worker_start = self.worker_started()
        while not (self.state_dir / "env").exists():  # written once every process is up
            if self.proc.poll() is not None or time.monotonic() - self.started > timeout_s:
                raise RuntimeError(f"vidq up did not come up:\n{log_tail(self.log)}")
            time.sleep(0.1)
        self.up_s = time.monotonic() - self.started
        self.key = self._create_key()
        return ready

    def worker_loaded(self) -> bool:
        """Whether the video worker has logged "pipeline loaded" (its model built and warmed up)."""
        return self.worker_log.exists() and "pipeline loaded" in self.worker_log.read_text(errors="replace")

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

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def render(
        self, body: dict[str, Any], *, timeout_s: float = 600, poll_s: float = 0.2
    ) -> tuple[dict[str, Any], float]:
        """Submit a job and wait for its end: the job's body and the seconds from submit to its end."""
        with httpx.Client(base_url=self.api, headers=self.headers, timeout=30) as client:
            started = time.monotonic()
            response = client.post("/v1/jobs", json=body)
            response.raise_for_status()
            job_id = response.json()["id"]
            while time.monotonic() - started < timeout_s:
                job = client.get(f"/v1/jobs/{job_id}").raise_for_status().json()
                if job["status"] in FINAL:
                    return job, time.monotonic() - started
                time.sleep(poll_s)
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
        lines = [json.loads(x) for x in self.worker_log.read_text().splitlines() if x[:1] == "{"]
        loaded = next(x for x in lines if x.get("msg") == "pipeline loaded")
        return {
            "worker_start_to_ready_s": dt.datetime.fromisoformat(loaded["ts"]).timestamp() - started,
            "warm_up_s": sum((loaded.get("warmed_up_s") or {}).values()),
        }

    def processes(self) -> dict[int, str]:
        """Every process under ``vidq up`` by pid, named after the ``vidq`` subcommand it runs or descends from
        ("worker video", "prewarmer", "api", …; an embedded service by its executable)."""
        if self.proc is None:
            return {}
        names: dict[int, str] = {}
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    names[child.pid] = _role(child)
        return names

    def stop(self, *, wait_s: float = 120) -> None:
        """Ctrl-C, as a user stops it (a running job may finish); after ``wait_s`` a second Ctrl-C (everything
        stops at once), after 30 s more it is killed. Then any process it had started that is still alive (a child
        of ``vidq up`` lives in a session of its own, so a signal to the group of ``vidq up`` never reaches it) is
        killed by its pid: nothing of the stack holds the GPU afterwards."""
        if self.proc is None:
            return
        children = _descendants(self.proc.pid)
        for sig, wait in ((signal.SIGINT, wait_s), (signal.SIGINT, 30.0), (signal.SIGKILL, 30.0)):
            if self.proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(wait)
        _gone, alive = psutil.wait_procs(children, timeout=10)
        for process in alive:
            with contextlib.suppress(psutil.Error):
                process.kill()
        psutil.wait_procs(alive, timeout=10)


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return list(psutil.Process(pid).children(recursive=True))
    except psutil.Error:
        return []


def _role(process: psutil.Process) -> str:
    """The ``vidq`` subcommand ``process`` runs, or the nearest of its parents' (a Celery pool process is named
    after its worker), else its executable's name."""
    for p in [process, *process.parents()]:
        argv: list[str] = p.cmdline()
        if "tools.cli" in argv and argv.index("tools.cli") + 1 < len(argv):
            command = argv[argv.index("tools.cli") + 1]
            if "--role" in argv and argv.index("--role") + 1 < len(argv):
                command += f" {argv[argv.index('--role') + 1]}"
            return command + (" (pool process)" if p is not process else "")
    return str(process.name())


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


def gpu_slug(name: str) -> str:
    """A GPU's name as results' file names carry it: "NVIDIA H200" → ``h200``, the CPU → ``cpu``."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower().replace("nvidia", "")).strip("_")
