"""A launcher for the processes the integration tests start: one process imports the libraries a `vidq` command
spends its start-up on (torch, diffusers, transformers, PyAV …) once, then forks each `vidq api` / `vidq worker`
the tests ask for. The child is the same program `python -m tools.cli …` would be: vidq's own modules, its
settings and its environment are loaded in the child, after the fork, from the environment the test gave it; only
third-party imports that read nothing of vidq's are shared. A worker then starts in about a second instead of
seven on a 2-core machine, and every test still gets real, private processes.

The launcher is the parent of what it forks, so it reaps them and answers their exit status; the tests see each
one through ``LaunchedPopen``, which has the three methods of ``subprocess.Popen`` that ``ManagedProcess`` uses.

Run as ``python -m tests.integration.launcher SOCKET``; one JSON request per connection on that Unix socket:
``{"op": "spawn", "argv", "env", "cwd", "log"}`` → ``{"pid"}``, ``{"op": "status", "pid"}`` → ``{"returncode"}``.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tools.processes import Child

# What a worker's and the API's start-up spends its seconds on. None of these reads a VIDQ_ variable or anything a
# test changes between processes (the launcher starts with the session's HF_HUB_OFFLINE and PYTHONUNBUFFERED).
# prometheus_client must stay out: it picks its multiprocess mode from the environment when it is imported.
PRELOAD = (
    "numpy",
    "torch",
    "av",
    "PIL.Image",
    "tokenizers",
    "safetensors.torch",
    "transformers",
    "diffusers.models.autoencoders.autoencoder_kl_wan",
    "diffusers.models.transformers.transformer_wan",
    "diffusers.pipelines.wan.pipeline_wan",
    "diffusers.schedulers.scheduling_unipc_multistep",
    "diffusers.schedulers.scheduling_flow_match_euler_discrete",
    "sqlalchemy.orm",
    "psycopg",
    "fastapi",
    "uvicorn",
    "minio",
    "httpx",
    "pydantic_settings",
)
NEVER_PRELOADED = ("prometheus_client", "shared", "services", "tools")
REQUEST_TIMEOUT_S = 10.0


# --- the launcher process -------------------------------------------------------------------------------------------


def _preload() -> None:
    for module in PRELOAD:
        importlib.import_module(module)
    leaked = [m for m in NEVER_PRELOADED if m in sys.modules]
    if leaked:
        raise SystemExit(f"launcher: preloading imported {leaked}; they must load in each child")


def _reap(statuses: dict[int, int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        statuses[pid] = os.waitstatus_to_exitcode(status)  # -N for a signal, as Popen.returncode


def _serve(path: str) -> dict[str, Any]:
    """Answer requests until killed. Returns only in a forked child, with the request it is to run."""
    statuses: dict[int, int] = {}
    children: set[int] = set()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(64)
        print("launcher ready", flush=True)
        while True:
            _reap(statuses)
            ready, _, _ = select.select([listener], [], [], 0.2)
            if not ready:
                continue
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(REQUEST_TIMEOUT_S)
                request = json.loads(conn.makefile("rb").readline())
                if request["op"] == "status":
                    _reap(statuses)
                    pid = int(request["pid"])
                    answer = {"returncode": statuses.get(pid)} if pid in children else {"error": "not mine"}
                    conn.sendall(json.dumps(answer).encode() + b"\n")
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    return dict(request)
                children.add(pid)
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")


def _become(request: dict[str, Any]) -> None:
    """In the forked child: the session, output, directory, environment and argv of the command, then run it."""
    os.setsid()  # a session of its own, as ManagedProcess's start_new_session
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    for sig in (signal.SIGTERM, signal.SIGQUIT, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if request.get("cwd"):
        os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv: list[str] = request["argv"]
    if argv[1:2] != ["-m"] or len(argv) < 3:
        raise SystemExit(f"launcher: only `python -m module …` commands can be forked, not {argv}")
    sys.argv = [argv[2], *argv[3:]]
    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)


def main() -> None:
    _preload()
    request = _serve(sys.argv[1])
    _become(request)  # the child's SystemExit (or the end of its module) ends it as a fresh interpreter would


# --- the tests' side -------------------------------------------------------------------------------------------------


def _ask(path: Path, request: Mapping[str, Any]) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(REQUEST_TIMEOUT_S)
        conn.connect(str(path))
        conn.sendall(json.dumps(request).encode() + b"\n")
        answer: dict[str, Any] = json.loads(conn.makefile("rb").readline())
    if "error" in answer:
        raise RuntimeError(f"launcher: {answer['error']} ({request})")
    return answer


class LaunchedPopen:
    """A launched child as ``subprocess.Popen`` shows one: ``pid``, ``poll()``, ``wait(timeout)``."""

    def __init__(self, path: Path, pid: int) -> None:
        self._path = path
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = _ask(self._path, {"op": "status", "pid": self.pid})["returncode"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (rc := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(0.05)
        return rc


class Launcher:
    """The launcher process, started by the test session; ``start`` is ProcessGroup's ``spawn``."""

    def __init__(self, *, workdir: Path, env: Mapping[str, str]) -> None:
        self.path = workdir / "launcher.sock"
        self.log_path = workdir / "launcher.log"
        root = Path(__file__).resolve().parents[2]
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "tests.integration.launcher", str(self.path)],
                cwd=root,
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_ready(self, *, timeout_s: float) -> None:
        from tools.processes import StartupError, log_tail

        deadline = time.monotonic() + timeout_s
        while "launcher ready" not in self.log_path.read_text(errors="replace"):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise StartupError(f"the test launcher did not start:\n{log_tail(self.log_path)}")
            time.sleep(0.05)

    def spawn(self, argv: Sequence[str], *, log_path: Path, cwd: Path | None, env: Mapping[str, str] | None) -> Child:
        from tools.processes import popen_in_session  # here: the launcher process itself imports nothing of vidq

        if list(argv[:2]) != [sys.executable, "-m"]:  # not a Python module of this interpreter: started as usual
            return popen_in_session(argv, log_path=log_path, cwd=cwd, env=env)
        log_path.touch()  # there once started, as with popen_in_session (the child opens it after the fork)
        request = {
            "op": "spawn",
            "argv": list(argv),
            "env": dict(os.environ if env is None else env),
            "cwd": str(cwd) if cwd else None,
            "log": str(log_path),
        }
        return LaunchedPopen(self.path, int(_ask(self.path, request)["pid"]))

    def close(self) -> None:
        self._proc.kill()
        self._proc.wait(10)


if __name__ == "__main__":
    main()
