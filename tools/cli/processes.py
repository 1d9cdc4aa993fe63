"""Starting and stopping vidq's own processes (``vidq up``, ``vidq demo`` and the integration tests)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


def vidq_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "tools.cli", *args]


@dataclass
class ProcessGroup:
    env: dict[str, str]
    log_dir: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = (self.log_dir / f"{name}.log").open("ab")
        # Own session: a signal to the group reaches Celery's pool children too.
        proc = subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        return proc

    def kill(self, name: str) -> None:
        """SIGKILL the whole process group (a crash: no warm shutdown, no acks) and forget it."""
        proc = self.procs.pop(name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    def stop(self, name: str, *, timeout_s: float = 20.0) -> None:
        proc = self.procs.pop(name)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError):  # leftovers of the group (pool children)
            os.killpg(proc.pid, signal.SIGKILL)

    def stop_all(self, *, timeout_s: float = 20.0) -> None:
        for name in list(self.procs)[::-1]:
            self.stop(name, timeout_s=timeout_s)

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.log_dir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")


def wait_http(url: str, *, timeout_s: float, group: ProcessGroup | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if group is not None:
            group.check_alive()
        try:
            r = httpx.get(url, timeout=2.0)
            if r.status_code == 200:
                return
            last = f"{r.status_code} {r.text[:300]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.3)
    raise TimeoutError(f"{url} not ready after {timeout_s}s: {last}")


def wait_for_log(group: ProcessGroup, name: str, needle: str, *, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    path = group.log_dir / f"{name}.log"
    while time.monotonic() < deadline:
        group.check_alive()
        if path.exists() and needle in path.read_text(errors="replace"):
            return
        time.sleep(0.2)
    raise TimeoutError(f"{name} never logged {needle!r}:\n{group.log_tail(name)}")
