"""Child processes with a log file, a process group of their own and deadlines on every wait."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import IO

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"


class StartupError(RuntimeError):
    """A backing service did not come up before its deadline (the message carries its log tail)."""


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


class ManagedProcess:
    """One long-running child: its own session (a Ctrl-C meant for the parent does not reach it, and the
    whole group can be signalled), output appended to ``log_path``."""

    def __init__(
        self, argv: Sequence[str], *, log_path: Path, cwd: Path | None = None, name: str | None = None
    ) -> None:
        self.argv = list(argv)
        self.log_path = log_path
        self.cwd = cwd
        self.name = name or Path(self.argv[0]).name
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> None:
        self._log = self.log_path.open("ab")
        self._proc = subprocess.Popen(
            self.argv,
            cwd=self.cwd,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def poll(self) -> int | None:
        """The exit status once the child has exited, else None."""
        return self._proc.poll() if self._proc is not None else None

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    def stop(self, *, grace_s: float, kill_wait_s: float = 10.0) -> None:
        """SIGTERM the group, SIGKILL it if the child has not exited within ``grace_s``. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                if proc.poll() is None:
                    self._signal_group(proc.pid, signal.SIGTERM)
                    try:
                        proc.wait(grace_s)
                    except subprocess.TimeoutExpired:
                        logger.info("%s did not exit %.0f s after SIGTERM; killing it", self.name, grace_s)
                        self._signal_group(proc.pid, signal.SIGKILL)
                        proc.wait(kill_wait_s)
            finally:
                # Helpers the child forked (a redis background save, say) share its group; none may outlive it.
                self._signal_group(proc.pid, signal.SIGKILL)
        if self._log is not None:
            self._log.close()
            self._log = None

    @staticmethod
    def _signal_group(pgid: int, sig: signal.Signals) -> None:
        with suppress(ProcessLookupError):  # the whole group has already exited
            os.killpg(pgid, sig)


def wait_until(
    check: Callable[[], bool],
    *,
    timeout_s: float,
    what: str,
    process: ManagedProcess | None = None,
    log_path: Path | None = None,
    interval_s: float = 0.1,
) -> None:
    """Call ``check`` until it returns True; raise StartupError once ``timeout_s`` has passed or ``process``
    has exited. An exception from ``check`` counts as "not yet". ``check`` must bound its own time (every
    probe here takes a timeout)."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while True:
        if process is not None and (rc := process.poll()) is not None:
            raise StartupError(f"{what} exited with status {rc} before it was ready:\n{process.log_tail()}")
        try:
            if check():
                return
        except Exception as exc:  # any failure means "not ready yet"; the last one is reported at the deadline
            last_error = exc
        if time.monotonic() >= deadline:
            path = process.log_path if process is not None else log_path
            tail = f"\n{log_tail(path)}" if path is not None else ""
            raise StartupError(f"{what} not ready after {timeout_s:.0f} s (last error: {last_error!r}){tail}")
        time.sleep(interval_s)
