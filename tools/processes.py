"""Child processes for ``vidq up``/``vidq demo``, the devstack's embedded services and the integration tests: each
in a session of its own with its output in a log file, and a deadline on every wait."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import httpx

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"


class StartupError(RuntimeError):
    """A child or service did not come up before its deadline, or exited first (the message carries its log tail)."""


def vidq_argv(*args: str) -> list[str]:
    """The argv of a ``vidq`` subcommand run by this interpreter (so a virtualenv need not be on PATH)."""
    return [sys.executable, "-m", "tools.cli", *args]


def free_ports(count: int) -> list[int]:
    """Ports free on HOST right now. Another process may still take one before our child binds it; the
    child then exits at once and its start fails with the log tail, rather than hanging."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        # All sockets stay bound until every port is chosen, so the kernel cannot hand out one port twice.
        for sock in socks:
            sock.bind((HOST, 0))
        return [sock.getsockname()[1] for sock in socks]


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return "\n".join(text.splitlines()[-lines:])


class Child(Protocol):
    """What ManagedProcess needs of a started child: ``subprocess.Popen``'s pid, poll and wait."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class Spawn(Protocol):
    """Starts ``argv`` in a session of its own, stdin empty, stdout and stderr appended to ``log_path``."""

    def __call__(
        self, argv: Sequence[str], *, log_path: Path, cwd: Path | None, env: Mapping[str, str] | None
    ) -> Child: ...


def popen_in_session(argv: Sequence[str], *, log_path: Path, cwd: Path | None, env: Mapping[str, str] | None) -> Child:
    # The child gets its own copy of the descriptor, so ours is closed as soon as it has started.
    with log_path.open("ab") as log:
        return subprocess.Popen(
            list(argv),
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with suppress(ProcessLookupError):  # the whole group has already exited
        os.killpg(pgid, sig)


class ManagedProcess:
    """One long-running child, started on construction. Its own session: a Ctrl-C meant for the parent does not
    reach it, and a signal to its group reaches what it forked too (Celery's pool children, a redis background
    save). Output is appended to ``log_path``."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        log_path: Path,
        name: str | None = None,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
        spawn: Spawn = popen_in_session,
    ) -> None:
        self.log_path = log_path
        self.name = name or Path(argv[0]).name
        self._stopped = False
        self._terminated = False
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._popen = spawn(argv, log_path=log_path, cwd=cwd, env=env)

    @property
    def pid(self) -> int:
        return self._popen.pid

    def poll(self) -> int | None:
        """The exit status once the child has exited, else None."""
        return self._popen.poll()

    def wait(self, timeout: float | None = None) -> int:
        """Popen.wait: the exit status, or TimeoutExpired."""
        return self._popen.wait(timeout)

    def check_alive(self) -> None:
        if (rc := self.poll()) is not None:
            raise StartupError(f"{self.name} exited with status {rc}:\n{log_tail(self.log_path)}")

    def kill(self, *, wait_s: float = 10.0) -> None:
        """SIGKILL the whole group: a crash, with no warm shutdown and no acks."""
        _signal_group(self.pid, signal.SIGKILL)
        self._popen.wait(wait_s)

    def terminate(self) -> None:
        """SIGTERM the group, once, without waiting (``stop`` waits)."""
        if not self._terminated and self.poll() is None:
            _signal_group(self.pid, signal.SIGTERM)
        self._terminated = True

    def stop(self, *, grace_s: float, kill_wait_s: float = 10.0) -> None:
        """SIGTERM the group, SIGKILL it if the child has not exited within ``grace_s``. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self.terminate()
            try:
                self._popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                logger.info("%s did not exit %.0f s after SIGTERM; killing it", self.name, grace_s)
        finally:
            # Also when the child has exited: what it forked shares its group and none of it may outlive it.
            self.kill(wait_s=kill_wait_s)


@dataclass
class ProcessGroup:
    """Named children sharing one environment, each logging to ``<log_dir>/<name>.log``."""

    env: dict[str, str]
    log_dir: Path
    procs: dict[str, ManagedProcess] = field(default_factory=dict)
    spawn: Spawn = popen_in_session  # the test suite forks its children from a launcher that has their imports

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def start(self, name: str, argv: list[str]) -> ManagedProcess:
        proc = ManagedProcess(argv, log_path=self.log_path(name), name=name, env=self.env, spawn=self.spawn)
        self.procs[name] = proc
        return proc

    def kill(self, name: str) -> None:
        """SIGKILL the whole process group (a crash) and forget it."""
        self.procs.pop(name).kill()

    def stop(self, name: str, *, timeout_s: float = 20.0) -> None:
        self.procs.pop(name).stop(grace_s=timeout_s)

    def stop_all(self, *, timeout_s: float = 20.0, grace_s: Mapping[str, float] | None = None) -> None:
        """SIGTERM every child at once (last started first), then give each until its own deadline: ``grace_s`` of
        its name, else ``timeout_s``, counted from now. The whole stop takes the longest grace, not their sum."""
        started = time.monotonic()
        names = list(self.procs)[::-1]
        for name in names:
            self.procs[name].terminate()
        for name in names:
            limit = (grace_s or {}).get(name, timeout_s)
            # Forgotten only once stopped: an interrupted stop_all leaves the rest for kill_all.
            self.procs[name].stop(grace_s=max(0.0, started + limit - time.monotonic()))
            del self.procs[name]

    def kill_all(self) -> None:
        """SIGKILL every child's group at once and forget them."""
        for name in list(self.procs):
            self.kill(name)

    def check_alive(self) -> None:
        for proc in self.procs.values():
            proc.check_alive()


class _Watched(Protocol):
    def check_alive(self) -> None: ...


def wait_until(
    check: Callable[[], bool],
    *,
    timeout_s: float,
    what: str,
    watch: _Watched | None = None,
    log_path: Path | None = None,
    interval_s: float = 0.1,
) -> None:
    """Call ``check`` until it returns True; raise StartupError once ``timeout_s`` has passed or a process in
    ``watch`` has exited. An exception from ``check`` counts as "not yet" and the last one is reported at the
    deadline, with the tail of ``log_path`` (by default ``watch``'s own log). ``check`` must bound its own time
    (every probe here takes a timeout)."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while True:
        if watch is not None:
            watch.check_alive()
        try:
            if check():
                return
        except Exception as exc:  # any failure means "not ready yet"
            last_error = exc
        if time.monotonic() >= deadline:
            path = log_path or (watch.log_path if isinstance(watch, ManagedProcess) else None)
            tail = f"\n{log_tail(path)}" if path is not None else ""
            raise StartupError(f"{what} not ready after {timeout_s:.0f} s (last error: {last_error!r}){tail}")
        time.sleep(interval_s)


def wait_http(url: str, *, timeout_s: float, group: ProcessGroup | None = None) -> None:
    """Wait until ``url`` answers 200, failing early if a process of ``group`` exits."""

    def answers_200() -> bool:
        response = httpx.get(url, timeout=2.0)
        if response.status_code != 200:
            # Raised rather than returned so that the last answer is in the error at the deadline.
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
        return True

    wait_until(answers_200, timeout_s=timeout_s, what=url, watch=group, interval_s=0.3)


def wait_for_log(group: ProcessGroup, name: str, needle: str, *, timeout_s: float) -> None:
    """Wait until ``name``'s log contains ``needle``, failing early if a process of ``group`` exits."""
    path = group.log_path(name)
    wait_until(
        lambda: needle in path.read_text(errors="replace"),
        timeout_s=timeout_s,
        what=f"{name} (waiting for {needle!r} in its log)",
        watch=group,
        log_path=path,
        interval_s=0.2,
    )
